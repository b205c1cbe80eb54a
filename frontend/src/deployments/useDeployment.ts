/** A deployment's detail, read again every second while it has (or may get) workers. */
import { useCallback, useEffect, useState } from "react";
import { describeError } from "../api/client";
import { ACTIVE_STATUSES, type DeploymentDetail, deployments } from "../api/deployments";

export const REFRESH_MS = 1000;

export function useDeployment(id: string | null): {
  deployment: DeploymentDetail | null;
  error: string | null;
  status?: number;
  reload: () => void;
} {
  const [deployment, setDeployment] = useState<DeploymentDetail | null>(null);
  const [error, setError] = useState<{ message: string; status?: number } | null>(null);
  const load = useCallback(() => {
    if (!id) return;
    deployments
      .get(id)
      .then((d) => {
        setDeployment(d);
        setError(null);
      })
      .catch((err) => setError({ message: describeError(err), status: (err as { status?: number }).status }));
  }, [id]);
  useEffect(() => {
    setDeployment(null);
    load();
  }, [load]);
  const live = deployment !== null && ACTIVE_STATUSES.includes(deployment.status);
  useEffect(() => {
    if (!live) return;
    const timer = window.setInterval(load, REFRESH_MS);
    return () => window.clearInterval(timer);
  }, [live, load]);
  return { deployment: deployment?.id === id ? deployment : null, error: error?.message ?? null, status: error?.status, reload: load };
}
