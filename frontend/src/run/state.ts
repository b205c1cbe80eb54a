/**
 * A run as its events describe it: per-node state and timings, streamed frames, output
 * previews and the final result. `reduceRun` applies events in `seq` order (the order
 * the studio guarantees); the view renders whatever the state holds so far.
 */
import type { NodeState, RunEvent, RunFinishedEvent, RunStatus } from "../api/types";
import type { NodeRunView } from "../graph/model";

export interface StreamView {
  node: string;
  port: string;
  frames: unknown[];
}

export interface RunState {
  status: RunStatus;
  lastSeq: number;
  startedAt: number | null;
  nodes: Record<string, LiveNode>;
  /** `node.port` -> frames streamed so far, in frame order. */
  streams: Record<string, StreamView>;
  /** `node.port` -> the latest non-frame value preview (of the latest iteration). */
  values: Record<string, unknown>;
  finished: RunFinishedEvent | null;
  log: RunEvent[];
}

/** A node as the run view tracks it: with `running`, when its attempt started (server seconds) and
 * how long it had run before (earlier iterations and attempts), which `liveDurationMs` counts on from;
 * `waiting`: what it waits for before it runs, as reported while it is queued (its role's unit
 * loading a model: "loading smollm2-135m (role llm)"), until its next state. */
export type LiveNode = NodeRunView & { since?: number; busyMs?: number; waiting?: string };

const LOG_LIMIT = 500;

export function initialRunState(nodes: string[] = []): RunState {
  return {
    status: "pending",
    lastSeq: -1,
    startedAt: null,
    nodes: Object.fromEntries(nodes.map((n) => [n, { state: "pending" as NodeState }])),
    streams: {},
    values: {},
    finished: null,
    log: [],
  };
}

export function reduceRun(state: RunState, event: RunEvent): RunState {
  if (event.seq <= state.lastSeq) return state;
  const log = state.log.length >= LOG_LIMIT ? [...state.log.slice(1), event] : [...state.log, event];
  const next: RunState = { ...state, lastSeq: event.seq, log };
  switch (event.type) {
    case "run_started":
      next.status = "running";
      next.startedAt = event.time;
      next.nodes = { ...Object.fromEntries(event.nodes.map((n) => [n, { state: "pending" as NodeState }])), ...state.nodes };
      break;
    case "node_state": {
      const old = state.nodes[event.node] ?? { state: "pending" };
      const view: LiveNode = { ...old, state: event.state, waiting: undefined };
      if (event.state === "running") {
        view.since = event.time;
        // Events stored before `busy_ms` existed count this attempt alone, as they always did.
        view.busyMs = event.busy_ms ?? 0;
        view.durationMs = null;
        view.error = null;
        view.progress = null;
        view.message = undefined;
        if (event.worker) view.worker = event.worker;
        if (event.host) view.host = event.host;
      }
      if (event.duration_ms !== undefined && event.duration_ms !== null) view.durationMs = event.duration_ms;
      if (event.error) view.error = event.error;
      if (event.iteration) view.iterations = event.iteration;
      next.nodes = { ...state.nodes, [event.node]: view };
      break;
    }
    case "node_progress": {
      const old = state.nodes[event.node] ?? { state: "running" };
      // Before a node runs, a report says what it waits for (the engine's units report once they run).
      const report: LiveNode =
        old.state === "queued" || old.state === "pending"
          ? { ...old, waiting: event.message || old.waiting }
          : { ...old, progress: event.progress ?? old.progress, message: event.message || old.message };
      next.nodes = { ...state.nodes, [event.node]: report };
      break;
    }
    case "node_output": {
      const key = `${event.node}.${event.port}`;
      if (event.frame !== undefined && event.frame !== null) {
        const old = state.streams[key] ?? { node: event.node, port: event.port, frames: [] };
        next.streams = { ...state.streams, [key]: { ...old, frames: [...old.frames, event.value] } };
      } else {
        next.values = { ...state.values, [key]: event.value };
      }
      break;
    }
    case "run_finished":
      next.status = event.status;
      next.finished = event;
      break;
    case "run_restarted":
      // Its executor stopped: what the first execution showed is void; the log keeps it.
      next.status = "pending";
      next.startedAt = null;
      next.nodes = Object.fromEntries(Object.keys(state.nodes).map((n) => [n, { state: "pending" as NodeState }]));
      next.streams = {};
      next.values = {};
      break;
  }
  return next;
}

/** A node that waits before it runs, and for what (`LiveNode.waiting`). */
export interface WaitingNode {
  node: string;
  waiting: string;
}

/** The nodes that wait for something before they run (their roles' models loading), in the run's node order. */
export function waitingNodes(state: RunState): WaitingNode[] {
  return Object.entries(state.nodes)
    .filter(([, view]) => view.waiting && (view.state === "queued" || view.state === "pending"))
    .map(([node, view]) => ({ node, waiting: view.waiting! }));
}

/**
 * The server's clock as this browser reads it: the smallest (arrival - event time) seen. Every
 * event is stamped by the server, so `serverNow(skew) >= time` of every event seen and a live
 * duration counted from an event's time is never negative, whatever the browser's clock says.
 */
export function clockSkew(skew: number | null, events: { time: number }[], arrivedAt: number): number | null {
  let out = skew;
  for (const e of events) {
    const seen = arrivedAt - e.time * 1000;
    if (out === null || seen < out) out = seen;
  }
  return out;
}

/**
 * A node's time as the run view shows it at `serverNowMs` (the server's clock, see `clockSkew`):
 * while it runs, the time it ran before this attempt plus the time since the attempt started, so
 * it goes on from earlier iterations and attempts and ends where the final `duration_ms` does;
 * otherwise the last time its events reported.
 */
export function liveDurationMs(view: LiveNode, serverNowMs: number): number | null | undefined {
  if (view.state !== "running" || view.since === undefined) return view.durationMs;
  return (view.busyMs ?? 0) + Math.max(0, serverNowMs - view.since * 1000);
}

/** An image or audio value a node produced, kept as a file of the run (`{$file, url, content_type}`). */
export interface MediaValue {
  $file: string;
  url: string;
  content_type: string;
  bytes?: number;
}

export function mediaOf(value: unknown): MediaValue | null {
  if (!value || typeof value !== "object") return null;
  const v = value as Partial<MediaValue>;
  if (typeof v.$file !== "string" || typeof v.url !== "string" || typeof v.content_type !== "string") return null;
  return /^(image|audio)\//.test(v.content_type) ? (v as MediaValue) : null;
}

/** A node's image or audio file, named as the run keeps it (`paint.picture`, `album.out[images][0]`, `film.out#2`). */
export interface NamedMedia {
  name: string;
  media: MediaValue;
}

/** The image and audio files in a value: the value itself, or those in its lists and dicts, each named by its place. */
export function mediaIn(value: unknown, name: string): NamedMedia[] {
  const media = mediaOf(value);
  if (media) return [{ name, media }];
  if (Array.isArray(value)) return value.flatMap((item, i) => mediaIn(item, `${name}[${i}]`));
  if (value && typeof value === "object") {
    return Object.entries(value as Record<string, unknown>).flatMap(([key, item]) => mediaIn(item, `${name}[${key}]`));
  }
  return [];
}

/** Every image and audio file the run's nodes produced so far: in their values, then in their streamed frames. */
export function runMedia(state: RunState): NamedMedia[] {
  return [
    ...Object.entries(state.values).flatMap(([key, value]) => mediaIn(value, key)),
    ...Object.entries(state.streams).flatMap(([key, stream]) => stream.frames.flatMap((frame, i) => mediaIn(frame, `${key}#${i}`))),
  ];
}

/** A leaf of a value that names run files: where it sits ("files › text") and what it is, as text. */
export interface PlainLeaf {
  path: string;
  text: string;
}

/**
 * The leaves of a value besides the run files it names (`save_outputs`' folder, `dir`), with the keys
 * they sit under: what the run view shows beside those files, in place of the value's raw JSON.
 */
export function plainLeaves(value: unknown): PlainLeaf[] {
  const leaves: PlainLeaf[] = [];
  const walk = (v: unknown, path: string[]) => {
    if (Array.isArray(v)) v.forEach((item, i) => walk(item, [...path, String(i)]));
    else if (v && typeof v === "object") {
      if (typeof (v as { $file?: unknown }).$file === "string") return;
      Object.entries(v as Record<string, unknown>).forEach(([key, item]) => walk(item, [...path, key]));
    } else leaves.push({ path: path.join(" › "), text: typeof v === "string" ? v : JSON.stringify(v) });
  };
  walk(value, []);
  return leaves;
}

/**
 * The run files a value names, wherever inside it (`{"$file": "<id>", ...}` objects in its lists and
 * dicts, as `saved: {dir, files: {image: {$file, url, name}}}`): their ids, each once, in the order
 * they appear. A string that merely says "$file" names nothing.
 */
export function fileIdsIn(value: unknown): string[] {
  const ids: string[] = [];
  const walk = (v: unknown) => {
    if (Array.isArray(v)) v.forEach(walk);
    else if (v && typeof v === "object") {
      const ref = (v as { $file?: unknown }).$file;
      if (typeof ref === "string") {
        if (!ids.includes(ref)) ids.push(ref);
        return;
      }
      Object.values(v as Record<string, unknown>).forEach(walk);
    }
  };
  walk(value);
  return ids;
}

/**
 * Streamed frames as one text, joined the way the engine joins text frames for a
 * stream-mode consumer (`"".join(frames)`); null when the frames are not all strings.
 */
export function streamText(stream: StreamView): string | null {
  return stream.frames.every((f) => typeof f === "string") ? (stream.frames as string[]).join("") : null;
}

export const isTerminal = (status: RunStatus): boolean => status === "done" || status === "failed" || status === "cancelled";
