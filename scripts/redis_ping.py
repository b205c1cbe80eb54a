"""Exit 0 when a Redis server answers PING at the given URL.

Usage: redis_ping.py URL [--wait SECONDS]
"""

from __future__ import annotations

import argparse
import sys
import time

import redis


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--wait", type=float, default=0.0, help="keep trying this long")
    args = parser.parse_args()
    deadline = time.monotonic() + args.wait
    client = redis.Redis.from_url(args.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    while True:
        try:
            if client.ping():
                return 0
        except (redis.ConnectionError, redis.TimeoutError):
            pass
        if time.monotonic() >= deadline:
            return 1
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
