"""The `omniflow` command line.

    omniflow validate PATH
    omniflow export PATH --format json|python
    omniflow run PATH [--input NAME=VALUE ...] [--json] [--timeout S]
    omniflow bench NAME [--json]
    omniflow keys generate DIR

PATH is a DSL module (`.py`) or a GraphSpec (`.json`). Exit status 0 on success, 1 on
invalid input (every problem printed), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np
import uvloop

from engine.compute.threads import wait_passively
from engine.data.kv.ref import KVRef
from engine.data.peer import Peer, PeerConfig
from engine.data.wire import TensorRef
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.events import NodeProgressEvent, NodeStateEvent, RunFinished
from engine.flow.executor import Executor, RunInputError, RunResult
from engine.flow.loader import WorkflowLoadError, load_workflow
from engine.flow.plan import Plan, build_plan
from engine.flow.pysrc import to_python
from engine.flow.remote import WorkerDispatcher
from engine.flow.validate import GraphValidationError
from engine.spec.graph import GraphSpec, encode_spec
from engine.spec.kinds import default_kinds
from engine.spec.ops import OpConfig, default_ops
from engine.worker.launcher import LaunchError, LocalCluster


def available_benchmarks() -> list[str]:
    """Modules of `engine.bench` that define `run`; `_`-prefixed ones are helpers."""
    import engine.bench

    return sorted(m.name for m in pkgutil.iter_modules(engine.bench.__path__) if not m.name.startswith("_"))


class CliError(Exception):
    """A problem with the user's input: printed, exit status 1."""


def _load(path: str) -> GraphSpec:
    try:
        return load_workflow(path)
    except WorkflowLoadError as exc:
        raise CliError(str(exc)) from None


def _print_issues(exc: GraphValidationError, out: TextIO) -> None:
    print(f"invalid workflow: {len(exc.issues)} problem{'s' if len(exc.issues) != 1 else ''}", file=out)
    for issue in exc.issues:
        where = ", ".join(f"{k}={v}" for k, v in (("node", issue.node), ("edge", issue.edge),
                                                     ("port", issue.port), ("role", issue.role)) if v)
        print(f"  [{issue.code}] {issue.message}" + (f"  ({where})" if where else ""), file=out)


def cmd_validate(args: argparse.Namespace) -> int:
    spec = _load(args.path)
    build_plan(spec, default_kinds(), trusted_ops())
    print(f"{args.path}: workflow {spec.name!r} is valid ({len(spec.nodes)} nodes, {len(spec.edges)} edges)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    spec = _load(args.path)
    if args.format == "json":
        text = json.dumps(json.loads(encode_spec(spec)), indent=2) + "\n"
    else:
        text = to_python(spec)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


def parse_inputs(spec: GraphSpec, pairs: Sequence[str]) -> dict[str, Any]:
    """`NAME=VALUE` pairs: text inputs take VALUE as is, other types parse it as JSON."""
    types = {n.id: n.outputs["value"].type for n in spec.nodes if n.kind == "input"}
    values: dict[str, Any] = {}
    problems = []
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep:
            problems.append(f"--input {pair!r}: expected NAME=VALUE")
            continue
        if name not in types:
            problems.append(f"--input {name}: the workflow has no input {name!r} (inputs: {sorted(types) or 'none'})")
            continue
        if types[name] == "text":
            values[name] = raw
            continue
        try:
            values[name] = json.loads(raw)
        except json.JSONDecodeError:
            problems.append(f"--input {name}: {raw!r} is not JSON (input {name!r} is of type {types[name]};"
                            " quote strings, e.g. '\"text\"')")
    if problems:
        raise CliError("\n".join(problems))
    return values


async def _execute(executor: Executor, plan: Plan, inputs: dict[str, Any], timeout_s: float | None,
                   progress: TextIO | None) -> RunResult:
    run = await executor.submit(plan, inputs, timeout_s=timeout_s)
    if progress is not None:
        async for event in run.events():
            _show_progress(event, progress)
    return await run.wait()


def trusted_ops() -> OpConfig:
    """The command line's ops: every registered op, and `module:function` ops (a person running
    their own code on their own machine)."""
    return OpConfig(default_ops(), allow_module_ops=True)


async def _run(args: argparse.Namespace, spec: GraphSpec, inputs: dict[str, Any], progress: TextIO | None):
    kinds = default_kinds()
    ops = trusted_ops()
    plan = build_plan(spec, kinds, ops)  # every problem reported before anything runs or is spawned
    if args.workers == "inproc":
        from engine.worker.units import SharedUnits  # torch: only for a run in this process

        executor = Executor(InProcessDispatcher(kinds, build=SharedUnits(kinds, ops=ops)), kinds)
        try:
            return await _execute(executor, plan, inputs, args.timeout, progress)
        finally:
            await executor.aclose()
    cluster = LocalCluster(spec, allow_module_ops=ops.allow_module_ops, registry_url=args.registry)
    with Peer.start(PeerConfig(keys=cluster.keys)) as peer:
        async with cluster:
            executor = Executor(WorkerDispatcher(cluster.registry, peer), kinds)
            try:
                result = await _execute(executor, plan, inputs, args.timeout, progress)
            finally:
                await executor.aclose()
            result.outputs = {k: materialize(v, peer) for k, v in result.outputs.items()}
            return result


def materialize(value: Any, peer: Peer) -> Any:
    """A run output fetched from the worker that holds it, as plain data: a byte blob (1-D
    uint8: a PNG, a WAV) as bytes, any other tensor as nested lists."""
    if isinstance(value, TensorRef):
        array = peer.pull(value).numpy(copy=True)
        return array.tobytes() if array.dtype == np.uint8 and array.ndim == 1 else array.tolist()
    return value


def _printable(value: Any) -> Any:
    """What `json` cannot write: byte blobs as their size (the media themselves are for files),
    typed values (an llm node's `KVRef`) as their JSON, else repr."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": len(value)}
    if isinstance(value, KVRef):
        return value.to_json()
    return repr(value)


PROGRESS_BAR = 20
"""Characters of the progress bar `omniflow run` draws on standard error."""


def _show_progress(event: Any, out: TextIO) -> None:
    if isinstance(event, NodeStateEvent) and event.state in ("running", "done", "failed", "skipped", "cancelled"):
        extra = f" {event.duration_ms:.1f} ms" if event.duration_ms is not None else ""
        extra += f" ({event.error})" if event.error else ""
        extra += f" on {event.worker} ({event.host})" if event.worker else ""
        iteration = f" #{event.iteration}" if event.iteration > 1 else ""
        print(f"  {event.node}{iteration}: {event.state}{extra}", file=out, flush=True)
    elif isinstance(event, NodeProgressEvent):
        bar = ""
        if event.progress is not None:
            filled = round(event.progress * PROGRESS_BAR)
            bar = f" [{'#' * filled}{'-' * (PROGRESS_BAR - filled)}] {event.progress * 100:.0f}%"
        print(f"  {event.node}:{bar} {event.message}", file=out, flush=True)
    elif isinstance(event, RunFinished):
        print(f"run {event.run_id} {event.status} in {event.duration_ms:.1f} ms", file=out, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    spec = _load(args.path)
    inputs = parse_inputs(spec, args.input)
    progress = None if args.quiet else sys.stderr
    try:
        result = uvloop.run(_run(args, spec, inputs, progress))
    except (RunInputError, LaunchError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(result.to_dict(), default=_printable))
    else:
        for name, value in result.outputs.items():
            print(f"{name}: {value if isinstance(value, str) else json.dumps(value, default=_printable)}")
        if result.error:
            print(f"error: {result.error}", file=sys.stderr)
    return 0 if result.status == "done" else 1


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    module = importlib.import_module(f"engine.bench.{args.name}")
    parser = argparse.ArgumentParser(prog=f"omniflow bench {args.name}", description=module.__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    bench_args = parser.parse_args(extra)
    result = module.run(bench_args)
    for key, value in result.items():
        print(f"{key:>28}: {value:.4g}" if isinstance(value, float) else f"{key:>28}: {value}")
    if bench_args.json:
        print(json.dumps(result))
    return 0


COMMAND_MODULES: tuple[str, ...] = ("engine.commands.keys", "engine.commands.llm", "engine.commands.worker")
"""Modules that add subcommands: each defines `register(subparsers)` and sets a
`handler(args) -> int` default on the parsers it adds."""


def _register_command_modules(sub: argparse._SubParsersAction) -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniflow", description="Omni-Flow: multimodal workflow orchestration")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a workflow and print every problem")
    p.add_argument("path", help="a DSL module (.py) or a GraphSpec (.json)")

    p = sub.add_parser("export", help="write a workflow as GraphSpec JSON or Python DSL source")
    p.add_argument("path")
    p.add_argument("--format", choices=("json", "python"), default="json")
    p.add_argument("-o", "--output", help="write to this file instead of standard output")

    p = sub.add_parser("run", help="run a workflow with its default inputs or the given ones")
    p.add_argument("path")
    p.add_argument("--input", action="append", default=[], metavar="NAME=VALUE",
                   help="a workflow input (text as is, other types as JSON); repeatable")
    p.add_argument("--json", action="store_true", help="print one JSON object: outputs, node states, timings")
    p.add_argument("--timeout", type=float, default=None, help="fail the run after this many seconds")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on standard error")
    p.add_argument("--workers", choices=("local", "inproc"), default="local",
                   help="local: each role in worker subprocesses (default); inproc: everything in this process")
    p.add_argument("--registry", default=None,
                   help="with --workers local: a registry URL (redis://...) the workers register in")

    p = sub.add_parser("bench", help="run a benchmark against its anchor", add_help=False)
    p.add_argument("name", choices=available_benchmarks())
    _register_command_modules(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        wait_passively()  # a role worker shares its host's cores; before the parser loads torch (`engine.compute.threads`)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command != "bench" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "validate":
            return cmd_validate(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "bench":
            return cmd_bench(args, extra)
        return args.handler(args)
    except GraphValidationError as exc:
        _print_issues(exc, sys.stderr)
        return 1
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
