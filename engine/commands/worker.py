"""`omniflow worker --role NAME --workflow PATH [--registry URL] [--listen ADDR]`."""

from __future__ import annotations

import argparse

from engine.worker.options import add_worker_arguments, run_worker


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("worker", help="run a role worker process")
    add_worker_arguments(parser)
    parser.set_defaults(handler=run_worker)
