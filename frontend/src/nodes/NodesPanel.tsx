/**
 * The cluster's workers grouped by node (distributed studio): each node with its state (live or
 * lost), labels, resources and what is free, then the live workers it runs (with the node's GPUs
 * each holds). Workers on no node
 * (the studio's own, or joined by hand) come last. Renders nothing when the studio has no nodes.
 */
import { useEffect, useState } from "react";
import type { WorkerSnapshot } from "../api/cluster";
import { describeError } from "../api/client";
import { type ClusterNode, describeAmounts, describeGpus, gpusOfWorker, nodeOfWorker, nodes } from "../api/nodes";
import { ErrorBox, StatusBadge } from "../components/ui";
import { WorkerId } from "../components/WorkerId";

const REFRESH_MS = 3000;

export function NodesPanel({ workers }: { workers: WorkerSnapshot[] }) {
  const [list, setList] = useState<ClusterNode[] | null>(null);
  const [error, setError] = useState<string | null>(null);

  useEffect(() => {
    let stopped = false;
    let timer: number | undefined;
    const load = async () => {
      try {
        const found = await nodes.list();
        if (stopped) return;
        setList(found);
        setError(null);
        if (found === null) return; // no nodes API here: nothing to follow
      } catch (err) {
        if (!stopped) setError(describeError(err));
      }
      if (!stopped) timer = window.setTimeout(load, REFRESH_MS);
    };
    load();
    return () => {
      stopped = true;
      window.clearTimeout(timer);
    };
  }, []);

  if (error) return <ErrorBox>Nodes: {error}</ErrorBox>;
  if (!list || list.length === 0) return null;
  const where = nodeOfWorker(list);
  const gpus = gpusOfWorker(list);
  const elsewhere = workers.filter((w) => !where.has(w.info.worker_id));
  return (
    <div className="nodes-panel" data-testid="nodes-panel">
      {list.map((node) => (
        <NodeCard
          key={node.name}
          node={node}
          gpus={gpus}
          workers={workers.filter((w) => where.get(w.info.worker_id) === node.name)}
        />
      ))}
      {elsewhere.length > 0 && (
        <div className="card node-card" data-testid="node-card" data-node="">
          <div className="node-head">
            <strong>Not on a node</strong>
            <span className="muted small">the studio's own workers, or workers joined by hand</span>
          </div>
          <WorkerList workers={elsewhere} gpus={gpus} />
        </div>
      )}
    </div>
  );
}

function NodeCard({ node, workers, gpus }: { node: ClusterNode; workers: WorkerSnapshot[]; gpus: Map<string, number[]> }) {
  const labels = Object.entries(node.labels);
  return (
    <div className="card node-card" data-testid="node-card" data-node={node.name} data-status={node.status}>
      <div className="node-head">
        <strong className="mono">{node.name}</strong>
        <StatusBadge status={node.status} />
        <span className="muted small">{node.address}</span>
        {labels.map(([k, v]) => (
          <span key={k} className="pill" data-testid="node-label">
            {k}={v}
          </span>
        ))}
      </div>
      <div className="small node-resources">
        <span data-testid="node-free">
          free {describeAmounts(node.free)} of {describeAmounts(node.total)}
        </span>
        {node.gpus.length > 0 && (
          <span className="muted">
            {" "}
            · {node.gpus.map((g) => `${g.model} (${g.memory_gb} GB)`).join(", ")}
          </span>
        )}
        {node.source === "kept-lease" && (
          <span className="muted" data-testid="node-kept-lease">
            {" "}
            · Redis forgot it (flushed or restarted): shown from its last heartbeat until its agent announces it again
          </span>
        )}
        {node.status === "lost" && (
          <span className="danger-text"> · no announcement for over {node.ttl_s} s: its replicas are placed elsewhere</span>
        )}
      </div>
      {workers.length > 0 ? (
        <WorkerList workers={workers} gpus={gpus} />
      ) : (
        <div className="muted small">{node.workers.length ? "workers starting" : "no workers of yours"}</div>
      )}
    </div>
  );
}

function WorkerList({ workers, gpus }: { workers: WorkerSnapshot[]; gpus: Map<string, number[]> }) {
  return (
    <ul className="node-workers">
      {workers.map((w) => (
        <li key={w.info.worker_id} data-testid="node-worker" data-role={w.info.role}>
          <span className="pill">{w.info.role}</span>{" "}
          <span className="small">
            <WorkerId id={w.info.worker_id} />
          </span>{" "}
          <StatusBadge status={w.status ?? (w.load.busy ? "busy" : "ready")} />{" "}
          <span className="muted small">
            {w.load.outstanding}/{w.info.capacity} running
          </span>
          {gpus.has(w.info.worker_id) && (
            <span className="small" data-testid="node-worker-gpus">
              {" "}
              · {describeGpus(gpus.get(w.info.worker_id) ?? [])}
            </span>
          )}
        </li>
      ))}
    </ul>
  );
}
