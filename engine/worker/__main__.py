"""`python -m engine.worker ...`: what the local launcher spawns (same options as `omniflow worker`)."""

from __future__ import annotations

import argparse
import sys

from engine.worker.options import add_worker_arguments, run_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.worker", description="run one role worker")
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
