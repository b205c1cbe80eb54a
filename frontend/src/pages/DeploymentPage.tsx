/** One deployment: its name and OpenAI endpoint with snippets to paste, and its workers, live. */
import { Link, useParams } from "react-router-dom";
import { cacheScopeLabel, cluster } from "../api/cluster";
import { describeError } from "../api/client";
import { ACTIVE_STATUSES } from "../api/deployments";
import { useToast } from "../components/toast";
import { Button, ErrorBox, LoadError, Spinner, StatusBadge, formatTime } from "../components/ui";
import { EndpointPanel } from "../deployments/EndpointPanel";
import { PlacementPanel } from "../deployments/PlacementPanel";
import { summarizePlacement } from "../deployments/placement";
import { useDeployment } from "../deployments/useDeployment";
import { WorkersTable } from "../deployments/WorkersTable";

export function DeploymentPage() {
  const { id } = useParams<{ id: string }>();
  const { deployment, error, status, reload } = useDeployment(id ?? null);
  const toast = useToast();
  const back = (
    <Link className="btn btn-secondary" to="/deployments">
      All deployments
    </Link>
  );
  if (!deployment) {
    return <div className="page">{error ? <LoadError error={{ message: error, status }} what="deployment" back={back} /> : <Spinner label="Loading the deployment" />}</div>;
  }
  return (
    <div className="page" data-testid="deployment-page">
      <header className="page-head">
        <div>
          <div className="eyebrow">deployment</div>
          <h1 data-testid="deployment-name">{deployment.name}</h1>
          <p className="muted">
            <Link to={`/workflows/${deployment.workflow}`}>{deployment.workflow_name}</Link> <span className="pill">v{deployment.version}</span>{" "}
            <StatusBadge status={deployment.status} /> <span className="small">created {formatTime(deployment.created_at)}</span>
            {cacheScopeLabel(deployment) && <span className="pill">{cacheScopeLabel(deployment)}</span>}
          </p>
        </div>
        {ACTIVE_STATUSES.includes(deployment.status) && deployment.status !== "stopping" && (
          <Button
            icon="stop"
            onClick={() =>
              cluster
                .stop(deployment.id)
                .then(reload)
                .catch((err) => toast(describeError(err), "error"))
            }
            data-testid="deployment-stop"
          >
            Stop
          </Button>
        )}
      </header>
      {deployment.error && <ErrorBox>{deployment.error}</ErrorBox>}
      <div className="stack">
        <div className="card deployment-card">
          <EndpointPanel deployment={deployment} />
        </div>
        {summarizePlacement(deployment.placement) !== null && (
          <div className="card deployment-card">
            <PlacementPanel placement={deployment.placement} />
          </div>
        )}
        <div className="card deployment-card">
          <WorkersTable workers={deployment.workers} expected={ACTIVE_STATUSES.includes(deployment.status) ? deployment.replicas : undefined} />
        </div>
      </div>
    </div>
  );
}
