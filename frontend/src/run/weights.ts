/** Which roles of a run's graph ran a model with random weights (the tiny seeded models): their outputs are noise. */
import type { GraphSpec, ModelInfo } from "../api/types";

export interface RandomWeightsRole {
  role: string;
  model: string;
  /** The nodes that ran on it, in the graph's order. */
  nodes: string[];
}

/**
 * The roles of `spec` whose model the catalogue (`/api/models/`) marks as random weights for the
 * role's kind, with their nodes; a model the catalogue does not list is not claimed either way.
 */
export function randomWeightRoles(spec: GraphSpec, models: ModelInfo[]): RandomWeightsRole[] {
  return spec.roles.flatMap((role) => {
    const model = role.model ? models.find((m) => m.name === role.model && m.role_kinds.includes(role.kind)) : undefined;
    if (!model?.random_weights) return [];
    return [{ role: role.name, model: model.name, nodes: spec.nodes.filter((n) => n.role === role.name).map((n) => n.id) }];
  });
}
