"""The catalogue the editor's palette shows: node kinds (ports and parameter JSON
schemas), role kinds, the registered ops a python node may name, the models a role may name
(built-in ones, with whether their weights are real or random, for testing, and checkpoints under
the model roots), and the GraphSpec JSON Schema."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.client.models import Weights, model_catalogue
from engine.spec.graph import PORT_TYPES, json_schema
from engine.spec.kinds import KindRegistry
from studio.workflows.apps import engine
from studio.workflows.paths import list_checkpoints
from studio.workflows.weights import weights_by_kind

RANDOM_WEIGHTS = Weights.RANDOM.label
REAL_WEIGHTS = Weights.REAL.label
CHECKPOINT = "checkpoint"


class PortSerializer(serializers.Serializer):
    type = serializers.ChoiceField(choices=PORT_TYPES)
    optional = serializers.BooleanField()


class NodeKindSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    category = serializers.CharField()
    role_kinds = serializers.ListField(child=serializers.CharField(),
                                       help_text="role kinds that can host it; empty: the executor runs it")
    params_schema = serializers.JSONField(help_text="JSON Schema of the node's params")
    inputs = serializers.DictField(child=PortSerializer(), allow_null=True,
                                   help_text="fixed input ports; null: the node declares its own")
    outputs = serializers.DictField(child=PortSerializer(), allow_null=True)
    op = serializers.ChoiceField(choices=["required", "forbidden"])


class OpPortSerializer(PortSerializer):
    join = serializers.ChoiceField(choices=["all", "ordered", "dynamic"], required=False)


class OpSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="what a python node's `op` names")
    description = serializers.CharField(help_text="the first paragraph of the function's docstring")
    inputs = serializers.DictField(child=OpPortSerializer(), help_text="the node's input ports")
    outputs = serializers.DictField(child=OpPortSerializer(), help_text="the node's output ports")
    params_schema = serializers.JSONField(help_text="JSON Schema of the node's params")
    stream = serializers.BooleanField(help_text="a generator: the node streams (stream=True)")


class ModelSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="what a role's `model` names (a checkpoint: relative to its model root)")
    source = serializers.ChoiceField(choices=["builtin", "checkpoint"])
    random_weights = serializers.BooleanField(help_text="seeded random weights: it runs, but its output is noise")
    label = serializers.CharField(help_text=f"'{RANDOM_WEIGHTS}', '{REAL_WEIGHTS}' or '{CHECKPOINT}'")
    weights = serializers.ChoiceField(choices=["real", "random"],
                                      help_text="real: trained weights; random: drawn from a seed, for testing")
    weights_label = serializers.CharField(help_text=f"'{REAL_WEIGHTS}' or '{RANDOM_WEIGHTS}'")
    description = serializers.CharField()
    role_kinds = serializers.ListField(child=serializers.CharField(), help_text="the role kinds that can load it")
    weights_by_kind = serializers.DictField(
        child=serializers.ChoiceField(choices=["real", "random"]),
        help_text="per role kind in role_kinds, what a role of that kind naming it computes with: a model may be"
                  " real for one kind and seeded for another (an LLM's diffusion head); `weights` and"
                  " `random_weights` say it of the model itself")
    family = serializers.CharField(required=False, allow_null=True, help_text="a built-in LLM's family")
    layers = serializers.IntegerField(required=False, allow_null=True)
    hidden = serializers.IntegerField(required=False, allow_null=True)
    heads = serializers.IntegerField(required=False, allow_null=True)
    kv_heads = serializers.IntegerField(required=False, allow_null=True)


class ModelListSerializer(serializers.Serializer):
    models = ModelSerializer(many=True)
    checkpoints_truncated = serializers.BooleanField(help_text="the model roots hold more checkpoints than listed")


class RoleKindSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    params_schema = serializers.JSONField()
    tensor_parallel = serializers.BooleanField(help_text="whether a role of this kind may set tp_size > 1")
    model = serializers.ChoiceField(choices=["required", "optional", "none"],
                                    help_text="whether its roles name a model (optional: the kind has a default)")


class NodeKindsView(APIView):
    @extend_schema(summary="The node kinds of this installation", responses=NodeKindSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response([kind.to_dict() for kind in engine().kinds.node_kinds])


class RoleKindsView(APIView):
    @extend_schema(summary="The role kinds of this installation", responses=RoleKindSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response([
            {"name": k.name, "description": k.description, "params_schema": k.params_schema,
             "tensor_parallel": k.tensor_parallel is not None and k.tp_runner is not None,
             "model": "none" if k.models is None else "required" if k.models.required else "optional"}
            for k in engine().kinds.role_kinds
        ])


class OpsView(APIView):
    @extend_schema(summary="The registered ops a python node may name", responses=OpSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response([entry.info.to_dict() for entry in engine().ops.registry.ops])


def model_listing(kinds: KindRegistry, roots: tuple) -> dict:
    """The built-in models of every role kind (one entry per name, with every kind that knows it,
    and what the engine's catalogue says of it: weights, an LLM's shape, and the weights a role of
    each of those kinds computes with), then the checkpoints under `roots` with the kinds that
    load checkpoints."""
    catalogued = {row.name: row.to_dict() for row in model_catalogue()}
    builtin: dict[str, dict] = {}
    checkpoint_kinds = []
    for kind in kinds.role_kinds:
        if kind.models is None:
            continue
        if kind.models.checkpoints:
            checkpoint_kinds.append(kind.name)
        for model in kind.models.builtin_models():
            entry = builtin.setdefault(model.name, {
                **catalogued.get(model.name, {}),
                "name": model.name, "source": "builtin", "random_weights": model.random_weights,
                "label": RANDOM_WEIGHTS if model.random_weights else REAL_WEIGHTS,
                "weights": "random" if model.random_weights else "real",
                "weights_label": RANDOM_WEIGHTS if model.random_weights else REAL_WEIGHTS,
                "description": model.description, "role_kinds": []})
            entry["role_kinds"].append(kind.name)
    for name, entry in builtin.items():
        entry["weights_by_kind"] = weights_by_kind(name, entry["role_kinds"])
    found = list_checkpoints(roots)
    checkpoints = [{"name": name, "source": "checkpoint", "random_weights": False, "label": CHECKPOINT,
                    "weights": "real", "weights_label": REAL_WEIGHTS,
                    "description": "a checkpoint folder in the model directories", "role_kinds": checkpoint_kinds,
                    "weights_by_kind": weights_by_kind(name, checkpoint_kinds)}
                   for name in found.names]
    return {"models": [*builtin.values(), *checkpoints], "checkpoints_truncated": found.truncated}


class ModelsView(APIView):
    @extend_schema(summary="The models a role may name: built-in ones and checkpoints under the model roots",
                   responses=ModelListSerializer)
    def get(self, request: Request) -> Response:
        eng = engine()
        return Response(model_listing(eng.kinds, tuple(eng.config.model_dirs)))


class GraphSpecSchemaView(APIView):
    @extend_schema(summary="The GraphSpec JSON Schema", responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(json_schema())
