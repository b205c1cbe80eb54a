/**
 * One deployment as its view shows it: `GET /api/deployments/<id>/` (the studio's
 * `DeploymentDetailSerializer`), with its worker rows as they come up.
 */
import { request } from "./client";
import type { Deployment, WorkerSnapshot } from "./cluster";

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
  status: string;
  started_at: string | null;
  last_seen_at: string | null;
  /** Its latest registry snapshot (load, metrics); null when it is not registered (yet, or any more). */
  live: WorkerSnapshot | null;
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
  updated_at: string;
}

export const ACTIVE_STATUSES = ["pending", "starting", "running", "stopping"];

export const deployments = {
  get: (id: string) => request<DeploymentDetail>("GET", `/api/deployments/${id}/`),
};

/** What a worker is doing, in a word: its recorded state, or busy/ready from its heartbeat. */
export function workerState(worker: DeploymentWorker): string {
  if (["stopped", "lost", "draining", "starting"].includes(worker.status) || worker.rank > 0) return worker.status;
  if (!worker.live) return worker.status === "ready" || worker.status === "busy" ? "starting" : worker.status;
  return worker.live.load.busy ? "busy" : "ready";
}
