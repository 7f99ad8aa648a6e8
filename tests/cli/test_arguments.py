"""The CLI's own argument checks: refused by argparse (exit 2) before anything starts."""

from __future__ import annotations

import pytest

from service.cli import build_parser


@pytest.mark.parametrize("port", ["70000", "0", "-1", "eighty"])
def test_serve_refuses_a_port_out_of_range_before_starting_anything(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused, not wrapped: --port 70000 would listen on 4464 (70000 mod 65536) while logging 70000."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--port", port])
    assert exited.value.code == 2 and "--port" in capsys.readouterr().err
