"""Exit 0 when a PostgreSQL server accepts a connection at the given URL."""

from __future__ import annotations

import sys

import psycopg


def main() -> int:
    try:
        with psycopg.connect(sys.argv[1], connect_timeout=2):
            return 0
    except psycopg.OperationalError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
