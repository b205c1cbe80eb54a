"""`omniflow worker --role NAME --workflow PATH [--registry URL] [--listen ADDR]`."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.worker.options import WorkerOptionError, add_worker_arguments, worker_config
from engine.worker.process import run_role_worker


def _handle(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = worker_config(args)
    except WorkerOptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return run_role_worker(config)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("worker", help="run a role worker process")
    add_worker_arguments(parser)
    parser.set_defaults(handler=_handle)
