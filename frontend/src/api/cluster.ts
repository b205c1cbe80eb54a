/**
 * Deployments and workers: the interface the Cluster page and the editor's Deploy
 * button are built against. The studio does not serve these endpoints yet; the UI asks,
 * and on 404 (or 405) shows that they are not available rather than inventing data.
 *
 *   GET  /api/deployments/?workflow=<uuid>   -> Page<Deployment> (or a bare list)
 *   POST /api/deployments/  {workflow, version, replicas?: {role: n}, name?}
 *                                              -> 201 Deployment
 *   POST /api/deployments/<uuid>/stop/         -> Deployment
 *   POST /api/deployments/<uuid>/cache-scope/  {cache_scope: "user" | "shared"} -> Deployment (shared: staff only)
 *   GET  /api/workers/                         -> Page<WorkerSnapshot> (or a bare list)
 *   WS   /ws/metrics/                          -> one JSON message per refresh:
 *        {"type": "workers", "time": <epoch s>, "workers": [WorkerSnapshot, ...]}
 *
 * A WorkerSnapshot is `engine.flow.discovery.records.WorkerSnapshot.to_dict()`
 * (`info`, `load`, `last_heartbeat`) plus the studio's `status` and `deployment`. The
 * charts read these gauges of `load.metrics` (the names `KVStore.metrics()` and the
 * LLM engine report): `<tier>.hit_rate`, `<tier>.pages_used`, `<tier>.capacity_pages`
 * for tier in device/host/disk (a tier whose `<tier>.lookups` is 0 has no hit rate yet: its
 * 0 is left out of the averages); `gpu.memory_used_bytes`, `gpu.memory_total_bytes` (shown
 * for a worker on a CUDA device only); `rss_bytes` (the process's memory);
 * `llm.tokens_per_s`, or else `llm.generated_tokens` (a counter, differentiated here).
 * The same sample is made from the studio's history points (`api/metrics.ts`).
 */
import { request } from "./client";
import type { Page } from "./types";

export interface Deployment {
  id: string;
  workflow?: string;
  version: number;
  name: string;
  status: "pending" | "starting" | "running" | "stopping" | "stopped" | "failed";
  replicas: Record<string, number>;
  /** Whose runs share its caches: "user" (each user's own; the default) or "shared" (set by staff). */
  cache_scope?: "user" | "shared";
  error: string;
  created_at: string;
}

/** What a deployment's row says about its cache: a note when its users share one, else nothing. */
export function cacheScopeLabel(deployment: Pick<Deployment, "cache_scope">): string | null {
  return deployment.cache_scope === "shared" ? "cache: shared across users" : null;
}

export interface WorkerSnapshot {
  info: {
    worker_id: string;
    role: string;
    address: string;
    capacity: number;
    model: string | null;
    device: string;
    host: string;
    pid: number;
    meta: Record<string, unknown>;
  };
  load: { outstanding: number; queue_depth: number; busy: boolean; metrics: Record<string, number> };
  last_heartbeat: number;
  status?: string;
  deployment?: string | null;
  /** The deployment's name (what the cluster page names it by). */
  deployment_name?: string;
}

export interface MetricsMessage {
  type: "workers";
  time: number;
  workers: WorkerSnapshot[];
}

/** `null`: the endpoint is not there (the feature is not available on this studio). */
export type Maybe<T> = T | null;

const MISSING = [404, 405, 501];

function items<T>(body: Page<T> | T[] | null): T[] | null {
  if (body === null) return null;
  return Array.isArray(body) ? body : body.results;
}

export const cluster = {
  deployments: async (workflow?: string): Promise<Maybe<Deployment[]>> =>
    items(
      await request<Page<Deployment> | Deployment[] | null>(
        "GET",
        `/api/deployments/${workflow ? `?workflow=${workflow}` : ""}`,
        { allow: MISSING },
      ),
    ),
  /** The name a deployment of `workflow` left unnamed would take now (null: no deployment API). */
  proposedName: (workflow: string) =>
    request<{ name: string } | null>("GET", `/api/deployments/proposed-name/?workflow=${workflow}`, { allow: MISSING }),
  deploy: (body: { workflow: string; version: number; replicas?: Record<string, number>; name?: string }) =>
    request<Deployment>("POST", "/api/deployments/", { json: body }),
  stop: (id: string) => request<Deployment>("POST", `/api/deployments/${id}/stop/`),
  workers: async (): Promise<Maybe<WorkerSnapshot[]>> =>
    items(await request<Page<WorkerSnapshot> | WorkerSnapshot[] | null>("GET", "/api/workers/", { allow: MISSING })),
};

/** The fewest decimals (at most 3) that write multiples of `step` exactly: an axis's ticks stay distinct. */
export function stepDecimals(step: number): number {
  if (!(step > 0)) return 0;
  for (let d = 0; d < 3; d++) {
    const scaled = step * 10 ** d;
    if (Math.abs(scaled - Math.round(scaled)) < 1e-6 * Math.max(1, scaled)) return d;
  }
  return 3;
}

/** A fraction as a percentage: whole percents, or one decimal under 10% (0.4%, not 0%). */
export function percent(v: number): string {
  const p = v * 100;
  return p !== 0 && Math.abs(p) < 10 ? `${p.toFixed(1)}%` : `${Math.round(p)}%`;
}

/** A fraction's axis tick as a percentage, with the decimals the ticks' `step` needs. */
export function percentTick(v: number, step: number): string {
  return `${(v * 100).toFixed(stepDecimals(step * 100))}%`;
}

/** A number's axis tick, with the decimals the ticks' `step` needs. */
export function numberTick(v: number, step: number): string {
  return v.toFixed(stepDecimals(step));
}

export const TIERS = ["device", "host", "disk"] as const;

/** One chart sample of a worker, from its gauges (and its previous sample, for rates). */
export type Tier = (typeof TIERS)[number];

export interface WorkerSample {
  time: number;
  hitRate: Partial<Record<Tier, number>>;
  occupancy: Partial<Record<Tier, number>>;
  /** The tiers the worker has (a tier appears wherever it is configured, used or not). */
  tiers: Tier[];
  gpuMemoryBytes: number | null;
  gpuTotalBytes: number | null;
  rssBytes: number | null;
  tokensPerS: number | null;
  generatedTokens: number | null;
  /** Prompt tokens the worker's LLM took in since it started (a counter); null without an LLM. */
  promptTokens: number | null;
}

/** Tokens/s between two samples of a counter (a restarted worker's counter going down reads 0). */
export function tokenRate(generated: number | null, time: number, previous?: WorkerSample): number | null {
  if (generated === null || previous?.generatedTokens == null || time <= previous.time) return null;
  return Math.max(0, (generated - previous.generatedTokens) / (time - previous.time));
}

export function sampleOf(worker: WorkerSnapshot, time: number, previous?: WorkerSample): WorkerSample {
  const m = worker.load.metrics ?? {};
  const hitRate: WorkerSample["hitRate"] = {};
  const occupancy: WorkerSample["occupancy"] = {};
  const tiers: Tier[] = [];
  for (const tier of TIERS) {
    const lookedUp = m[`${tier}.lookups`] !== 0; // absent (an older worker) counts as looked up
    if (typeof m[`${tier}.hit_rate`] === "number" && lookedUp) hitRate[tier] = m[`${tier}.hit_rate`];
    const used = m[`${tier}.pages_used`];
    const cap = m[`${tier}.capacity_pages`];
    if (typeof cap === "number") tiers.push(tier);
    if (typeof used === "number" && typeof cap === "number" && cap > 0) occupancy[tier] = used / cap;
  }
  const num = (key: string) => (typeof m[key] === "number" ? m[key] : null);
  const generated = num("llm.generated_tokens");
  const onGpu = worker.info.device.startsWith("cuda");
  return {
    time,
    hitRate,
    occupancy,
    tiers,
    gpuMemoryBytes: onGpu ? num("gpu.memory_used_bytes") : null,
    gpuTotalBytes: onGpu ? num("gpu.memory_total_bytes") : null,
    rssBytes: num("rss_bytes"),
    tokensPerS: num("llm.tokens_per_s") ?? tokenRate(generated, time, previous),
    generatedTokens: generated,
    promptTokens: num("llm.prompt_tokens"),
  };
}

/**
 * What a KV hit-rate chart says while nothing was looked up, given the prompt tokens its workers
 * took in (null: unknown, or no LLM). Only a prompt's full pages are looked up, and at least its
 * last token is always computed: a prompt of at most one page (16 tokens by default) looks nothing
 * up, so a worker that served only short prompts has no hit rate yet, though it did serve them.
 */
export function noLookupsNote(promptTokens: number | null): string {
  if (!promptTokens) return "No KV lookups yet: the hit rate starts with the first prompt.";
  return (
    `No KV page looked up yet, though prompts came in (${promptTokens} tokens in all): each was too short to` +
    " fill a KV page, and only a prompt's full pages are looked up."
  );
}
