"""Role workers: processes that host one role's compute unit and serve node executions.

`core.RoleWorkerCore` is the pure execution loop, `process` wraps it with sockets, the
registry and signals (as its `config.WorkerConfig` says, with the `liveness` thread beside its
loop), and `launcher.LocalCluster` spawns the workers a GraphSpec asks for.
"""
