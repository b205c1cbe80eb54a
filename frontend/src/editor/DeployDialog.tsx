/** Deploy a saved version onto role workers (when this studio has the deployment API). */
import { useCallback, useEffect, useState } from "react";
import { Link } from "react-router-dom";
import { cacheScopeLabel, cluster, type Deployment } from "../api/cluster";
import { describeError } from "../api/client";
import { ACTIVE_STATUSES } from "../api/deployments";
import type { RoleSpec } from "../api/types";
import { useToast } from "../components/toast";
import { Button, EmptyState, ErrorBox, Modal, Spinner, StatusBadge, Timestamp } from "../components/ui";
import { EndpointPanel } from "../deployments/EndpointPanel";
import { useDeployment } from "../deployments/useDeployment";
import { WorkersTable } from "../deployments/WorkersTable";
import { PlacementPreview } from "../nodes/PlacementPreview";

export function DeployDialog({
  workflowId,
  workflowName,
  version,
  chat,
  roles,
  dirty,
  onClose,
}: {
  workflowId: string;
  /** The default name of a new deployment (numbered past your live ones by the studio). */
  workflowName: string;
  version: number | null;
  /** Whether the version is a chat workflow: its deployment's name is then an OpenAI model name. */
  chat: boolean;
  roles: RoleSpec[];
  dirty: boolean;
  onClose: () => void;
}) {
  const [name, setName] = useState("");
  /** The deployment whose endpoint and workers the dialog shows: the one just made, else the newest live one. */
  const [focused, setFocused] = useState<string | null>(null);
  const [deployments, setDeployments] = useState<Deployment[] | null | undefined>(undefined);
  const [replicas, setReplicas] = useState<Record<string, number>>(() =>
    Object.fromEntries(roles.map((r) => [r.name, r.replicas ?? 1])),
  );
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const toast = useToast();

  /** What an unnamed deployment would be called now: the studio's own answer (only your live deployments count). */
  const [defaultName, setDefaultName] = useState(workflowName);
  const load = useCallback(
    () =>
      Promise.all([cluster.deployments(workflowId), cluster.proposedName(workflowId)])
        .then(([mine, proposed]) => {
          setDeployments(mine);
          if (proposed) setDefaultName(proposed.name);
        })
        .catch((err) => {
          setError(describeError(err));
          setDeployments(null);
        }),
    [workflowId],
  );
  useEffect(() => {
    load();
  }, [load]);
  // Follow deployments that are still changing state.
  const settling = deployments?.some((d) => ["pending", "starting", "stopping"].includes(d.status)) ?? false;
  useEffect(() => {
    if (!settling) return;
    const timer = window.setInterval(load, 1000);
    return () => window.clearInterval(timer);
  }, [settling, load]);

  const deploy = async () => {
    if (version === null) return;
    setBusy(true);
    setError(null);
    try {
      const d = await cluster.deploy({ workflow: workflowId, version, replicas, ...(name.trim() ? { name: name.trim() } : {}) });
      toast(`Deploying v${version} as “${d.name}” (${d.status})`, "success");
      setFocused(d.id);
      setName("");
      load();
    } catch (err) {
      setError(describeError(err));
    } finally {
      setBusy(false);
    }
  };

  const shownId = focused ?? deployments?.find((d) => ACTIVE_STATUSES.includes(d.status))?.id ?? null;
  /** A live deployment of this very version: deploying again starts a second one beside it. */
  const liveTwin = deployments?.find((d) => d.version === version && ACTIVE_STATUSES.includes(d.status)) ?? null;

  return (
    <Modal
      title="Deploy"
      wide
      onClose={onClose}
      testId="deploy-dialog"
      footer={
        deployments ? (
          <>
            <Button onClick={onClose}>Close</Button>
            <Button
              variant="primary"
              icon="rocket"
              onClick={deploy}
              disabled={busy || version === null}
              data-testid="deploy-submit"
            >
              Deploy v{version}
              {liveTwin ? " again" : ""}
            </Button>
          </>
        ) : (
          <Button onClick={onClose}>Close</Button>
        )
      }
    >
      {deployments === undefined && <Spinner label="Asking the studio for deployments" />}
      {deployments === null && (
        <EmptyState icon="rocket" title="Deployments are not available on this studio yet" testId="deploy-unavailable">
          <p>
            This studio has no deployment API (<code>/api/deployments/</code> answered 404). Runs execute in the
            studio's own engine without one: use <strong>Run</strong> to submit this workflow.
          </p>
          <p className="muted small">
            When the API is there, this dialog deploys a saved version onto role workers with a replica count per
            role, and the <Link to="/cluster">Cluster</Link> page shows the workers.
          </p>
        </EmptyState>
      )}
      {deployments && (
        <div className="stack">
          {error && <ErrorBox>{error}</ErrorBox>}
          {version === null && <ErrorBox>Save a version first: deployments run saved versions.</ErrorBox>}
          {dirty && version !== null && (
            <div className="info-box">You have unsaved edits; this deploys the saved version v{version}.</div>
          )}
          <table className="table compact">
            <thead>
              <tr>
                <th>Role</th>
                <th>Kind</th>
                <th>Device</th>
                <th>Replicas</th>
              </tr>
            </thead>
            <tbody>
              {roles.map((r) => (
                <tr key={r.name}>
                  <td>{r.name}</td>
                  <td>{r.kind}</td>
                  <td>{r.device ?? "cpu"}</td>
                  <td>
                    <input
                      type="number"
                      min={1}
                      max={1024}
                      className="narrow"
                      value={replicas[r.name] ?? 1}
                      onChange={(e) => setReplicas({ ...replicas, [r.name]: Math.max(1, parseInt(e.target.value, 10) || 1) })}
                    />
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
          <label className="field">
            <span className="field-label">Name</span>
            <input
              value={name}
              onChange={(e) => setName(e.target.value)}
              placeholder={defaultName}
              maxLength={100}
              data-testid="deploy-name"
            />
            <span className="field-hint" data-testid="deploy-name-hint">
              {chat ? (
                <>
                  The OpenAI model this chat workflow answers as (<code>model="{name.trim() || defaultName}"</code>);
                  unique among your live deployments
                </>
              ) : (
                "Unique among your live deployments"
              )}
              {!name.trim() && defaultName !== workflowName && ` (“${workflowName}” is taken: left empty, it is numbered)`}.
            </span>
            {liveTwin && (
              <span className="field-hint warn-text" data-testid="deploy-again-hint">
                v{version} is deployed already as “{liveTwin.name}” ({liveTwin.status}): deploying again starts a second
                deployment beside it. To use the one running, close this dialog and run on it.
              </span>
            )}
          </label>
          <PlacementPreview workflowId={workflowId} version={version} replicas={replicas} />
          <div className="section-title">Deployments of this workflow</div>
          {deployments.length === 0 && <p className="muted small">None yet.</p>}
          {deployments.map((d) => (
            <div
              key={d.id}
              className={`deployment-row${d.id === shownId ? " focused" : ""}`}
              data-testid="deployment-row"
              data-status={d.status}
              data-name={d.name}
            >
              <button type="button" className="link-btn deployment-name" onClick={() => setFocused(d.id)} title="Show its endpoint and workers">
                {d.name}
              </button>
              <span className="pill">v{d.version}</span>
              <StatusBadge status={d.status} />
              <span className="muted small"><Timestamp iso={d.created_at} /></span>
              {cacheScopeLabel(d) && (
                <span className="pill" data-testid="deployment-cache-shared" title="set by staff: every user's runs of it share its KV cache">
                  {cacheScopeLabel(d)}
                </span>
              )}
              {d.error && <span className="danger-text small">{d.error}</span>}
              <Link to={`/deployments/${d.id}`} className="small" data-testid="deployment-open">
                Open
              </Link>
              {(d.status === "running" || d.status === "starting") && (
                <Button
                  small
                  variant="ghost"
                  icon="stop"
                  onClick={() => cluster.stop(d.id).then(load)}
                  data-testid="deployment-stop"
                >
                  Stop
                </Button>
              )}
            </div>
          ))}
          {shownId && <FocusedDeployment id={shownId} />}
        </div>
      )}
    </Modal>
  );
}

/** The endpoint and the live workers of one deployment, inside the dialog. */
function FocusedDeployment({ id }: { id: string }) {
  const { deployment, error } = useDeployment(id);
  if (error) return <ErrorBox>{error}</ErrorBox>;
  if (!deployment) return <Spinner label="Loading the deployment" />;
  return (
    <div className="focused-deployment" data-testid="focused-deployment" data-name={deployment.name}>
      <EndpointPanel deployment={deployment} />
      <WorkersTable workers={deployment.workers} expected={ACTIVE_STATUSES.includes(deployment.status) ? deployment.replicas : undefined} />
    </div>
  );
}
