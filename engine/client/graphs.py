"""Workflow graphs: build one in Python, load it from a file, validate, export, plan.

* `Workflow`, `RoleRef`, `NodeRef`, `PortRef` -- the DSL that compiles to a `GraphSpec`;
* `load_workflow`, `WorkflowLoadError` -- a workflow from a `.py` or JSON file;
* `parse_spec` -- a `GraphSpec` from its JSON document, validated (`GraphValidationError`);
* `check_spec`, `CheckpointLookup` -- the checks that need the caller's kinds, ops and checkpoints;
* `GraphValidationError`, `Issue` -- every problem found, each at its node, port or field;
* `to_python` -- a `GraphSpec` written back as DSL source;
* `build_plan` -- a validated spec indexed for execution (what a run's inputs resolve against).

The document types themselves (`GraphSpec`, kinds, ops) are in `engine.spec`.
"""

from __future__ import annotations

from engine.flow.dsl import NodeRef, PortRef, RoleRef, Workflow
from engine.flow.loader import WorkflowLoadError, load_workflow
from engine.flow.plan import build_plan
from engine.flow.pysrc import to_python
from engine.flow.validate import CheckpointLookup, GraphValidationError, Issue, check_spec, parse_spec

__all__ = [
    "CheckpointLookup",
    "GraphValidationError",
    "Issue",
    "NodeRef",
    "PortRef",
    "RoleRef",
    "Workflow",
    "WorkflowLoadError",
    "build_plan",
    "check_spec",
    "load_workflow",
    "parse_spec",
    "to_python",
]
