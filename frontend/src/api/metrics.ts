/**
 * The workers' metrics over time, as the Cluster page charts them.
 *
 *   GET /api/metrics/history/?range=5m|1h&deployment=<uuid>&worker=<id>  -> HistoryBody
 *   WS  /ws/metrics/?range=5m|1h  -> first {"type": "history", ...HistoryBody},
 *                                    then {"type": "workers", "time", "workers"} every interval
 *
 * (`studio/workflows/history/query.py`). A `Timeline` is what the charts draw: one row per time,
 * and per worker its sample at that time (null where the worker had none). The history fills it
 * when the page opens (so a reload keeps the charts), live messages append to it, and rows older
 * than the range fall off.
 */
import { request } from "./client";
import { type Tier, TIERS, type WorkerSample, type WorkerSnapshot, sampleOf, tokenRate } from "./cluster";

export interface TierPoint {
  lookups?: number;
  hits?: number;
  pages_used?: number;
  capacity_pages?: number;
  bytes_used?: number;
  capacity_bytes?: number;
}

/** A worker's metrics at `t` (a key left out is a value the worker does not have). */
export interface MetricPoint {
  t: number;
  outstanding?: number;
  queue_depth?: number;
  rss_bytes?: number;
  gpu?: { device: string; allocated_bytes?: number; reserved_bytes?: number; total_bytes?: number };
  tiers?: Partial<Record<Tier, TierPoint>>;
  generated_tokens?: number;
  prompt_tokens?: number;
}

export interface WorkerSeries {
  worker_id: string;
  deployment: string;
  role: string;
  device: string;
  host: string;
  model: string | null;
  points: MetricPoint[];
}

export interface HistoryBody {
  range: string;
  range_s: number;
  since?: number;
  now?: number;
  interval_s?: number;
  step_s?: number;
  history_s?: number;
  workers: WorkerSeries[];
  /** Set when the studio could not read its history (the live stream still comes). */
  error?: string;
}

export type HistoryMessage = { type: "history" } & HistoryBody;

export const RANGES = [
  { id: "5m", label: "5 min", seconds: 300 },
  { id: "1h", label: "1 h", seconds: 3600 },
] as const;
export type RangeId = (typeof RANGES)[number]["id"];

export function rangeOf(raw: string | null): (typeof RANGES)[number] {
  return RANGES.find((r) => r.id === raw) ?? RANGES[0];
}

export const metrics = {
  history: (range: RangeId) => request<HistoryBody>("GET", `/api/metrics/history/?range=${range}`),
};

/** The chart sample of a history point (and the worker's previous one, for tokens/s). */
export function sampleOfPoint(point: MetricPoint, device: string, previous?: WorkerSample): WorkerSample {
  const hitRate: WorkerSample["hitRate"] = {};
  const occupancy: WorkerSample["occupancy"] = {};
  const tiers: Tier[] = [];
  for (const tier of TIERS) {
    const p = point.tiers?.[tier];
    if (!p) continue;
    tiers.push(tier);
    if (p.lookups) hitRate[tier] = (p.hits ?? 0) / p.lookups;
    if (p.capacity_pages) occupancy[tier] = (p.pages_used ?? 0) / p.capacity_pages;
  }
  const generated = point.generated_tokens ?? null;
  return {
    time: point.t,
    hitRate,
    occupancy,
    tiers,
    gpuMemoryBytes: point.gpu && device.startsWith("cuda") ? (point.gpu.allocated_bytes ?? 0) : null,
    gpuTotalBytes: point.gpu?.total_bytes ?? null,
    rssBytes: point.rss_bytes ?? null,
    tokensPerS: tokenRate(generated, point.t, previous),
    generatedTokens: generated,
    promptTokens: point.prompt_tokens ?? null,
  };
}

export interface WorkerTrack {
  key: string;
  workerId: string;
  deployment: string;
  role: string;
  device: string;
  host: string;
  /** Aligned with `Timeline.times`. */
  samples: (WorkerSample | null)[];
}

export interface Timeline {
  times: number[];
  tracks: Map<string, WorkerTrack>;
}

export const EMPTY_TIMELINE: Timeline = { times: [], tracks: new Map() };

export function trackKey(deployment: string | null | undefined, workerId: string): string {
  return `${deployment ?? ""}/${workerId}`;
}

function lastSample(samples: (WorkerSample | null)[]): WorkerSample | undefined {
  for (let i = samples.length - 1; i >= 0; i--) if (samples[i]) return samples[i]!;
  return undefined;
}

/** How far apart two rows may be before the charts show a gap between them (no worker sampled). */
const GAP_STEPS = 3;

/** `times` with a row inserted one step after each stretch longer than `GAP_STEPS` steps without one. */
function withGaps(times: number[], step: number): number[] {
  const out: number[] = [];
  for (const t of times) {
    const last = out[out.length - 1];
    if (last !== undefined && t - last > GAP_STEPS * step) out.push(last + step);
    out.push(t);
  }
  return out;
}

/** The timeline of a history answer: every point time, each worker's sample there (a row of
 * nulls where no worker was sampled for a while, so the charts draw a gap, not a line across it). */
export function fromHistory(body: HistoryBody): Timeline {
  const points = [...new Set(body.workers.flatMap((w) => w.points.map((p) => p.t)))].sort((a, b) => a - b);
  const times = withGaps(points, body.step_s ?? body.interval_s ?? 1);
  const index = new Map(times.map((t, i) => [t, i]));
  const tracks = new Map<string, WorkerTrack>();
  for (const w of body.workers) {
    const samples: (WorkerSample | null)[] = new Array(times.length).fill(null);
    let previous: WorkerSample | undefined;
    for (const point of w.points) {
      previous = sampleOfPoint(point, w.device, previous);
      samples[index.get(point.t)!] = previous;
    }
    const key = trackKey(w.deployment, w.worker_id);
    const { worker_id: workerId, deployment, role, device, host } = w;
    tracks.set(key, { key, workerId, deployment, role, device, host, samples });
  }
  return { times, tracks };
}

/** `timeline` with one more row at `time` (the live workers' samples), less rows older than `spanS`. */
export function appendLive(timeline: Timeline, time: number, workers: WorkerSnapshot[], spanS: number): Timeline {
  if (timeline.times.length && time <= timeline.times[timeline.times.length - 1]) return timeline; // not newer
  const drop = timeline.times.findIndex((t) => t >= time - spanS);
  const from = drop === -1 ? timeline.times.length : drop;
  const times = [...timeline.times.slice(from), time];
  const tracks = new Map<string, WorkerTrack>();
  const seen = new Set<string>();
  for (const w of workers) {
    const key = trackKey(w.deployment, w.info.worker_id);
    seen.add(key);
    const old = timeline.tracks.get(key);
    const kept = old ? old.samples.slice(from) : new Array(times.length - 1).fill(null);
    const sample = sampleOf(w, time, old ? lastSample(old.samples) : undefined);
    tracks.set(key, {
      key,
      workerId: w.info.worker_id,
      deployment: w.deployment ?? "",
      role: w.info.role,
      device: w.info.device,
      host: w.info.host,
      samples: [...kept, sample],
    });
  }
  for (const [key, old] of timeline.tracks) {
    if (seen.has(key)) continue;
    const samples = [...old.samples.slice(from), null];
    if (samples.some((s) => s !== null)) tracks.set(key, { ...old, samples }); // a worker gone, still in range
  }
  return { times, tracks };
}

/**
 * The prompt tokens the timeline's workers (or `only` those) took in, by each one's latest sample:
 * their sum, or null when none of them runs an LLM.
 */
export function promptTokensOf(timeline: Timeline, only?: (track: WorkerTrack) => boolean): number | null {
  const counts = [...timeline.tracks.values()]
    .filter((t) => !only || only(t))
    .map((t) => lastSample(t.samples)?.promptTokens)
    .filter((n): n is number => typeof n === "number");
  return sum(counts);
}

/** The tiers any worker of the timeline has, in tier order. */
export function tiersOf(timeline: Timeline): Tier[] {
  const found = new Set<Tier>();
  for (const track of timeline.tracks.values()) for (const s of track.samples) s?.tiers.forEach((t) => found.add(t));
  return TIERS.filter((t) => found.has(t));
}

/** Whether any worker reported GPU memory (else the cluster is CPU-only, as far as its workers go). */
export function hasGpu(timeline: Timeline): boolean {
  for (const track of timeline.tracks.values()) if (track.samples.some((s) => s?.gpuMemoryBytes != null)) return true;
  return false;
}

/** One value per row, combining the picked value of every worker (or of `only`) present at that row. */
export function column(
  timeline: Timeline,
  pick: (s: WorkerSample) => number | null | undefined,
  combine: (values: number[]) => number | null,
  only?: (track: WorkerTrack) => boolean,
): (number | null)[] {
  const tracks = [...timeline.tracks.values()].filter((t) => !only || only(t));
  return timeline.times.map((_, i) => {
    const values: number[] = [];
    for (const track of tracks) {
      const s = track.samples[i];
      const v = s ? pick(s) : null;
      if (typeof v === "number") values.push(v);
    }
    return combine(values);
  });
}

export const mean = (values: number[]): number | null =>
  values.length ? values.reduce((a, b) => a + b, 0) / values.length : null;
export const sum = (values: number[]): number | null => (values.length ? values.reduce((a, b) => a + b, 0) : null);
