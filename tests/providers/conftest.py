"""Provider tests talk to the scripted model server over real HTTP.

One server per test module (reset before every test) keeps the suite fast: starting a server is cheap, but
building an SDK client (its TLS context) is not, so adapters are shared per module too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.scripted_provider import ScriptedServer, scripted_server

__all__ = ["scripted_server"]


@pytest.fixture(scope="module")
def module_server() -> Iterator[ScriptedServer]:
    with ScriptedServer() as server:
        yield server


@pytest.fixture
def server(module_server: ScriptedServer) -> ScriptedServer:
    """The module's scripted server, with no scripted steps or recorded requests left from other tests."""
    module_server.reset()
    return module_server
