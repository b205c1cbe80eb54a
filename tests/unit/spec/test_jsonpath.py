"""Paths naming a place in a user's JSON: plain keys dotted, any other key JSON-quoted in brackets."""
from __future__ import annotations

from engine.spec.jsonpath import element, json_path, member


def test_plain_names_are_dotted_and_indexes_bracketed() -> None:
    assert member("$", "a") == "$.a" and member("", "a") == ".a" and member(None, "a") == "a"
    assert element("$", 3) == "$[3]" and element(None, 0) == "[0]"
    assert json_path(["nodes", 2, "params", "max_new_tokens"]) == "$.nodes[2].params.max_new_tokens"
    assert json_path([], root="params") == "params" and json_path(["x", 0], root="params") == "params.x[0]"


def test_keys_that_are_not_plain_names_are_quoted_so_no_two_places_share_a_path() -> None:
    assert member("$", "a.b") == '$["a.b"]' and member("$", 'q"[0]') == '$["q\\"[0]"]'
    assert member(None, "") == '[""]' and member("$", "x y") == '$["x y"]' and member("$", "1st") == '$["1st"]'
    assert member("$", "é") == '$["é"]'
    assert json_path(["a.b", 1]) != json_path(["a", "b", 1])
    assert json_path(["a.b", 1]) == '$["a.b"][1]' and json_path(["a", "b", 1]) == "$.a.b[1]"
