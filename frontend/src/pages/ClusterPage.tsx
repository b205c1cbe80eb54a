/**
 * Workers and their metrics over time: KV hit rate and occupancy per tier (each tier a worker
 * has), GPU memory per device (process memory on a CPU-only cluster) and tokens/s, for the whole
 * cluster and per worker. The studio keeps the history (`api/metrics.ts`): the page opens with
 * the last 5 minutes or hour of it (the range picker, kept in the URL) and follows the live
 * stream from there, so a reload keeps the charts. Built against the interface documented in
 * `api/cluster.ts`; when the studio does not serve it, the page says so and shows nothing made up.
 */
import { useEffect, useMemo, useState } from "react";
import { Link, useSearchParams } from "react-router-dom";
import {
  cluster,
  type MetricsMessage,
  noLookupsNote,
  numberTick,
  percent,
  percentTick,
  type Tier,
  type WorkerSample,
  type WorkerSnapshot,
} from "../api/cluster";
import { describeError, wsUrl } from "../api/client";
import {
  EMPTY_TIMELINE,
  type HistoryBody,
  type HistoryMessage,
  RANGES,
  type Timeline,
  type WorkerTrack,
  appendLive,
  column,
  fromHistory,
  hasGpu,
  mean,
  metrics,
  promptTokensOf,
  rangeOf,
  sum,
  tiersOf,
} from "../api/metrics";
import { byteUnit } from "../components/chartScale";
import { type ChartSeries, LiveChart } from "../components/LiveChart";
import { ScrollTable } from "../components/ScrollTable";
import { WorkerId } from "../components/WorkerId";
import { Button, EmptyState, ErrorBox, Spinner, StatusBadge, formatBytes } from "../components/ui";
import { NodesPanel } from "../nodes/NodesPanel";
import "./cluster.css";

const TIER_COLORS: Record<string, string> = { device: "#4f46e5", host: "#0891b2", disk: "#d97706" };
const DEVICE_COLORS = ["#7c3aed", "#db2777", "#059669", "#ea580c", "#2563eb", "#65a30d"];
const CPU_ONLY = "CPU-only cluster: no worker runs on a GPU, so this charts the workers' process memory (RSS).";

function tierSeries(tiers: Tier[]): ChartSeries[] {
  return tiers.map((t) => ({ label: t, color: TIER_COLORS[t] }));
}

/** The charts' rows: the tiers present (the device tier when none is), memory by GPU device or RSS. */
function chartsOf(timeline: Timeline, only?: (track: WorkerTrack) => boolean) {
  const t = timeline.times;
  const found = tiersOf(only ? { times: t, tracks: new Map([...timeline.tracks].filter(([, v]) => only(v))) } : timeline);
  const tiers: Tier[] = found.length ? found : ["device"];
  const byTier = (pick: (s: WorkerSample, tier: Tier) => number | undefined) =>
    tiers.map((tier) => column(timeline, (s) => pick(s, tier), mean, only));
  const deviceOf = (tr: WorkerTrack) => `${tr.host} ${tr.device}`;
  const devicesOf = (tracks: WorkerTrack[]) =>
    [...new Set(tracks.filter((tr) => tr.samples.some((s) => s?.gpuMemoryBytes != null)).map(deviceOf))].sort();
  // A device keeps its colour from the cluster's chart in a worker's own (there it is the only one).
  const allGpuDevices = devicesOf([...timeline.tracks.values()]);
  const gpuDevices = only ? devicesOf([...timeline.tracks.values()].filter(only)) : allGpuDevices;
  const gpu = hasGpu(timeline) && gpuDevices.length > 0;
  const onDevice = (d: string) => (tr: WorkerTrack) => (!only || only(tr)) && deviceOf(tr) === d;
  return {
    tiers,
    hit: [t, ...byTier((s, tier) => s.hitRate[tier])],
    occupancy: [t, ...byTier((s, tier) => s.occupancy[tier])],
    gpu,
    memorySeries: gpu
      ? gpuDevices.map((d) => ({ label: d, color: DEVICE_COLORS[allGpuDevices.indexOf(d) % DEVICE_COLORS.length] }))
      : [{ label: "rss", color: "#7c3aed" }],
    memory: gpu
      ? [t, ...gpuDevices.map((d) => column(timeline, (s) => s.gpuMemoryBytes, sum, onDevice(d)))]
      : [t, column(timeline, (s) => s.rssBytes, sum, only)],
    tokens: [t, column(timeline, (s) => s.tokensPerS, sum, only)],
  };
}

export function ClusterPage() {
  const [params, setParams] = useSearchParams();
  const range = rangeOf(params.get("range"));
  const [workers, setWorkers] = useState<WorkerSnapshot[] | null | undefined>(undefined);
  const [error, setError] = useState<string | null>(null);
  const [historyError, setHistoryError] = useState<string | null>(null);
  const [timeline, setTimeline] = useState<Timeline>(EMPTY_TIMELINE);
  const [historyLoaded, setHistoryLoaded] = useState(false);
  const [source, setSource] = useState<"websocket" | "polling" | null>(null);
  const [attempt, setAttempt] = useState(0);

  useEffect(() => {
    let stopped = false;
    let socket: WebSocket | null = null;
    let timer: number | undefined;
    setTimeline(EMPTY_TIMELINE);
    setHistoryLoaded(false);
    const live = (time: number, list: WorkerSnapshot[]) => {
      setWorkers(list);
      setTimeline((t) => appendLive(t, time, list, range.seconds));
    };
    const takeHistory = (body: HistoryBody) => {
      setTimeline(fromHistory(body));
      setHistoryError(body.error ?? null);
      setHistoryLoaded(true);
    };
    const poll = async () => {
      if (stopped) return;
      try {
        const list = await cluster.workers();
        if (stopped) return;
        if (list === null) {
          setWorkers(null);
          return; // not available: no polling of a missing endpoint
        }
        live(Date.now() / 1000, list);
        setError(null);
      } catch (err) {
        setError(describeError(err));
      }
      timer = window.setTimeout(poll, 2000);
    };
    const fallback = async () => {
      setSource("polling");
      try {
        const body = await metrics.history(range.id);
        if (!stopped) takeHistory(body);
      } catch (err) {
        if (!stopped) setHistoryError(describeError(err));
      }
      poll();
    };
    (async () => {
      try {
        const first = await cluster.workers();
        if (stopped) return;
        setWorkers(first);
        if (first === null) return;
      } catch (err) {
        setError(describeError(err));
        setWorkers(null);
        return;
      }
      socket = new WebSocket(wsUrl(`/ws/metrics/?range=${range.id}`));
      let opened = false;
      socket.onopen = () => {
        opened = true;
        setSource("websocket");
      };
      socket.onmessage = (m) => {
        const msg = JSON.parse(m.data as string) as MetricsMessage | HistoryMessage;
        if (msg.type === "history") takeHistory(msg);
        else if (msg.type === "workers") live(msg.time, msg.workers);
      };
      socket.onclose = () => {
        if (stopped) return;
        if (!opened) fallback();
        else {
          setSource("polling");
          timer = window.setTimeout(poll, 2000);
        }
      };
    })();
    return () => {
      stopped = true;
      window.clearTimeout(timer);
      socket?.close();
    };
  }, [attempt, range.id, range.seconds]);

  const charts = useMemo(() => chartsOf(timeline), [timeline]);
  const tracks = useMemo(
    () =>
      [...timeline.tracks.values()]
        .filter((t) => t.samples.some((s) => s !== null))
        .sort((a, b) => a.role.localeCompare(b.role) || a.workerId.localeCompare(b.workerId)),
    [timeline],
  );

  return (
    <div
      className="page"
      data-testid="cluster-page"
      data-range={range.id}
      data-history={historyLoaded ? "loaded" : "pending"}
    >
      <header className="page-head">
        <div>
          <h1>Cluster</h1>
          <p className="muted">Role workers, their KV cache tiers, memory and throughput, with the studio's history.</p>
        </div>
        <div className="cluster-actions">
          <div className="range-picker" role="group" aria-label="Time range">
            {RANGES.map((r) => (
              <button
                key={r.id}
                type="button"
                className={`range-btn${r.id === range.id ? " active" : ""}`}
                aria-pressed={r.id === range.id}
                data-testid={`range-${r.id}`}
                onClick={() =>
                  setParams(
                    (p) => {
                      p.set("range", r.id);
                      return p;
                    },
                    { replace: true },
                  )
                }
              >
                {r.label}
              </button>
            ))}
          </div>
          {workers !== undefined && (
            <Button icon="refresh" onClick={() => setAttempt((a) => a + 1)} title="Read the history again and reopen the live stream">
              Refresh
            </Button>
          )}
        </div>
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
          <NodesPanel workers={workers} />
          <ScrollTable className="workers-card" testId="workers-card">
            <table className="table workers-table" data-testid="workers-table">
              <thead>
                <tr>
                  <th>Worker</th>
                  <th>Role</th>
                  <th>Model</th>
                  <th className="wide-only">Device</th>
                  <th>State</th>
                  <th className="right">Load</th>
                  <th className="right">KV hits (device)</th>
                  <th className="right wide-only">Heartbeat</th>
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
                {workers.map((w) => {
                  const beat = `${Math.max(0, Math.round(Date.now() / 1000 - w.last_heartbeat))} s ago`;
                  return (
                    <tr
                      key={w.info.worker_id}
                      data-testid="worker-row"
                      data-role={w.info.role}
                      data-heartbeat={w.last_heartbeat}
                    >
                      <td className="mono small worker-cell">
                        <WorkerId id={w.info.worker_id} />
                        <div className="muted worker-host" title={w.info.host || w.info.address}>
                          {w.info.host || w.info.address}
                        </div>
                      </td>
                      <td>
                        {w.info.role}
                        {w.deployment && (
                          <div className="small nowrap" data-testid="worker-deployment" title="Deployment">
                            <Link to={`/deployments/${w.deployment}`} title={w.deployment}>
                              {w.deployment_name ?? w.deployment.slice(0, 8)}
                            </Link>
                          </div>
                        )}
                        <div className="muted small narrow-only" title="Device">
                          {w.info.device}
                        </div>
                      </td>
                      <td className="nowrap">
                        <span className="worker-model" title={w.info.model ?? undefined}>
                          {w.info.model ?? <span className="muted">—</span>}
                        </span>
                      </td>
                      <td className="wide-only">{w.info.device}</td>
                      <td>
                        <StatusBadge status={w.status ?? (w.load.busy ? "busy" : "ready")} />
                        <div className="muted small narrow-only" title="Last heartbeat">
                          seen {beat}
                        </div>
                      </td>
                      <td className="right small nowrap">
                        {w.load.outstanding}/{w.info.capacity}
                        {w.load.queue_depth ? <span className="muted"> ({w.load.queue_depth} queued)</span> : null}
                      </td>
                      <td className="right small nowrap">
                        <KvHits worker={w} />
                      </td>
                      <td className="right muted small wide-only">{beat}</td>
                    </tr>
                  );
                })}
              </tbody>
            </table>
          </ScrollTable>
          <div className="muted small source-note">
            {source === "websocket" ? "Live over /ws/metrics/" : "Refreshed every 2 s from /api/workers/"} · the last{" "}
            {range.label} kept by the studio · averages across workers for rates, sums for memory and throughput
          </div>
          {historyError && <ErrorBox>The studio's metrics history: {historyError}</ErrorBox>}
          <div className="charts">
            <LiveChart
              span={range.seconds}
              title="KV hit rate by tier"
              testId="chart-hit-rate"
              series={tierSeries(charts.tiers)}
              data={charts.hit}
              yRange={[0, 1]}
              format={percent}
              emptyNote={noLookupsNote(promptTokensOf(timeline))}
              tickFormat={percentTick}
            />
            <LiveChart
              span={range.seconds}
              title="Tier occupancy"
              testId="chart-occupancy"
              series={tierSeries(charts.tiers)}
              data={charts.occupancy}
              yRange={[0, null]}
              format={percent}
              tickFormat={percentTick}
            />
            {charts.gpu ? (
              <LiveChart
                span={range.seconds}
                title="GPU memory by device"
                testId="chart-gpu-memory"
                series={charts.memorySeries}
                data={charts.memory}
                yRange={[0, null]}
                yUnit={byteUnit}
                format={(v) => formatBytes(v)}
              />
            ) : (
              <LiveChart
                span={range.seconds}
                title="Process memory (RSS)"
                testId="chart-process-memory"
                note={CPU_ONLY}
                series={charts.memorySeries}
                data={charts.memory}
                yRange={[0, null]}
                yUnit={byteUnit}
                format={(v) => formatBytes(v)}
              />
            )}
            <LiveChart
              span={range.seconds}
              title="Tokens / s"
              testId="chart-tokens"
              series={[{ label: "generated", color: "#16a34a" }]}
              data={charts.tokens}
              // From 0, following the data: with no value yet its y axis still shows, and the time
              // axis keeps its place (without one, the plot took the axis's room and cut the first time).
              yRange={[0, null]}
              format={(v) => v.toFixed(v > 0 && v < 10 ? 1 : 0)}
              tickFormat={numberTick}
            />
          </div>
          <h2 className="section-heading">Per worker</h2>
          {tracks.length === 0 && (
            <p className="muted" data-testid="worker-charts-empty">
              {historyLoaded ? `No worker reported metrics in the last ${range.label}.` : "Loading the history…"}
            </p>
          )}
          <div className="worker-charts" data-testid="worker-charts">
            {tracks.map((track) => (
              <WorkerCharts key={track.key} timeline={timeline} track={track} span={range.seconds} />
            ))}
          </div>
        </>
      )}
    </div>
  );
}

/** One worker's charts: its tiers' hit rate and occupancy (when it has a KV cache), its memory. */
function WorkerCharts({ timeline, track, span }: { timeline: Timeline; track: WorkerTrack; span: number }) {
  const charts = useMemo(() => chartsOf(timeline, (t) => t.key === track.key), [timeline, track.key]);
  const hasKv = track.samples.some((s) => s && s.tiers.length > 0);
  const live = timeline.tracks.get(track.key)?.samples.at(-1) != null;
  const id = `worker-card-${track.workerId}`;
  return (
    <section className="card worker-card" data-testid={id} data-role={track.role} data-live={live}>
      <header className="worker-card-head">
        <strong>{track.role}</strong>{" "}
        <span className="small">
          <WorkerId id={track.workerId} />
        </span>
        <span className="muted small">
          {" "}
          · {track.host} · {track.device}
          {!live && " · gone"}
        </span>
      </header>
      <div className="worker-card-charts">
        {hasKv && (
          <>
            <LiveChart
              span={span}
              title="KV hit rate"
              testId={`${id}-hit-rate`}
              series={tierSeries(charts.tiers)}
              data={charts.hit}
              yRange={[0, 1]}
              format={percent}
              emptyNote={noLookupsNote(promptTokensOf(timeline, (t) => t.key === track.key))}
              tickFormat={percentTick}
              height={120}
            />
            <LiveChart
              span={span}
              title="Tier occupancy"
              testId={`${id}-occupancy`}
              series={tierSeries(charts.tiers)}
              data={charts.occupancy}
              yRange={[0, null]}
              format={percent}
              tickFormat={percentTick}
              height={120}
            />
          </>
        )}
        <LiveChart
          span={span}
          title={charts.gpu ? "GPU memory" : "Process memory (RSS)"}
          testId={`${id}-memory`}
          series={charts.memorySeries}
          data={charts.memory}
          yRange={[0, null]}
          yUnit={byteUnit}
          format={(v) => formatBytes(v)}
          height={120}
        />
      </div>
    </section>
  );
}

/** A worker's device-tier hits over its lookups (prefix matches and pages served), when it has a KV cache. */
function KvHits({ worker }: { worker: WorkerSnapshot }) {
  const m = worker.load.metrics ?? {};
  const lookups = m["device.lookups"];
  const hits = m["device.hit_pages"];
  if (typeof lookups !== "number" || typeof hits !== "number") return <span className="muted">—</span>;
  const prompted = m["llm.prompt_tokens"];
  return (
    <span
      data-testid={`worker-kv-${worker.info.worker_id}`}
      data-lookups={lookups}
      data-hits={hits}
      title={lookups > 0 ? undefined : noLookupsNote(typeof prompted === "number" ? prompted : null)}
    >
      {hits}/{lookups} pages{lookups > 0 ? <span className="muted"> ({Math.round((100 * hits) / lookups)}%)</span> : null}
    </span>
  );
}
