"""Deployments: a workflow version running on role workers.

* `service` — create, scale, stop (the API's operations) and the hand-off to whatever
  hosts workers in this configuration;
* `embedded` — the studio process hosts them (`LocalCluster`s on the engine loop);
* `node` — a node's Celery worker hosts them (the distributed mode's node agent);
* `announce`, `placing`, `failover` — the distributed mode's nodes: announced in the node
  directory, deployments placed over them, a lost node's replicas placed again;
* `liveness` — which nodes are lost, and which a Redis flush merely took from the directory;
* `reach` — executors over a deployment's registry namespace (Redis), from any process;
* `records` — the database side (status, worker rows);
* `workers` — live workers as the API and `/ws/metrics/` show them.
"""
