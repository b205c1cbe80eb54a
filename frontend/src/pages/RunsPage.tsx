/**
 * Every run of the user's workflows, newest first, with status and workflow filters. The list
 * updates itself (every second while a run is pending or running, every few seconds otherwise,
 * and not while the tab is hidden): a run started anywhere appears, a pending run shows its place
 * in the queue, and any unfinished run can be cancelled from its row.
 */
import { useCallback, useEffect, useState } from "react";
import { Link, useNavigate, useSearchParams } from "react-router-dom";
import { ApiError, describeError } from "../api/client";
import { runs, workflows } from "../api/studio";
import { type Page, RUN_STATUSES, type Run, type Workflow } from "../api/types";
import { ScrollTable } from "../components/ScrollTable";
import { useToast } from "../components/toast";
import { Button, EmptyState, ErrorBox, Spinner, StatusBadge, formatMs, Timestamp } from "../components/ui";
import { deploymentLabel } from "../run/target";

const POLL_ACTIVE_MS = 1000;
const POLL_IDLE_MS = 3000;

export function RunsPage() {
  const [params, setParams] = useSearchParams();
  const status = params.get("status") ?? "";
  const workflow = params.get("workflow") ?? "";
  const page = Number(params.get("page") ?? "1");
  const [data, setData] = useState<Page<Run> | null>(null);
  const [flows, setFlows] = useState<Workflow[]>([]);
  const [error, setError] = useState<string | null>(null);
  const navigate = useNavigate();
  const toast = useToast();
  const [cancelling, setCancelling] = useState<string | null>(null);

  const load = useCallback(async () => {
    try {
      setData(await runs.list({ status, workflow, page }));
      setError(null);
    } catch (err) {
      setError(describeError(err));
    }
  }, [status, workflow, page]);

  useEffect(() => {
    load();
  }, [load]);
  useEffect(() => {
    workflows.list().then((p) => setFlows(p.results)).catch(() => setFlows([]));
  }, []);
  const active = data?.results.some((r) => r.status === "pending" || r.status === "running");
  useEffect(() => {
    const t = window.setInterval(() => {
      if (document.visibilityState === "visible") load();
    }, active ? POLL_ACTIVE_MS : POLL_IDLE_MS);
    return () => window.clearInterval(t);
  }, [active, load]);

  const cancel = async (run: Run) => {
    setCancelling(run.id);
    try {
      await runs.cancel(run.id);
      toast(`Run ${run.id.slice(0, 8)} cancelled`, "success");
    } catch (err) {
      toast(err instanceof ApiError && err.status === 409 ? err.message : describeError(err), "error");
    } finally {
      setCancelling(null);
      load();
    }
  };

  const set = (key: string, value: string) => {
    const next = new URLSearchParams(params);
    if (value) next.set(key, value);
    else next.delete(key);
    if (key !== "page") next.delete("page");
    setParams(next);
  };

  // The Cancel column is drawn only while a listed run can be cancelled: at 1024 px its empty
  // cells would push the table past its card.
  const cancellable = data?.results.some((r) => r.status === "pending" || r.status === "running") ?? false;
  return (
    <div className="page">
      <header className="page-head">
        <div>
          <h1>Runs</h1>
          <p className="muted">Every execution, with its status and timing. Open one to watch it or see its outputs.</p>
        </div>
        <Button icon="refresh" onClick={load}>
          Refresh
        </Button>
      </header>
      <div className="toolbar">
        <label className="inline-field">
          Status
          <select value={status} onChange={(e) => set("status", e.target.value)} aria-label="Filter by status">
            <option value="">any</option>
            {RUN_STATUSES.map((s) => (
              <option key={s} value={s}>
                {s}
              </option>
            ))}
          </select>
        </label>
        <label className="inline-field">
          Workflow
          <select value={workflow} onChange={(e) => set("workflow", e.target.value)} aria-label="Filter by workflow">
            <option value="">any</option>
            {flows.map((w) => (
              <option key={w.id} value={w.id}>
                {w.name}
              </option>
            ))}
          </select>
        </label>
        {data && <span className="muted small">{data.count} run{data.count === 1 ? "" : "s"}</span>}
      </div>
      {error && <ErrorBox>{error}</ErrorBox>}
      {!data && !error && <Spinner label="Loading runs" />}
      {data && data.results.length === 0 && (
        <EmptyState icon="play" title={status || workflow ? "No run matches these filters" : "No runs yet"}>
          <Link to="/workflows">Open a workflow</Link> and press <strong>Run</strong>.
        </EmptyState>
      )}
      {data && data.results.length > 0 && (
        <ScrollTable testId="runs-card">
          <table className="table clickable" data-testid="runs-table">
            <thead>
              <tr>
                <th>Run</th>
                <th>Workflow</th>
                <th>Ran on</th>
                <th>Status</th>
                <th>Created</th>
                <th className="right">Duration</th>
                {cancellable && <th />}
              </tr>
            </thead>
            <tbody>
              {data.results.map((r) => (
                <tr key={r.id} onClick={() => navigate(`/runs/${r.id}`)} data-testid="run-row" data-status={r.status}>
                  <td>
                    <Link to={`/runs/${r.id}`} className="mono row-title" onClick={(e) => e.stopPropagation()}>
                      {r.id.slice(0, 8)}
                    </Link>
                  </td>
                  <td className="nowrap">
                    {r.workflow_name} <span className="pill">v{r.version}</span>
                  </td>
                  <td className="small" data-testid="run-deployment">
                    {r.deployment ? (
                      <Link to={`/deployments/${r.deployment}`} title={r.deployment} className="cell-clip"
                            onClick={(e) => e.stopPropagation()}>
                        {deploymentLabel(r)}
                      </Link>
                    ) : (
                      <span className="muted">studio engine</span>
                    )}
                  </td>
                  <td>
                    <StatusBadge status={r.status} />
                    {r.failed_node && <span className="muted small"> at {r.failed_node}</span>}
                    {r.queue_position !== null && r.queue_position !== undefined && (
                      <span className="muted small" data-testid="queue-position">
                        {" "}
                        #{r.queue_position} in the queue
                      </span>
                    )}
                  </td>
                  <td className="muted small nowrap"><Timestamp iso={r.created_at} /></td>
                  <td className="right mono small">{formatMs(r.duration_ms)}</td>
                  {cancellable && (
                  <td className="right">
                    {(r.status === "pending" || r.status === "running") && (
                      <Button
                        small
                        variant="danger"
                        icon="stop"
                        disabled={cancelling === r.id}
                        data-testid="cancel-row"
                        onClick={(e) => {
                          e.stopPropagation();
                          cancel(r);
                        }}
                      >
                        {cancelling === r.id ? "Cancelling…" : "Cancel"}
                      </Button>
                    )}
                  </td>
                  )}
                </tr>
              ))}
            </tbody>
          </table>
        </ScrollTable>
      )}
      {data && (data.next || data.previous) && (
        <div className="pager">
          <Button small disabled={!data.previous} onClick={() => set("page", String(page - 1))}>
            Previous
          </Button>
          <span className="muted small">page {page}</span>
          <Button small disabled={!data.next} onClick={() => set("page", String(page + 1))}>
            Next
          </Button>
        </div>
      )}
    </div>
  );
}
