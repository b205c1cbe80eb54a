"""Node kinds' declared params, as other layers read them."""

import pytest

from engine.compute.sampling import SamplingParams
from engine.spec.graph import PortSpec
from engine.spec.kinds import InputChoice, KindRegistry, NodeKind, RoleKind, default_kinds


def test_the_llm_node_kind_declares_the_sampling_default_of_max_new_tokens():
    kinds = default_kinds()
    assert kinds.node_kind("llm").param_default("max_new_tokens") == SamplingParams().max_new_tokens


def test_a_param_without_a_declared_default_is_a_key_error_naming_kind_and_param():
    kinds = default_kinds()
    with pytest.raises(KeyError, match="'llm'.*'seed'"):
        kinds.node_kind("llm").param_default("seed")
    with pytest.raises(KeyError, match="'no_such_param'"):
        kinds.node_kind("llm").param_default("no_such_param")


@pytest.mark.parametrize("ports", [("prompt", "text"), ("prompt", "nope"), ()])
def test_a_choice_of_inputs_names_only_optional_ports_of_its_kind(ports):
    """A required port is checked on its own (`dangling_port`); a port the kind lacks can never be
    wired, so a node of the kind could never be valid."""
    registry = KindRegistry()
    registry.add_role_kind(RoleKind(name="r", description="", runner="x:Y"))
    inputs = {"prompt": PortSpec(type="text", optional=True), "text": PortSpec(type="text")}
    with pytest.raises(ValueError, match="only optional input ports"):
        registry.add_node_kind(NodeKind(name="gen", description="", role_kinds=("r",), inputs=inputs,
                                        needs=(InputChoice(ports=ports, what="a prompt"),)))
    registry.add_node_kind(NodeKind(name="ok", description="", role_kinds=("r",), inputs=inputs,
                                    needs=(InputChoice(ports=("prompt",), what="a prompt"),)))
    assert registry.node_kind("ok").to_dict()["needs"] == [{"ports": ["prompt"], "what": "a prompt"}]
