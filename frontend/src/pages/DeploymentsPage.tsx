/** The user's deployments, live ones first: each by name, with its workflow, version and status, a row a line. */
import { useCallback, useEffect, useState } from "react";
import { Link, useNavigate } from "react-router-dom";
import { cluster, type Deployment } from "../api/cluster";
import { describeError } from "../api/client";
import { ACTIVE_STATUSES } from "../api/deployments";
import { ScrollTable } from "../components/ScrollTable";
import { EmptyState, ErrorBox, Spinner, StatusBadge, Timestamp } from "../components/ui";

type Row = Deployment & { workflow_name?: string; chat?: boolean };

export function DeploymentsPage() {
  const [rows, setRows] = useState<Row[] | null>(null);
  const [error, setError] = useState<string | null>(null);
  const navigate = useNavigate();
  const load = useCallback(
    () =>
      cluster
        .deployments()
        .then((d) => {
          setRows((d ?? []) as Row[]);
          setError(null);
        })
        .catch((err) => setError(describeError(err))),
    [],
  );
  useEffect(() => {
    load();
  }, [load]);
  const settling = rows?.some((d) => ["pending", "starting", "stopping"].includes(d.status)) ?? false;
  useEffect(() => {
    if (!settling) return;
    const timer = window.setInterval(load, 1000);
    return () => window.clearInterval(timer);
  }, [settling, load]);
  const sorted = rows && [...rows].sort((a, b) => Number(!ACTIVE_STATUSES.includes(a.status)) - Number(!ACTIVE_STATUSES.includes(b.status)));
  return (
    <div className="page" data-testid="deployments-page">
      <header className="page-head">
        <div>
          <h1>Deployments</h1>
          <p className="muted">
            Saved versions running on role workers. A chat deployment is an OpenAI model named after it: open one for
            its endpoint and snippets.
          </p>
        </div>
      </header>
      {error && <ErrorBox>{error}</ErrorBox>}
      {!sorted && !error && <Spinner label="Loading deployments" />}
      {sorted && sorted.length === 0 && (
        <EmptyState icon="rocket" title="No deployments yet">
          Open a workflow and press <strong>Deploy</strong>.
        </EmptyState>
      )}
      {sorted && sorted.length > 0 && (
        <ScrollTable testId="deployments-card">
          <table className="table clickable deployments-table" data-testid="deployments-table">
            <thead>
              <tr>
                <th className="name-col">Name</th>
                <th className="workflow-col">Workflow</th>
                <th>Status</th>
                <th className="serves-col">Serves</th>
                <th>Created</th>
              </tr>
            </thead>
            <tbody>
              {sorted.map((d) => (
                // The whole row opens the deployment, as a run's row opens the run.
                <tr
                  key={d.id}
                  onClick={() => navigate(`/deployments/${d.id}`)}
                  data-testid="deployment-list-row"
                  data-status={d.status}
                >
                  <td className="clip-cell">
                    <Link to={`/deployments/${d.id}`} className="row-title clip" title={d.name} onClick={(e) => e.stopPropagation()}>
                      {d.name}
                    </Link>
                  </td>
                  <td className="clip-cell">
                    <span className="cell-line">
                      {d.workflow ? (
                        <Link
                          to={`/workflows/${d.workflow}`}
                          className="clip"
                          title={d.workflow_name}
                          onClick={(e) => e.stopPropagation()}
                        >
                          {d.workflow_name ?? "workflow"}
                        </Link>
                      ) : (
                        "—"
                      )}{" "}
                      <span className="pill">v{d.version}</span>
                    </span>
                  </td>
                  <td>
                    <StatusBadge status={d.status} />
                  </td>
                  <td className="small clip-cell" data-testid="deployment-serves">
                    {d.chat ? (
                      // What a client names on /v1: the label whole, the name cut short (whole in its title).
                      <span className="cell-line">
                        <span className="muted">OpenAI model</span>{" "}
                        <code className="clip" title={d.name}>
                          {d.name}
                        </code>
                      </span>
                    ) : (
                      <span className="muted">runs</span>
                    )}
                  </td>
                  <td className="muted small nowrap"><Timestamp iso={d.created_at} /></td>
                </tr>
              ))}
            </tbody>
          </table>
        </ScrollTable>
      )}
    </div>
  );
}
