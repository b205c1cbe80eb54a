"""Previews of port values are JSON a database stores: floats JSON has no number for included."""

from __future__ import annotations

import json
import math

import msgspec

from engine.flow.events import finite_json, preview


def test_floats_that_are_not_finite_show_as_such_at_any_depth() -> None:
    value = {"a": math.inf, "b": [1.5, -math.inf, {"c": math.nan}], "d": (2.0, math.inf)}
    shown = {"a": {"float": "inf"}, "b": [1.5, {"float": "-inf"}, {"c": {"float": "nan"}}],
             "d": [2.0, {"float": "inf"}]}
    assert finite_json(value) == shown and preview(value) == shown
    assert preview(math.inf) == {"float": "inf"} and preview(math.nan) == {"float": "nan"}
    json.dumps(preview(value), allow_nan=False)  # what PostgreSQL's jsonb takes


def test_a_struct_holding_one_is_previewed_without_turning_it_into_null() -> None:
    class Reading(msgspec.Struct):
        value: float
        values: list[float]

    assert preview(Reading(math.inf, [1.0, -math.inf])) == {"value": {"float": "inf"},
                                                             "values": [1.0, {"float": "-inf"}]}


def test_values_holding_none_come_back_as_they_are() -> None:
    value = {"a": [1.5, 2], "b": "text", "c": (1.0,)}
    assert finite_json(value) is value
