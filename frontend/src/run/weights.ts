/** Which roles of a run's graph computed with random weights (the tiny seeded models, a diffusion role's seeded head). */
import type { GraphSpec } from "../api/types";

export interface RandomWeightsRole {
  role: string;
  /** The model the role names. */
  model: string;
  /** The nodes that ran on it, in the graph's order. */
  nodes: string[];
}

/** The roles the studio named (`RunDetail.random_weights_roles`), with their model and nodes, in the graph's order. */
export function randomWeightRoles(spec: GraphSpec, named: string[]): RandomWeightsRole[] {
  return spec.roles
    .filter((role) => named.includes(role.name))
    .map((role) => ({
      role: role.name,
      model: role.model ?? "",
      nodes: spec.nodes.filter((n) => n.role === role.name).map((n) => n.id),
    }));
}
