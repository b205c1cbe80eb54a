"""`python -m engine.worker ...`: what the local launcher spawns (same options as `omniflow worker`)."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.worker.options import WorkerOptionError, add_worker_arguments, worker_config
from engine.worker.process import run_role_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.worker", description="run one role worker")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = worker_config(args)
    except WorkerOptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return run_role_worker(config)


if __name__ == "__main__":
    sys.exit(main())
