/**
 * Nodes of a distributed studio and where a deployment would go on them.
 *
 *   GET  /api/nodes/            -> Node[] (live and lost, and those Redis forgot whose kept lease runs;
 *                                  [] when the studio hosts workers itself)
 *   POST /api/nodes/placement/  {workflow, version?, replicas?, node?} -> PlacementPreview
 *
 * A node's `workers` are the live workers of your deployments on it (worker ids, as
 * `/api/workers/` lists them, with the node's GPUs each holds); `hosting` the deployments with
 * replicas there. A placement slot names the node's GPUs its replica would get (none: it asks
 * for none).
 */
import { request } from "./client";

export interface Amounts {
  gpus: number;
  cpus: number;
  memory_gb: number;
}

export interface NodeWorker {
  worker_id: string;
  role: string;
  deployment: string;
  status: string;
  address: string;
  pid: number | null;
  device: string;
  /** The node's GPU indices it holds (nvidia-smi's numbering); empty: none. */
  gpus: number[];
}

export interface ClusterNode {
  name: string;
  status: "live" | "lost";
  address: string;
  labels: Record<string, string>;
  total: Amounts;
  free: Amounts;
  gpus: { index: number; model: string; memory_gb: number }[];
  hosting: { deployment: string; name: string; replicas: Record<string, number> }[];
  seen_at: number;
  started_at: number;
  ttl_s: number;
  workers: NodeWorker[];
  /**
   * "kept-lease": Redis (a flush or restart) has forgotten the node, but its last heartbeat, kept in
   * the database, has not lapsed; this is that heartbeat's record until its agent announces it again.
   */
  source: "announced" | "kept-lease";
}

export interface PlacementSlot {
  role: string;
  replica: number;
  node: string;
  /** The node's GPU indices the replica gets (all its tensor-parallel ranks'); empty: none. */
  gpus: number[];
}

export interface Refusal {
  role: string | string[];
  roles: string[];
  replicas: number[];
  need: Amounts;
  labels: Record<string, string>;
  best_node: string | null;
  best_free: Amounts | null;
  nodes: { node: string; problems: string[] }[];
  message: string;
}

export interface PlacementPreview {
  /** false: the studio runs the workers itself (no nodes to place on). */
  distributed: boolean;
  placement: PlacementSlot[];
  refusals: Refusal[];
  error: string;
  nodes: string[];
}

const MISSING = [404, 405, 501];

export const nodes = {
  /** `null`: this studio does not serve the nodes API. */
  list: () => request<ClusterNode[] | null>("GET", "/api/nodes/", { allow: MISSING }),
  placement: (body: { workflow: string; version: number; replicas?: Record<string, number> }, signal?: AbortSignal) =>
    request<PlacementPreview | null>("POST", "/api/nodes/placement/", { json: body, allow: MISSING, signal }),
};

/** "2 GPUs, 4 CPUs, 16 GB" */
export function describeAmounts(a: Amounts): string {
  const plural = (n: number, one: string) => `${n} ${one}${n === 1 ? "" : "s"}`;
  return `${plural(a.gpus, "GPU")}, ${plural(Number(a.cpus.toFixed(2)), "CPU")}, ${Number(a.memory_gb.toFixed(1))} GB`;
}

export interface PlacedReplica {
  replica: number;
  gpus: number[];
}

/** Placement rows grouped by node, nodes in name order, each node's roles with their replicas and GPUs. */
export function byNode(slots: PlacementSlot[]): { node: string; roles: { role: string; replicas: PlacedReplica[] }[] }[] {
  const grouped = new Map<string, Map<string, PlacedReplica[]>>();
  for (const s of slots) {
    const roles = grouped.get(s.node) ?? new Map<string, PlacedReplica[]>();
    roles.set(s.role, [...(roles.get(s.role) ?? []), { replica: s.replica, gpus: s.gpus ?? [] }]);
    grouped.set(s.node, roles);
  }
  return [...grouped.entries()]
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([node, roles]) => ({
      node,
      roles: [...roles.entries()].sort(([a], [b]) => a.localeCompare(b)).map(([role, replicas]) => ({ role, replicas })),
    }));
}

/** "GPU 2", "GPUs 0, 1"; "" for none. */
export function describeGpus(gpus: number[]): string {
  if (gpus.length === 0) return "";
  return `${gpus.length === 1 ? "GPU" : "GPUs"} ${gpus.join(", ")}`;
}

/** "#1 GPU 0 · #2 GPUs 2, 3" (replica numbers counted from 1, as the workers table does); "" when none holds a GPU. */
export function describeReplicaGpus(replicas: PlacedReplica[]): string {
  return replicas
    .filter((r) => r.gpus.length > 0)
    .map((r) => `#${r.replica + 1} ${describeGpus(r.gpus)}`)
    .join(" · ");
}

/** Worker ids -> the node whose agent runs them. */
export function nodeOfWorker(list: ClusterNode[]): Map<string, string> {
  const out = new Map<string, string>();
  for (const n of list) for (const w of n.workers) out.set(w.worker_id, n.name);
  return out;
}

/** Worker ids -> the GPUs of its node it holds (only workers holding some). */
export function gpusOfWorker(list: ClusterNode[]): Map<string, number[]> {
  const out = new Map<string, number[]>();
  for (const n of list) for (const w of n.workers) if (w.gpus?.length) out.set(w.worker_id, w.gpus);
  return out;
}
