/**
 * Where deploying a version would put its replicas now, shown before the user confirms (the
 * deploy dialog): node by node with the roles and replicas it would run and the GPUs of the node
 * each replica would get, or every reason the
 * studio would refuse it (each role's needs and the best node's free resources). Asks again,
 * after a short pause, whenever the replica counts change. Nothing is reserved.
 */
import { useEffect, useState } from "react";
import { describeError } from "../api/client";
import { byNode, describeAmounts, describeReplicaGpus, nodes, type PlacementPreview as Preview } from "../api/nodes";
import { ErrorBox, Spinner } from "../components/ui";

const DEBOUNCE_MS = 300;

export function PlacementPreview({
  workflowId,
  version,
  replicas,
}: {
  workflowId: string;
  version: number | null;
  replicas: Record<string, number>;
}) {
  const [preview, setPreview] = useState<Preview | null | undefined>(undefined);
  const [error, setError] = useState<string | null>(null);
  const key = JSON.stringify(replicas);

  useEffect(() => {
    if (version === null) return;
    const abort = new AbortController();
    const timer = window.setTimeout(() => {
      nodes
        .placement({ workflow: workflowId, version, replicas: JSON.parse(key) }, abort.signal)
        .then((p) => {
          setPreview(p);
          setError(null);
        })
        .catch((err) => {
          if ((err as Error).name !== "AbortError") setError(describeError(err));
        });
    }, DEBOUNCE_MS);
    return () => {
      abort.abort();
      window.clearTimeout(timer);
    };
  }, [workflowId, version, key]);

  if (version === null) return null;
  if (error) return <ErrorBox>Placement: {error}</ErrorBox>;
  if (preview === undefined) return <Spinner label="Placing the replicas" />;
  if (preview === null || !preview.distributed) return null; // the studio runs the workers itself
  return (
    <div className="placement-preview" data-testid="placement-preview">
      <div className="section-title">Placement on the nodes</div>
      {preview.error ? (
        <div className="error-box" role="alert" data-testid="placement-refused">
          <div>
            <strong>This deployment would be refused.</strong>
            <ul>
              {preview.refusals.map((r) => (
                <li key={`${r.roles.join(",")}:${r.replicas.join(",")}`} data-testid="placement-refusal">
                  {r.message}
                </li>
              ))}
              {preview.refusals.length === 0 && <li>{preview.error}</li>}
            </ul>
          </div>
        </div>
      ) : (
        <table className="table compact" data-testid="placement-table">
          <thead>
            <tr>
              <th>Node</th>
              <th>Replicas</th>
            </tr>
          </thead>
          <tbody>
            {byNode(preview.placement).map(({ node, roles }) => (
              <tr key={node} data-testid="placement-node" data-node={node}>
                <td className="mono">{node}</td>
                <td>
                  {roles.map(({ role, replicas }) => {
                    const gpus = describeReplicaGpus(replicas);
                    return (
                      <span key={role} className="placement-role">
                        <span className="pill" data-role={role}>
                          {role} ×{replicas.length}
                        </span>
                        {gpus && (
                          <span className="muted small" data-testid="placement-gpus" data-for={role}>
                            {" "}
                            {gpus}
                          </span>
                        )}{" "}
                      </span>
                    );
                  })}
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      <p className="muted small">
        {preview.nodes.length} live node{preview.nodes.length === 1 ? "" : "s"}: {preview.nodes.join(", ") || "none"}.
        Placed again when you deploy{preview.refusals[0]?.best_free ? `; best node has ${describeAmounts(preview.refusals[0].best_free)} free` : ""}.
      </p>
    </div>
  );
}
