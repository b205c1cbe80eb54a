/**
 * One run, live: the graph coloured by node state with timings, outputs as they arrive
 * (streamed text, images, audio), the event log, and cancel.
 */
import { useCallback, useEffect, useMemo, useReducer, useRef, useState } from "react";
import { Link, useParams } from "react-router-dom";
import { ApiError, describeError } from "../api/client";
import { runs } from "../api/studio";
import type { GraphSpec, RunDetail, RunEvent, RunFile } from "../api/types";
import { Icon } from "../components/icons";
import { Lightbox } from "../components/Lightbox";
import { RunGraph } from "../components/RunGraph";
import { useToast } from "../components/toast";
import { Button, ErrorBox, LoadError, Spinner, StatusBadge, formatBytes, formatMs, formatTime } from "../components/ui";
import { WorkerId } from "../components/WorkerId";
import { useRunEvents } from "../hooks/useRunEvents";
import {
  clockSkew,
  fileIdsIn,
  initialRunState,
  plainLeaves,
  isTerminal,
  liveDurationMs,
  type MediaValue,
  mediaOf,
  reduceRun,
  type RunState,
  runMedia,
  streamText,
  waitingNodes,
} from "../run/state";
import { deploymentLabel } from "../run/target";
import { type RandomWeightsRole, randomWeightRoles } from "../run/weights";

function reducer(state: RunState, events: RunEvent[]): RunState {
  return events.reduce(reduceRun, state);
}

export function RunPage() {
  const { id } = useParams<{ id: string }>();
  const [detail, setDetail] = useState<RunDetail | null>(null);
  /** Browser clock minus server clock (upper bound; see `clockSkew`): live times count on the server's clock. */
  const skew = useRef<number | null>(null);
  const [loadError, setLoadError] = useState<{ status?: number; message: string } | null>(null);
  const [state, apply] = useReducer(reducer, undefined, () => initialRunState());
  const [selected, setSelected] = useState<string | null>(null);
  const [cancelling, setCancelling] = useState(false);
  const [now, setNow] = useState(Date.now());
  const [zoomed, setZoomed] = useState<{ name: string; media: MediaValue } | null>(null);
  const closeZoom = useCallback(() => setZoomed(null), []);
  const toast = useToast();
  const refresh = useCallback(async () => {
    if (!id) return;
    try {
      const got = await runs.get(id);
      // Stamped as the server answered: a bound on the skew before any live event comes.
      skew.current = clockSkew(skew.current, [{ time: got.server_time }], Date.now());
      setDetail(got);
    } catch (err) {
      setLoadError({ status: (err as ApiError).status, message: describeError(err) });
    }
  }, [id]);

  useEffect(() => {
    refresh();
  }, [refresh]);

  const onEvents = useCallback(
    (events: RunEvent[]) => {
      const arrived = Date.now();
      skew.current = clockSkew(skew.current, events, arrived);
      // The clock moves with them: read on the last 250 ms tick, a node that just started would
      // show 0.00 ms and the run's time lag the nodes' (the skew holds for the arrival time only).
      setNow(arrived);
      apply(events);
      if (events.some((e) => e.type === "run_finished")) refresh();
    },
    [refresh],
  );
  const stream = useRunEvents(id, onEvents);

  const status = state.finished ? state.status : state.lastSeq >= 0 ? state.status : (detail?.status ?? "pending");
  const live = !isTerminal(status);
  useEffect(() => {
    if (!live) return;
    const t = window.setInterval(() => setNow(Date.now()), 250);
    return () => window.clearInterval(t);
  }, [live]);

  const serverNow = now - (skew.current ?? 0);
  const nodeStates = useMemo(() => {
    const out: RunState["nodes"] = {};
    for (const [node, view] of Object.entries(state.nodes)) {
      out[node] = view.state === "running" ? { ...view, durationMs: liveDurationMs(view, serverNow) } : view;
    }
    return out;
  }, [state.nodes, serverNow]);

  const cancel = async () => {
    if (!id) return;
    setCancelling(true);
    try {
      await runs.cancel(id);
      toast("Run cancelled", "success");
      refresh();
    } catch (err) {
      toast(err instanceof ApiError && err.status === 409 ? err.message : describeError(err), "error");
    } finally {
      setCancelling(false);
    }
  };

  if (loadError && !detail) {
    return (
      <div className="page">
        <LoadError
          error={loadError}
          what="run"
          back={
            <Link className="btn btn-secondary" to="/runs">
              All runs
            </Link>
          }
        />
      </div>
    );
  }
  if (!detail) {
    return (
      <div className="page">
        <Spinner label="Loading the run" />
      </div>
    );
  }

  const startedMs = state.startedAt ? state.startedAt * 1000 : detail.started_at ? Date.parse(detail.started_at) : null;
  const duration =
    state.finished?.duration_ms ?? detail.duration_ms ?? (startedMs && live ? Math.max(0, serverNow - startedMs) : null);
  const media = runMedia(state);
  const waiting = live ? waitingNodes(state) : [];
  // The stored outputs name files by id; the event's outputs only preview them.
  const outputs = isTerminal(detail.status) ? detail.outputs : (state.finished?.outputs ?? {});
  const randomRoles = randomWeightRoles(detail.spec, detail.random_weights_roles);
  const randomNodes = new Set(randomRoles.flatMap((r) => r.nodes));

  return (
    <div className="run-page" data-testid="run-page">
      <header className="run-head">
        <div>
          <div className="crumbs">
            <Link to="/runs">Runs</Link> / <Link to={`/workflows/${detail.workflow}`}>{detail.workflow_name}</Link>{" "}
            <span className="pill">v{detail.version}</span>
          </div>
          <h1 className="run-title">
            Run <span className="mono">{detail.id.slice(0, 8)}</span>
            <span data-testid="run-status">
              <StatusBadge status={status} />
            </span>
          </h1>
          <div className="run-meta muted small">
            <span>created {formatTime(detail.created_at)}</span>
            {detail.deployment && (
              <span data-testid="run-deployment">
                on deployment{" "}
                <Link to={`/deployments/${detail.deployment}`} title={detail.deployment}>
                  {deploymentLabel(detail)}
                </Link>
              </span>
            )}
            {duration !== null && <span data-testid="run-duration">{live ? "running for" : "took"} {formatMs(duration)}</span>}
            {live && (
              <span className={`stream-state stream-${stream}`} title="Event stream">
                {stream === "live" ? "● live" : stream}
              </span>
            )}
          </div>
          {randomRoles.length > 0 && <RandomWeightsNote roles={randomRoles} />}
        </div>
        <div className="head-actions">
          {live && (
            <Button variant="danger" icon="stop" onClick={cancel} disabled={cancelling} data-testid="cancel-run">
              {cancelling ? "Cancelling…" : "Cancel"}
            </Button>
          )}
          <Link
            className="btn btn-secondary"
            data-testid="run-again"
            to={`/workflows/${detail.workflow}/run?version=${detail.version}&from=${detail.id}${detail.deployment ? `&deployment=${detail.deployment}` : ""}`}
          >
            <Icon name="refresh" /> Run again
          </Link>
        </div>
      </header>

      {waiting.length > 0 && (
        <div className="info-box neutral run-waiting" data-testid="run-waiting">
          <span className="spinner small" />
          <span>
            Starting workers —{" "}
            {waiting.map((w, i) => (
              <span key={w.node}>
                {i > 0 && "; "}
                <strong className="mono">{w.node}</strong>: {w.waiting}
              </span>
            ))}
          </span>
        </div>
      )}
      {status === "cancelled" && (
        <div className="info-box neutral" data-testid="run-cancelled">
          <Icon name="stop" /> {state.finished?.error || detail.error || "The run was cancelled."}
        </div>
      )}
      {status !== "cancelled" && (state.finished?.error || detail.error) && (
        <ErrorBox>
          {state.finished?.failed_node || detail.failed_node ? (
            <strong>{state.finished?.failed_node || detail.failed_node}: </strong>
          ) : null}
          {state.finished?.error || detail.error}
        </ErrorBox>
      )}

      <div className="run-body">
        <div className="card run-graph" data-testid="run-graph">
          {/* The run's detail carries its graph: drawn with the first paint, before any event. */}
          <RunGraph spec={detail.spec} layout={detail.layout} states={nodeStates} onSelect={setSelected} selected={selected} />
          <Legend />
        </div>
        <aside className="run-side">
          <section className="card pad-card" data-testid="run-outputs">
            <div className="section-title">Outputs</div>
            {Object.keys(outputs).length === 0 && !isTerminal(status) && <p className="muted small">Waiting for the run to finish…</p>}
            {Object.keys(outputs).length === 0 && isTerminal(status) && <p className="muted small">No outputs.</p>}
            {orderedOutputs(outputs, detail.spec).map(([name, value]) => (
              <OutputValue key={name} name={name} value={value} files={detail.files} links={state.finished?.files ?? detail.output_links} />
            ))}
          </section>

          {media.length > 0 && (
            <section className="card pad-card" data-testid="run-media">
              <div className="section-title">Images and audio from the nodes</div>
              <div className="media-grid">
                {media.map(({ name, media: m }) => (
                  <MediaView key={name} name={name} media={m} onZoom={() => setZoomed({ name, media: m })} />
                ))}
              </div>
            </section>
          )}

          <StreamsPanel state={state} />

          <section className="card pad-card">
            <div className="section-title">Nodes</div>
            <table className="table compact" data-testid="node-table">
              <thead>
                <tr>
                  <th>Node</th>
                  <th>State</th>
                  <th className="right">Time</th>
                </tr>
              </thead>
              <tbody>
                {detail.spec.nodes.map((n) => {
                  const v = nodeStates[n.id];
                  return (
                    <tr
                      key={n.id}
                      className={selected === n.id ? "selected-row" : undefined}
                      onClick={() => setSelected(n.id)}
                      data-testid={`node-row-${n.id}`}
                      data-state={v?.state ?? "pending"}
                    >
                      <td className="mono">
                        <div className="node-id-cell">
                          <span className="node-id" title={n.id}>
                            {n.id}
                          </span>
                          {randomNodes.has(n.id) && (
                            <span className="pill random-weights" title="Its role's model has random weights (for testing): the output is noise" data-testid={`node-random-${n.id}`}>
                              random weights
                            </span>
                          )}
                        </div>
                      </td>
                      <td>
                        <span className={`state-chip state-${v?.state ?? "pending"}`}>{v?.state ?? "pending"}</span>
                        {v?.iterations && v.iterations > 1 ? <span className="muted small"> ×{v.iterations}</span> : null}
                        {v?.waiting && (v.state === "queued" || v.state === "pending") && (
                          <div className="muted small" data-testid={`node-waiting-${n.id}`}>
                            {v.waiting}
                          </div>
                        )}
                        {v?.state === "running" && v.progress !== null && v.progress !== undefined && (
                          <span className="table-progress" title={v.message} data-testid={`table-progress-${n.id}`}>
                            <div style={{ width: `${Math.round(v.progress * 100)}%` }} />
                          </span>
                        )}
                      </td>
                      <td className="right mono small nowrap" data-testid={`node-time-${n.id}`}>
                        {formatMs(v?.durationMs)}
                      </td>
                    </tr>
                  );
                })}
              </tbody>
            </table>
          </section>

          {selected && <NodeDetail node={selected} state={state} now={nodeStates[selected]} onZoom={(name, m) => setZoomed({ name, media: m })} />}

          <section className="card pad-card">
            <div className="section-title">Inputs</div>
            <InputsView detail={detail} />
          </section>

          <details className="card pad-card details" data-testid="event-log">
            <summary>Events ({state.log.length})</summary>
            <ol className="event-log">
              {state.log.map((e) => (
                <li key={e.seq}>
                  <span className="mono muted">#{e.seq}</span> <span className="code">{e.type}</span>{" "}
                  {"node" in e && <span className="mono">{e.node}</span>}{" "}
                  {e.type === "node_state" && <span className={`state-chip state-${e.state}`}>{e.state}</span>}
                  {e.type === "node_output" && <span className="muted small">{e.port}{e.frame !== undefined && e.frame !== null ? ` frame ${e.frame}` : ""}</span>}
                  {e.type === "run_finished" && <span className={`state-chip state-${e.status}`}>{e.status}</span>}
                  {e.type === "run_restarted" && <span className="muted small">attempt {e.attempt}: {e.error}</span>}
                </li>
              ))}
            </ol>
          </details>
        </aside>
      </div>
      {zoomed && <Lightbox name={zoomed.name} url={zoomed.media.url} onClose={closeZoom} />}
    </div>
  );
}

/**
 * Which roles computed with random weights, as the catalogue and the editor say of it: one line
 * under the run's times (the graph keeps its room), the whole story in its tooltip.
 */
function RandomWeightsNote({ roles }: { roles: RandomWeightsRole[] }) {
  const why =
    "Seeded random weights, for testing: what these roles make is noise, not a trained model's output" +
    " (a diffusion role denoises through a seeded head, whatever its LLM).";
  return (
    <div className="run-weights small" data-testid="run-random-weights" title={why}>
      <Icon name="alert" size={13} />
      <strong>Random weights (for testing):</strong>
      {roles.map((r, i) => (
        <span key={r.role} data-testid={`random-role-${r.role}`}>
          <span className="mono">{r.role}</span> on <span className="mono">{r.model}</span>
          {r.nodes.length > 0 && <span className="muted"> ({r.nodes.join(", ")})</span>}
          {i < roles.length - 1 && ";"}
        </span>
      ))}
      <span className="muted">— {roles.length > 1 ? "their" : "its"} output is noise</span>
    </div>
  );
}

/** A node's image (a thumbnail that opens full size) or audio clip (a player). */
function MediaView({ name, media, onZoom }: { name: string; media: MediaValue; onZoom: () => void }) {
  return (
    <div className="media-item" data-testid={`media-${name}`}>
      {media.content_type.startsWith("image/") ? (
        <button type="button" className="media-thumb" onClick={onZoom} title={`${name}: open full size`}>
          <img src={media.url} alt={name} data-testid={`media-thumb-${name}`} />
        </button>
      ) : (
        <audio controls src={media.url} className="audio" data-testid={`media-audio-${name}`} />
      )}
      <span className="mono small muted">
        {name}
        {media.bytes ? ` · ${formatBytes(media.bytes)}` : ""}
      </span>
    </div>
  );
}

/** Outputs in the order the workflow declares its output nodes. */
function orderedOutputs(outputs: Record<string, unknown>, spec: GraphSpec): [string, unknown][] {
  const order = spec.nodes.filter((n) => n.kind === "output").map((n) => n.id);
  const rank = (name: string) => (order.includes(name) ? order.indexOf(name) : order.length);
  return Object.entries(outputs).sort((a, b) => rank(a[0]) - rank(b[0]));
}

function Legend() {
  return (
    <div className="legend">
      {["pending", "queued", "running", "done", "failed", "skipped", "cancelled"].map((s) => (
        <span key={s} className="legend-item">
          <span className={`legend-dot state-${s}`} />
          {s}
        </span>
      ))}
    </div>
  );
}

function fileFor(value: unknown, files: RunFile[]): RunFile | undefined {
  if (value && typeof value === "object" && "$file" in (value as object)) {
    const id = (value as { $file: string }).$file;
    return files.find((f) => f.id === id);
  }
  return undefined;
}

function FileView({ file, url, name }: { file?: RunFile; url: string; name: string }) {
  const type = file?.content_type ?? "";
  if (type.startsWith("image/")) {
    return (
      <a href={url} target="_blank" rel="noreferrer">
        <img className="output-image" src={url} alt={name} data-testid={`output-image-${name}`} />
      </a>
    );
  }
  if (type.startsWith("audio/")) return <audio controls src={url} className="audio" data-testid={`output-audio-${name}`} />;
  return (
    <a href={url} download className="btn btn-ghost btn-sm">
      <Icon name="download" size={14} /> {file?.filename ?? "download"} {file && <span className="muted">({formatBytes(file.size)})</span>}
    </a>
  );
}

function OutputValue({
  name,
  value,
  files,
  links,
}: {
  name: string;
  value: unknown;
  files: RunFile[];
  links: Record<string, string>;
}) {
  const file = fileFor(value, files) ?? files.find((f) => f.role === "output" && f.name === name);
  const url = links[name] ?? file?.url;
  const named = url ? [] : fileIdsIn(value);
  let body: React.ReactNode;
  if (url && file) body = <FileView file={file} url={url} name={name} />;
  else if (url) body = <Spinner label="Loading the file" />; // its type arrives with the run's details
  else if (named.length > 0) body = <SavedFiles name={name} value={value} ids={named} files={files} />;
  else body = <ValueView value={value} />;
  return (
    <div className="output" data-testid={`output-${name}`}>
      <div className="output-name mono">{name}</div>
      {body}
    </div>
  );
}

/**
 * A value that names run files (`save_outputs`' `{dir, files: {text, image}}`) as what it is: those
 * files, and its other leaves (the folder, named in your own folder) as text, never its raw JSON.
 */
function SavedFiles({ name, value, ids, files }: { name: string; value: unknown; ids: string[]; files: RunFile[] }) {
  const loaded = ids.every((id) => files.some((f) => f.id === id));
  const leaves = plainLeaves(value);
  return (
    <div className="saved-files" data-testid={`saved-files-${name}`}>
      {loaded ? <OutputFiles name={name} ids={ids} files={files} /> : <Spinner label="Loading the files" />}
      {leaves.length > 0 && (
        <dl className="saved-leaves">
          {leaves.map((leaf) => (
            <div key={leaf.path} className="saved-leaf">
              <dt className="muted">{leaf.path === "dir" ? "folder (in your files)" : leaf.path}</dt>
              <dd className="mono">{leaf.text}</dd>
            </div>
          ))}
        </dl>
      )}
    </div>
  );
}

/**
 * The run files a JSON output names (`{"$file": ...}` inside it): images as thumbnails that open
 * full size, audio as a player, anything else as a download; served as the run's files, to its owner.
 */
function OutputFiles({ name, ids, files }: { name: string; ids: string[]; files: RunFile[] }) {
  const named = ids.map((id) => files.find((f) => f.id === id)).filter((f): f is RunFile => f !== undefined);
  if (named.length === 0) return null;
  return (
    <div className="output-files" data-testid={`output-files-${name}`}>
      {named.map((f) => (
        <div className="output-file" key={f.id} data-testid={`output-file-${f.id}`}>
          {f.content_type.startsWith("image/") ? (
            <a href={f.url} target="_blank" rel="noreferrer" className="output-file-thumb" title={`${f.filename}: open full size`}>
              <img src={f.url} alt={f.filename} />
            </a>
          ) : f.content_type.startsWith("audio/") ? (
            <audio controls src={f.url} className="audio" />
          ) : null}
          <a href={f.url} download={f.filename} className="output-file-link" title={`Download ${f.filename}`}>
            <Icon name="download" size={12} />
            <span className="mono">{f.filename}</span>
            <span className="muted">{formatBytes(f.size)}</span>
          </a>
        </div>
      ))}
    </div>
  );
}

/** A text value; an empty one says so, rather than an empty box that reads as not loaded. */
function TextView({ text, className = "" }: { text: string; className?: string }) {
  if (text === "") {
    return (
      <div className={`output-text empty-value ${className}`} data-empty="yes">
        (empty text)
      </div>
    );
  }
  return <div className={`output-text ${className}`}>{text}</div>;
}

export function ValueView({ value }: { value: unknown }) {
  if (typeof value === "string") return <TextView text={value} />;
  return <pre className="output-json">{JSON.stringify(value, null, 2)}</pre>;
}

function StreamsPanel({ state }: { state: RunState }) {
  const streams = Object.entries(state.streams);
  if (streams.length === 0) return null;
  return (
    <section className="card pad-card" data-testid="run-streams">
      <div className="section-title">Streams</div>
      {streams.map(([key, s]) => {
        const text = streamText(s);
        const running = state.nodes[s.node]?.state === "running";
        return (
          <div className="output" key={key}>
            <div className="output-name mono">
              {key} <span className="muted small">{s.frames.length} frame{s.frames.length === 1 ? "" : "s"}</span>
            </div>
            {text !== null ? (
              running ? (
                <div className="output-text stream-text typing">{text}</div>
              ) : (
                <TextView text={text} className="stream-text" />
              )
            ) : (
              <FramesView frames={s.frames} />
            )}
          </div>
        );
      })}
    </section>
  );
}

/**
 * Frames that are not text: token ids (lists of numbers) read as one list on a line or two;
 * anything else as its latest frame, the earlier ones counted.
 */
function FramesView({ frames }: { frames: unknown[] }) {
  if (frames.every((f) => Array.isArray(f) && f.every((x) => typeof x === "number"))) {
    const ids = (frames as number[][]).flat();
    return <div className="output-text mono small">{ids.join(" ")}</div>;
  }
  return (
    <details className="details">
      <summary className="muted small">latest of {frames.length} frame{frames.length === 1 ? "" : "s"}</summary>
      <pre className="output-json">{JSON.stringify(frames[frames.length - 1], null, 1)}</pre>
    </details>
  );
}

function NodeDetail({
  node,
  state,
  now,
  onZoom,
}: {
  node: string;
  state: RunState;
  now?: RunState["nodes"][string];
  onZoom: (name: string, media: MediaValue) => void;
}) {
  const view = now ?? state.nodes[node];
  const values = Object.entries(state.values).filter(([k]) => k.startsWith(`${node}.`));
  const streams = Object.entries(state.streams).filter(([, s]) => s.node === node);
  return (
    <section className="card pad-card" data-testid="node-detail">
      <div className="section-title">
        Node <span className="mono">{node}</span>
      </div>
      <dl className="kv">
        <dt>State</dt>
        <dd>
          <span className={`state-chip state-${view?.state ?? "pending"}`}>{view?.state ?? "pending"}</span>
        </dd>
        <dt>Time</dt>
        <dd>{formatMs(view?.durationMs) || "—"}</dd>
        {view?.worker && (
          <>
            <dt>Ran on</dt>
            <dd className="small" data-testid="node-where">
              <WorkerId id={view.worker} />
              {view.host && <span className="mono"> on {view.host}</span>}
            </dd>
          </>
        )}
        {view?.message && (
          <>
            <dt>Progress</dt>
            <dd>{view.message}</dd>
          </>
        )}
        {view?.error && (
          <>
            <dt>Error</dt>
            <dd className="danger-text">{view.error}</dd>
          </>
        )}
      </dl>
      {values.map(([k, v]) => {
        const m = mediaOf(v);
        return (
          <div className="output" key={k}>
            <div className="output-name mono">{k}</div>
            {m ? <MediaView name={k} media={m} onZoom={() => onZoom(k, m)} /> : <ValueView value={v} />}
          </div>
        );
      })}
      {streams.map(([k, s]) => {
        const text = streamText(s);
        return (
          <div className="output" key={k}>
            <div className="output-name mono">
              {k} <span className="muted small">streamed</span>
            </div>
            {text !== null ? <TextView text={text} /> : <FramesView frames={s.frames} />}
          </div>
        );
      })}
      {values.length === 0 && streams.length === 0 && <p className="muted small">No output yet.</p>}
    </section>
  );
}

function InputsView({ detail }: { detail: RunDetail }) {
  const entries = Object.entries(detail.inputs);
  if (entries.length === 0) return <p className="muted small">Defaults only.</p>;
  return (
    <>
      {entries.map(([name, value]) => {
        const file = fileFor(value, detail.files);
        return (
          <div className="output" key={name}>
            <div className="output-name mono">{name}</div>
            {file ? <FileView file={file} url={file.url} name={name} /> : <ValueView value={value} />}
          </div>
        );
      })}
    </>
  );
}
