"""The catalogue the editor's palette shows: node kinds (ports and parameter JSON
schemas), role kinds, the registered ops a python node may name, and the GraphSpec JSON Schema."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.spec.graph import PORT_TYPES, json_schema
from studio.workflows.apps import engine


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


class RoleKindSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    params_schema = serializers.JSONField()
    tensor_parallel = serializers.BooleanField(help_text="whether a role of this kind may set tp_size > 1")


class NodeKindsView(APIView):
    @extend_schema(summary="The node kinds of this installation", responses=NodeKindSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response([kind.to_dict() for kind in engine().kinds.node_kinds])


class RoleKindsView(APIView):
    @extend_schema(summary="The role kinds of this installation", responses=RoleKindSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response([
            {"name": k.name, "description": k.description, "params_schema": k.params_schema,
             "tensor_parallel": k.tensor_parallel is not None and k.tp_runner is not None}
            for k in engine().kinds.role_kinds
        ])


class OpsView(APIView):
    @extend_schema(summary="The registered ops a python node may name", responses=OpSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response([entry.info.to_dict() for entry in engine().ops.registry.ops])


class GraphSpecSchemaView(APIView):
    @extend_schema(summary="The GraphSpec JSON Schema", responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(json_schema())
