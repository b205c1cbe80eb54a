/**
 * One deployment as its view shows it: `GET /api/deployments/<id>/` (the studio's
 * `DeploymentDetailSerializer`), with its worker rows as they come up.
 */
import { request } from "./client";
import type { Deployment, WorkerSnapshot } from "./cluster";
import type { PlacementSlot, Refusal } from "./nodes";

/** A worker the deployment started (or one that joined it by hand: status "joined"). */
export interface DeploymentWorker {
  worker_id: string;
  role: string;
  /** Its number among its role's live replicas (oldest first); null once it ended. */
  replica: number | null;
  /** Its tensor-parallel rank (0: the replica's endpoint). */
  rank: number;
  /** The machine (a node's name in the distributed mode). */
  host: string;
  address: string;
  device: string;
  /** The host's GPU indices it holds (its own, for a tensor-parallel rank); empty: none. */
  gpus: number[];
  pid: number | null;
  /** starting, ready, busy, draining, stopped, lost, failed (or joined). */
  status: string;
  /** failed: why it did not come up (empty otherwise). */
  error: string;
  started_at: string | null;
  last_seen_at: string | null;
  /** Its latest registry snapshot (load, metrics); null when it is not registered (yet, or any more). */
  live: WorkerSnapshot | null;
}

/** A replica placed again: `from` null when it had no node (it waited for room). */
export interface ReplicaMove {
  role: string;
  replica: number;
  from: string | null;
  to: string;
  at: string;
  reason: string;
}

export interface DeploymentPlacement {
  slots: PlacementSlot[];
  /** The latest moves, oldest first. */
  moved: ReplicaMove[];
  /** Refusals of the replicas that wait for a node. */
  unplaced: Refusal[];
}

export interface DeploymentDetail extends Deployment {
  workflow: string;
  workflow_name: string;
  /** Whether `/v1/chat/completions` serves it (its spec is a chat workflow). */
  chat: boolean;
  node: string;
  roles: { name: string; kind: string; model: string | null; device: string }[];
  /** The workflow's inputs: what a run of it names (`default`: used when a run gives none). */
  inputs: { name: string; type: string; default?: unknown }[];
  workers: DeploymentWorker[];
  /** Which node runs each replica, what moved and what waits for a node; `{}` when the studio hosts it. */
  placement: Partial<DeploymentPlacement>;
  updated_at: string;
}

export const ACTIVE_STATUSES = ["pending", "starting", "running", "stopping"];

export const deployments = {
  get: (id: string) => request<DeploymentDetail>("GET", `/api/deployments/${id}/`),
};

/** What a worker is doing, in a word: its recorded state, or busy/ready from its heartbeat. */
export function workerState(worker: DeploymentWorker): string {
  if (["stopped", "lost", "failed", "draining", "starting"].includes(worker.status) || worker.rank > 0) return worker.status;
  if (!worker.live) return worker.status === "ready" || worker.status === "busy" ? "starting" : worker.status;
  return worker.live.load.busy ? "busy" : "ready";
}

/** Why a failed worker did not come up, its first line (the whole text is `worker.error`); null otherwise. */
export function failureReason(worker: DeploymentWorker): string | null {
  if (worker.status !== "failed") return null;
  return worker.error.split("\n").find((line) => line.trim())?.trim() ?? "it did not come up (no reason recorded)";
}

/** A row of the workers table: a worker's, or a placeholder for a replica with no worker row yet. */
export interface WorkerRow extends DeploymentWorker {
  placeholder?: boolean;
}

/**
 * The workers table's rows, by role, replica and rank. `expected` (a live deployment's replica
 * counts): each replica with no live worker row yet gets a `starting` placeholder, until its
 * worker's own row (written as soon as its process is spawned) takes its place.
 */
export function workerRows(workers: DeploymentWorker[], expected?: Record<string, number>): WorkerRow[] {
  const rows: WorkerRow[] = [...workers];
  for (const [role, count] of Object.entries(expected ?? {})) {
    const taken = new Set(workers.filter((w) => w.role === role && w.rank === 0 && w.replica !== null).map((w) => w.replica));
    for (let replica = 0; replica < count; replica++) {
      if (taken.has(replica)) continue;
      rows.push({
        worker_id: `${role}#${replica}`, role, replica, rank: 0, host: "", address: "", device: "", gpus: [], pid: null,
        status: "starting", error: "", started_at: null, last_seen_at: null, live: null, placeholder: true,
      });
    }
  }
  return rows.sort(
    (a, b) =>
      a.role.localeCompare(b.role) ||
      (a.replica ?? Number.MAX_SAFE_INTEGER) - (b.replica ?? Number.MAX_SAFE_INTEGER) ||
      a.rank - b.rank ||
      a.worker_id.localeCompare(b.worker_id),
  );
}
