/** A deployment's workers as they come up: role, replica (and rank), worker id, where, state (and why one failed). */
import { type DeploymentWorker, failureReason, workerRows, workerState } from "../api/deployments";
import { describeGpus } from "../api/nodes";
import { Timestamp } from "../components/ui";
import { WorkerId } from "../components/WorkerId";

/**
 * `expected` (a live deployment's replica counts): replicas with no worker row yet are listed too,
 * as `starting` placeholders, until each worker's own row (`starting` from the moment its process
 * is spawned, then `ready`, or `failed` with its reason) takes its place.
 */
export function WorkersTable({ workers, expected }: { workers: DeploymentWorker[]; expected?: Record<string, number> }) {
  const shown = workerRows(workers, expected);
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
              <th>Worker</th>
              <th>Where</th>
              <th>Device</th>
              <th>State</th>
              <th>Started</th>
            </tr>
          </thead>
          <tbody>
            {shown.map((w) => {
              const state = workerState(w);
              const reason = failureReason(w);
              return (
                <tr
                  key={w.worker_id}
                  data-testid="deployment-worker"
                  data-role={w.role}
                  data-replica={w.replica ?? ""}
                  data-state={state}
                  data-worker={w.placeholder ? undefined : w.worker_id}
                  data-placeholder={w.placeholder ? "yes" : undefined}
                  title={w.placeholder ? "not up yet" : undefined}
                >
                  <td>{w.role}</td>
                  <td>
                    {w.replica === null ? "—" : `#${w.replica + 1}`}
                    {w.rank > 0 && <span className="muted"> · rank {w.rank}</span>}
                  </td>
                  <td className="small nowrap">{w.placeholder ? <span className="muted">—</span> : <WorkerId id={w.worker_id} />}</td>
                  <td className="mono small nowrap">
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
                    {reason && (
                      <div className="danger-text small worker-error" data-testid="worker-error" title={w.error}>
                        {reason}
                      </div>
                    )}
                  </td>
                  <td className="muted small nowrap"><Timestamp iso={w.started_at} /></td>
                </tr>
              );
            })}
          </tbody>
        </table>
      )}
    </section>
  );
}
