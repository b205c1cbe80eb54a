"""Node kinds' declared params, as other layers read them."""

import pytest

from engine.compute.sampling import SamplingParams
from engine.spec.kinds import default_kinds


def test_the_llm_node_kind_declares_the_sampling_default_of_max_new_tokens():
    kinds = default_kinds()
    assert kinds.node_kind("llm").param_default("max_new_tokens") == SamplingParams().max_new_tokens


def test_a_param_without_a_declared_default_is_a_key_error_naming_kind_and_param():
    kinds = default_kinds()
    with pytest.raises(KeyError, match="'llm'.*'seed'"):
        kinds.node_kind("llm").param_default("seed")
    with pytest.raises(KeyError, match="'no_such_param'"):
        kinds.node_kind("llm").param_default("no_such_param")
