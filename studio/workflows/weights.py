"""What a workflow's roles compute with: trained weights, or seeded random ones (for testing).

`/v1/models` says it of a chat deployment, and the run view of the roles and nodes of a run: a
role on a tiny built-in model, or a diffusion role (its seeded head, whatever its LLM), makes
noise. The engine's catalogue decides (`engine.client.models.role_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.client.models import Weights, role_weights


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """`weights` "real" when every role with a model has real weights, else "random" (for
    testing), with those roles named."""

    weights: Weights
    random_roles: tuple[str, ...]

    def fields(self) -> dict[str, Any]:
        return {"weights": str(self.weights), "weights_label": self.weights.label,
                "random_weights_roles": list(self.random_roles)}


def weights_by_kind(model: str, kinds: list[str]) -> dict[str, str]:
    """What a role of each of `kinds` naming `model` computes with ("real" or "random"): a model
    listed once for several role kinds may be real for one and seeded for another (smollm2-135m
    is real weights for an llm role, a seeded head for a diffusion one)."""
    found = {kind: role_weights(kind, model) for kind in kinds}
    return {kind: str(weights) for kind, weights in found.items() if weights is not None}


def model_weights(spec: dict[str, Any]) -> ModelWeights:
    """What the roles of `spec` (a GraphSpec document) compute with."""
    random = tuple(r["name"] for r in spec.get("roles", [])
                   if role_weights(r.get("kind", ""), r.get("model")) is Weights.RANDOM)
    return ModelWeights(Weights.RANDOM if random else Weights.REAL, random)
