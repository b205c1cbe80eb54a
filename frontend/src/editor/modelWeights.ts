/**
 * What a model computes with for a role of a given kind. `/api/models/` lists each model once for
 * every role kind that may name it; its weights can differ per kind (smollm2-135m is real weights
 * for an llm role, while a diffusion role on it runs a seeded head), so the picker asks
 * `weights_by_kind` for the role's kind, and falls back to the model's own `random_weights` where
 * a studio does not say it per kind.
 */
import type { ModelInfo } from "../api/types";

export const RANDOM_WEIGHTS_LABEL = "random weights (for testing)";

export function randomFor(model: ModelInfo, roleKind: string): boolean {
  const perKind = model.weights_by_kind?.[roleKind];
  return perKind === undefined ? model.random_weights : perKind === "random";
}

/** How the picker shows `model` for a role of `roleKind`: its label, and random weights said so. */
export function labelFor(model: ModelInfo, roleKind: string): string {
  if (randomFor(model, roleKind)) return RANDOM_WEIGHTS_LABEL;
  return model.random_weights ? "real weights" : model.label;
}

/** Why a model with real weights is random for a role of `roleKind` (what that kind adds is seeded), or null. */
export function seededNote(model: ModelInfo, roleKind: string): string | null {
  if (!randomFor(model, roleKind) || model.random_weights) return null;
  return `(for a ${roleKind} role: the model's own weights are real, what this role adds to them is seeded)`;
}
