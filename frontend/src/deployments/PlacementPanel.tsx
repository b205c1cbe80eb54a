/**
 * Where a distributed deployment's replicas run: node by node, the replicas that moved when a
 * node was lost (from where to where, why and when) and those waiting for a node, with the
 * reason none can take them. Nothing for a deployment the studio hosts itself.
 */
import type { DeploymentPlacement } from "../api/deployments";
import { describeGpus } from "../api/nodes";
import { formatTime } from "../components/ui";
import { summarizePlacement } from "./placement";

export function PlacementPanel({ placement }: { placement: Partial<DeploymentPlacement> | null | undefined }) {
  const summary = summarizePlacement(placement);
  if (summary === null) return null;
  return (
    <section className="deployment-placement" data-testid="deployment-placement">
      <div className="section-title">Placement</div>
      {summary.nodes.length > 0 && (
        <table className="table compact" data-testid="deployment-placement-nodes">
          <thead>
            <tr>
              <th>Node</th>
              <th>Replicas</th>
            </tr>
          </thead>
          <tbody>
            {summary.nodes.map(({ node, roles }) => (
              <tr key={node} data-testid="deployment-placement-node" data-node={node}>
                <td className="mono">{node}</td>
                <td>
                  {roles.map(({ role, replicas }) => (
                    <span key={role} className="pill" data-role={role}>
                      {role} {replicas.map((r) => (r.gpus.length ? `#${r.replica + 1} (${describeGpus(r.gpus)})` : `#${r.replica + 1}`)).join(", ")}
                    </span>
                  ))}
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      {summary.waiting.length > 0 && (
        <div className="error-box" role="alert" data-testid="deployment-unplaced">
          <div>
            <strong>Waiting for a node</strong> (tried again as nodes come back or free room):
            <ul>
              {summary.waiting.map((w) => (
                <li key={w.key} data-testid="deployment-unplaced-replica">
                  <strong>{w.replicas}</strong>: {w.reason}
                </li>
              ))}
            </ul>
          </div>
        </div>
      )}
      {summary.moves.length > 0 && (
        <>
          <div className="section-title small">Moved</div>
          <ul className="deployment-moves small" data-testid="deployment-moves">
            {summary.moves.map((m) => (
              <li key={m.key} data-testid="deployment-move">
                <strong>{m.replica}</strong>: <span className="mono">{m.from}</span> → <span className="mono">{m.to}</span>
                {m.reason && <span className="muted"> ({m.reason})</span>}
                {m.at && <span className="muted"> · {formatTime(m.at)}</span>}
              </li>
            ))}
          </ul>
        </>
      )}
    </section>
  );
}
