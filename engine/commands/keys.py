"""`omniflow keys generate DIR`: the worker plane's CURVE keys for workers started by hand.

Copy DIR (keeping its 0700/0600 modes) to every host that runs the deployment's workers and
to the process that dispatches to them, and start each with `--keys DIR`
(`engine.data.curve`). A local cluster makes its own keys; this is for the other cases.
`--bulk` says how the plane carries tensors and KV pages between hosts (`clear`, the default:
outside CURVE under one-time grants, readable on the wire; `mac`: the same, each chunk MAC'd;
`encrypted`: inside CURVE, for networks others can read; `engine.data.bulk`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.data.curve import BulkMode, PlaneKeyError, PlaneKeys, fingerprint


def _generate(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    if directory.exists() and any(directory.iterdir()) and not args.force:
        print(f"error: {directory} is not empty (--force replaces the keys in it)", file=sys.stderr)
        return 1
    keys = PlaneKeys.generate(BulkMode(args.bulk))
    try:
        keys.write(directory)
    except PlaneKeyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote the worker plane's keys to {directory} (public key {keys.public}, fingerprint"
          f" {fingerprint(keys.public)}, bulk {keys.bulk.value}); start workers with --keys {directory}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("keys", help="make the worker plane's CURVE keys")
    actions = parser.add_subparsers(dest="keys_command", required=True)
    generate = actions.add_parser("generate", help="write a fresh keypair into DIR (0700, files 0600)")
    generate.add_argument("directory", metavar="DIR")
    generate.add_argument("--force", action="store_true", help="replace keys already in DIR")
    generate.add_argument("--bulk", choices=[m.value for m in BulkMode], default=BulkMode.CLEAR.value,
                          help="how tensors and KV pages travel between hosts: clear (default; outside CURVE,"
                               " under one-time grants, readable on the wire), mac (the same, each chunk MAC'd),"
                               " encrypted (inside CURVE: for networks others can read; a third of the bandwidth)")
    generate.set_defaults(handler=_generate)
