"""``python -m service.worker``: a bare worker on ``SIDEQUEST_DATABASE_URL`` (no migrations, no embedded
database) — what the multi-process tests start; operators use ``sidequest worker``."""

from __future__ import annotations

import logging
import sys

from service.config import SettingsError, load_settings
from service.worker import run_worker_forever


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"sidequest worker: {exc}", file=sys.stderr)
        return 2
    if not settings.database_url:
        print("sidequest worker: SIDEQUEST_DATABASE_URL is required here", file=sys.stderr)
        return 2
    run_worker_forever(settings, settings.database_url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
