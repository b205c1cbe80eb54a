"""The engine's client: the one door through which an application (the studio) uses the engine.

An application imports `engine.client.*` and `engine.spec` and nothing else of the engine
(`pyproject.toml` holds the import-linter contract). Each module is one thing an application
does; import from the module that names it, so that loading one concept does not load the
others (the settings of the studio need `keys`, not torch):

* `graphs` -- build a workflow (the DSL), load, validate, export and plan a `GraphSpec`;
* `runs` -- submit a run to an `Executor` and follow it as typed events; the in-process executor;
* `keys` -- the CURVE keys of a deployment's worker plane;
* `cluster` -- the live view: the worker registry (workers, their load and metrics), the node
  directory, and placement of replicas over nodes;
* `workers` -- deploy, scale and stop role workers: the local launcher, supervision, worker ids
  and what a node agent needs to start a worker process;
* `plane` -- reach a deployment's workers: a `WorkerPlane` (registry, transfer seat, executor)
  and the pulling of a run's outputs;
* `models` -- the model catalogue, tokenizers and chat templates' inputs, and the llm roles'
  tokenizers for KV-aware routing.

This package holds no state of its own: every object it hands out is owned by the caller.
"""
