/** A deployment's workers as they come up: role, replica (and rank), where, state. */
import { type DeploymentWorker, workerState } from "../api/deployments";
import { describeGpus } from "../api/nodes";
import { formatTime } from "../components/ui";

/**
 * `expected` (a live deployment's replica counts): replicas with no worker yet are listed too,
 * as `starting` rows, so the table fills in as they come up.
 */
export function WorkersTable({ workers, expected }: { workers: DeploymentWorker[]; expected?: Record<string, number> }) {
  const rows: (DeploymentWorker & { placeholder?: boolean })[] = [...workers];
  for (const [role, count] of Object.entries(expected ?? {})) {
    const taken = new Set(workers.filter((w) => w.role === role && w.rank === 0 && w.replica !== null).map((w) => w.replica));
    for (let replica = 0; replica < count; replica++) {
      if (taken.has(replica)) continue;
      rows.push({
        worker_id: `${role}#${replica}`, role, replica, rank: 0, host: "", address: "", device: "", gpus: [], pid: null,
        status: "starting", started_at: null, last_seen_at: null, live: null, placeholder: true,
      });
    }
  }
  const shown = rows.sort(
    (a, b) =>
      a.role.localeCompare(b.role) ||
      (a.replica ?? Number.MAX_SAFE_INTEGER) - (b.replica ?? Number.MAX_SAFE_INTEGER) ||
      a.rank - b.rank ||
      a.worker_id.localeCompare(b.worker_id),
  );
  const up = workers.filter((w) => w.rank === 0 && ["ready", "busy"].includes(workerState(w))).length;
  const wanted = expected ? Object.values(expected).reduce((a, b) => a + b, 0) : null;
  return (
    <section className="deployment-workers" data-testid="deployment-workers">
      <div className="section-title">
        Workers{" "}
        <span className="muted small" data-testid="workers-up">
          {wanted !== null ? `${up} of ${wanted} replicas up` : `${up} up`}
        </span>
      </div>
      {shown.length === 0 ? (
        <p className="muted small">None yet: they appear here as they start.</p>
      ) : (
        <table className="table compact">
          <thead>
            <tr>
              <th>Role</th>
              <th>Replica</th>
              <th>Where</th>
              <th>Device</th>
              <th>State</th>
              <th>Since</th>
            </tr>
          </thead>
          <tbody>
            {shown.map((w) => {
              const state = workerState(w);
              return (
                <tr
                  key={w.worker_id}
                  data-testid="deployment-worker"
                  data-role={w.role}
                  data-replica={w.replica ?? ""}
                  data-state={state}
                  data-placeholder={w.placeholder ? "yes" : undefined}
                  title={w.placeholder ? "not up yet" : w.worker_id}
                >
                  <td>{w.role}</td>
                  <td>
                    {w.replica === null ? "—" : `#${w.replica + 1}`}
                    {w.rank > 0 && <span className="muted"> · rank {w.rank}</span>}
                  </td>
                  <td className="mono small">
                    {w.host || "—"}
                    {w.pid ? <span className="muted"> · pid {w.pid}</span> : null}
                  </td>
                  <td data-testid="worker-device">
                    {w.device || "—"}
                    {w.gpus?.length ? <span className="muted"> · {describeGpus(w.gpus)}</span> : null}
                  </td>
                  <td>
                    <span className={`badge status-${state}`}>
                      <span className="dot" />
                      {state}
                    </span>
                  </td>
                  <td className="muted small">{formatTime(w.started_at)}</td>
                </tr>
              );
            })}
          </tbody>
        </table>
      )}
    </section>
  );
}
