/**
 * Workers and their live metrics: KV hit rate per tier, tier occupancy, GPU memory and
 * tokens/s. Built against the interface documented in `api/cluster.ts`; when the studio
 * does not serve it, the page says so and shows nothing made up.
 */
import { useEffect, useMemo, useRef, useState } from "react";
import { cluster, type MetricsMessage, sampleOf, TIERS, type WorkerSample, type WorkerSnapshot } from "../api/cluster";
import { describeError, wsUrl } from "../api/client";
import { LiveChart } from "../components/LiveChart";
import { Button, EmptyState, ErrorBox, Spinner, StatusBadge, formatBytes } from "../components/ui";

const WINDOW = 300;
const TIER_COLORS: Record<string, string> = { device: "#4f46e5", host: "#0891b2", disk: "#d97706" };

interface Series {
  times: number[];
  /** worker id -> samples aligned with `times` (null before the worker appeared). */
  samples: Map<string, (WorkerSample | null)[]>;
}

function push(series: Series, time: number, workers: WorkerSnapshot[]): Series {
  const times = [...series.times, time].slice(-WINDOW);
  const samples = new Map<string, (WorkerSample | null)[]>();
  for (const w of workers) {
    const old = series.samples.get(w.info.worker_id) ?? new Array(series.times.length).fill(null);
    const prev = [...old].reverse().find((s) => s !== null) ?? undefined;
    samples.set(w.info.worker_id, [...old, sampleOf(w, time, prev)].slice(-WINDOW));
  }
  return { times, samples };
}

function mean(values: number[]): number | null {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : null;
}
function sum(values: number[]): number | null {
  return values.length ? values.reduce((a, b) => a + b, 0) : null;
}

/** One aligned data row per chart series, aggregating the workers at each time. */
function aggregate(series: Series, pick: (s: WorkerSample) => number | null | undefined, combine: (v: number[]) => number | null) {
  return series.times.map((_, i) => {
    const values: number[] = [];
    for (const rows of series.samples.values()) {
      const v = rows[i] ? pick(rows[i]!) : null;
      if (typeof v === "number") values.push(v);
    }
    return combine(values);
  });
}

export function ClusterPage() {
  const [workers, setWorkers] = useState<WorkerSnapshot[] | null | undefined>(undefined);
  const [error, setError] = useState<string | null>(null);
  const [series, setSeries] = useState<Series>({ times: [], samples: new Map() });
  const [source, setSource] = useState<"websocket" | "polling" | null>(null);
  const [attempt, setAttempt] = useState(0);
  const available = useRef(false);

  useEffect(() => {
    let stopped = false;
    let socket: WebSocket | null = null;
    let timer: number | undefined;
    const take = (time: number, list: WorkerSnapshot[]) => {
      setWorkers(list);
      setSeries((s) => push(s, time, list));
    };
    const poll = async () => {
      if (stopped) return;
      try {
        const list = await cluster.workers();
        if (list === null) {
          setWorkers(null);
          return; // not available: no polling of a missing endpoint
        }
        available.current = true;
        take(Date.now() / 1000, list);
        setError(null);
      } catch (err) {
        setError(describeError(err));
      }
      timer = window.setTimeout(poll, 2000);
    };
    (async () => {
      try {
        const first = await cluster.workers();
        if (stopped) return;
        if (first === null) {
          setWorkers(null);
          return;
        }
        available.current = true;
        take(Date.now() / 1000, first);
      } catch (err) {
        setError(describeError(err));
        setWorkers(null);
        return;
      }
      socket = new WebSocket(wsUrl("/ws/metrics/"));
      let opened = false;
      socket.onopen = () => {
        opened = true;
        setSource("websocket");
      };
      socket.onmessage = (m) => {
        const msg = JSON.parse(m.data as string) as MetricsMessage;
        if (msg.type === "workers") take(msg.time, msg.workers);
      };
      socket.onclose = () => {
        if (stopped) return;
        setSource("polling");
        if (!opened) poll();
        else timer = window.setTimeout(poll, 2000);
      };
    })();
    return () => {
      stopped = true;
      window.clearTimeout(timer);
      socket?.close();
    };
  }, [attempt]);

  const charts = useMemo(() => {
    const t = series.times;
    return {
      hit: [t, ...TIERS.map((tier) => aggregate(series, (s) => s.hitRate[tier], mean))],
      occupancy: [t, ...TIERS.map((tier) => aggregate(series, (s) => s.occupancy[tier], mean))],
      gpu: [t, aggregate(series, (s) => s.gpuMemoryBytes, sum)],
      tokens: [t, aggregate(series, (s) => s.tokensPerS, sum)],
    };
  }, [series]);

  return (
    <div className="page">
      <header className="page-head">
        <div>
          <h1>Cluster</h1>
          <p className="muted">Role workers, their KV cache tiers, GPU memory and throughput, live.</p>
        </div>
        {workers !== undefined && (
          <Button icon="refresh" onClick={() => setAttempt((a) => a + 1)}>
            Retry
          </Button>
        )}
      </header>
      {error && <ErrorBox>{error}</ErrorBox>}
      {workers === undefined && <Spinner label="Asking the studio for workers" />}
      {workers === null && (
        <EmptyState icon="server" title="Worker metrics are not available on this studio yet" testId="cluster-unavailable">
          <p>
            This studio does not serve the workers API (<code>/api/workers/</code> answered 404), so there are no
            workers or metrics to show. Runs still execute in the studio's embedded engine.
          </p>
          <div className="interface">
            <div className="section-title">What this page shows once the studio serves it</div>
            <ul>
              <li>
                <code>GET /api/workers/</code> — each worker's role, model, device, host and state
              </li>
              <li>
                <code>WS /ws/metrics/</code> — live gauges: KV hit rate per tier (device, host, disk), tier occupancy,
                GPU memory and tokens/s
              </li>
            </ul>
          </div>
        </EmptyState>
      )}
      {workers && (
        <>
          <div className="card">
            <table className="table" data-testid="workers-table">
              <thead>
                <tr>
                  <th>Worker</th>
                  <th>Role</th>
                  <th>Model</th>
                  <th>Device</th>
                  <th>State</th>
                  <th className="right">Load</th>
                  <th className="right">KV hits (device)</th>
                  <th className="right">Heartbeat</th>
                </tr>
              </thead>
              <tbody>
                {workers.length === 0 && (
                  <tr>
                    <td colSpan={8} className="muted center">
                      No worker is registered. Deploy a workflow to start some.
                    </td>
                  </tr>
                )}
                {workers.map((w) => (
                  <tr
                    key={w.info.worker_id}
                    data-testid="worker-row"
                    data-role={w.info.role}
                    data-heartbeat={w.last_heartbeat}
                  >
                    <td className="mono small">
                      {w.info.worker_id}
                      <div className="muted">{w.info.host || w.info.address}</div>
                    </td>
                    <td>{w.info.role}</td>
                    <td>{w.info.model ?? <span className="muted">—</span>}</td>
                    <td>{w.info.device}</td>
                    <td>
                      <StatusBadge status={w.status ?? (w.load.busy ? "busy" : "ready")} />
                    </td>
                    <td className="right small">
                      {w.load.outstanding}/{w.info.capacity}
                      {w.load.queue_depth ? <span className="muted"> ({w.load.queue_depth} queued)</span> : null}
                    </td>
                    <td className="right small">
                      <KvHits worker={w} />
                    </td>
                    <td className="right muted small">{Math.max(0, Math.round(Date.now() / 1000 - w.last_heartbeat))} s ago</td>
                  </tr>
                ))}
              </tbody>
            </table>
          </div>
          <div className="muted small source-note">
            {source === "websocket" ? "Live over /ws/metrics/" : "Refreshed every 2 s from /api/workers/"} · averages across
            workers for rates, sums for memory and throughput
          </div>
          <div className="charts">
            <LiveChart
              title="KV hit rate by tier"
              testId="chart-hit-rate"
              series={TIERS.map((t) => ({ label: t, color: TIER_COLORS[t] }))}
              data={charts.hit}
              yRange={[0, 1]}
              format={(v) => `${Math.round(v * 100)}%`}
            />
            <LiveChart
              title="Tier occupancy"
              testId="chart-occupancy"
              series={TIERS.map((t) => ({ label: t, color: TIER_COLORS[t] }))}
              data={charts.occupancy}
              yRange={[0, 1]}
              format={(v) => `${Math.round(v * 100)}%`}
            />
            <LiveChart
              title="GPU memory"
              testId="chart-gpu-memory"
              series={[{ label: "used", color: "#7c3aed" }]}
              data={charts.gpu}
              format={(v) => formatBytes(v)}
            />
            <LiveChart
              title="Tokens / s"
              testId="chart-tokens"
              series={[{ label: "generated", color: "#16a34a" }]}
              data={charts.tokens}
              format={(v) => v.toFixed(0)}
            />
          </div>
        </>
      )}
    </div>
  );
}

/** A worker's device-tier hits over its lookups (prefix matches and pages served), when it has a KV cache. */
function KvHits({ worker }: { worker: WorkerSnapshot }) {
  const m = worker.load.metrics ?? {};
  const lookups = m["device.lookups"];
  const hits = m["device.hit_pages"];
  if (typeof lookups !== "number" || typeof hits !== "number") return <span className="muted">—</span>;
  return (
    <span data-testid={`worker-kv-${worker.info.worker_id}`} data-lookups={lookups} data-hits={hits}>
      {hits}/{lookups} pages{lookups > 0 ? <span className="muted"> ({Math.round((100 * hits) / lookups)}%)</span> : null}
    </span>
  );
}
