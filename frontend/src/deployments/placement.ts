/**
 * A deployment's placement as its view tells it (the `placement` column of the studio's
 * `DeploymentDetailSerializer`, `studio.workflows.deployments.placing.DeploymentPlacement`):
 * which node runs each replica, the replicas that moved when a node was lost (from where to where
 * and why), and those that lost their node and fit no node left, with the reason. Empty (`{}`)
 * for a deployment the studio hosts itself.
 */
import type { DeploymentPlacement } from "../api/deployments";
import { byNode } from "../api/nodes";

/** One line of the "moved" list: `diffusion #1: node-b → node-a`. */
export interface MoveLine {
  key: string;
  replica: string;
  from: string;
  to: string;
  reason: string;
  at: string;
}

/** One replica (or a bundle placed together) that waits for a node, and why. */
export interface WaitingLine {
  key: string;
  replicas: string;
  reason: string;
}

export interface PlacementSummary {
  nodes: ReturnType<typeof byNode>;
  /** Newest first. */
  moves: MoveLine[];
  waiting: WaitingLine[];
}

/** "#1" for replica 0: the numbering the workers table uses. */
function replicaLabel(role: string, replica: number): string {
  return `${role} #${replica + 1}`;
}

/** What the deployment view shows of `placement`; null when the studio hosts the deployment itself. */
export function summarizePlacement(placement: Partial<DeploymentPlacement> | null | undefined): PlacementSummary | null {
  const slots = placement?.slots ?? [];
  const moved = placement?.moved ?? [];
  const unplaced = placement?.unplaced ?? [];
  if (slots.length === 0 && moved.length === 0 && unplaced.length === 0) return null;
  const moves = moved
    .map((m, index) => ({
      key: `${index}:${m.role}:${m.replica}`,
      replica: replicaLabel(m.role, m.replica),
      from: m.from ?? "no node",
      to: m.to,
      reason: m.reason,
      at: m.at,
    }))
    .reverse();
  const waiting = unplaced.map((r) => ({
    key: `${r.roles.join(",")}:${r.replicas.join(",")}`,
    replicas: r.roles.flatMap((role) => r.replicas.map((replica) => replicaLabel(role, replica))).join(", "),
    reason: r.message,
  }));
  return { nodes: byNode(slots), moves, waiting };
}
