"""Run execution for the studio.

* `execution.execute_run` — the seam: execute one stored run by id on an `Executor`,
  storing every event as it happens (`store`) and publishing it (`bus`). The embedded
  mode calls it from `RunService`; the distributed mode calls it from the Celery task.
* `service.RunService` — the engine loop of a process (one `Executor` with an
  in-process dispatcher), owned by the workflows AppConfig.
* `store` — the database side (runs, node runs, events, files).
* `bus` — how stored events reach live followers (in-process, or the channel layer).
* `lease` — whoever executes a run holds its lease and renews it (`LeaseKeeper`).
* `recovery` — a run whose lease lapsed is executed again or failed; cancelling a run
  another process executes.
* `metrics` — Prometheus metrics of the runs this process executes.
"""
