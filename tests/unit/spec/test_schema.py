from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from engine.flow.loader import load_workflow
from engine.spec.graph import SCHEMA_PATH, encode_spec, render_json_schema


def test_committed_schema_matches_the_types():
    assert SCHEMA_PATH.read_text() == render_json_schema(), (
        "graphspec.schema.json is stale: regenerate it with "
        "python -c 'from engine.spec.graph import *; SCHEMA_PATH.write_text(render_json_schema())'"
    )


def test_examples_validate_against_the_schema_file():
    schema = json.loads(SCHEMA_PATH.read_text())
    doc = json.loads(encode_spec(load_workflow(Path(__file__).parents[3] / "workflows" / "diamond.py")))
    jsonschema.Draft202012Validator(schema).validate(doc)
