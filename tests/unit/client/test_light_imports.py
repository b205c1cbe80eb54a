"""What the studio's web process imports to route runs and launch workers must not load torch or
transformers.

The web process (and `manage.py migrate`, `setup_demo`, every Celery beat) imports the client's
model catalogue, the flow executor and `KVRef`; torch and transformers cost seconds of every such
start on a loaded 2-core machine, and only a process that computes (a role worker) needs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

LIGHT = [
    "engine.client.models",
    "engine.client.workers",
    "engine.client.plane",
    "engine.data.kv",
    "engine.data.kv.ref",
    "engine.data.kv.index",
    "engine.flow.executor",
    "engine.flow.kvroute",
]


@pytest.mark.parametrize("module", LIGHT)
def test_importing_a_routing_module_loads_neither_torch_nor_transformers(module: str) -> None:
    probe = (
        f"import json, sys; import {module}; "
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_studio_web_process_and_its_celery_tasks_load_neither() -> None:
    """What daphne, `manage.py` and a Celery node agent import at start: settings, URLs, the ASGI
    application and the tasks (the engine's launcher among them)."""
    probe = (
        "import json, os, sys; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'studio.settings'); "
        "import django; django.setup(); import studio.asgi, studio.urls, studio.celery, studio.workflows.tasks; "
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_model_catalogue_and_validating_every_example_load_none_of_them() -> None:
    """What the studio does when the first editor opens: list the models (`/api/models/`) and
    validate the workflow, its roles' models checked against every kind's built-in ones. Importing
    torch, transformers and diffusers for it kept the first editor waiting seconds (issue #20)."""
    probe = (
        "import json, sys, pathlib, django; django.setup(); from engine.flow.loader import load_workflow; "
        "from engine.flow.validate import check_spec; from engine.spec.kinds import default_kinds; "
        "from studio.workflows.api.catalogue import model_listing; kinds = default_kinds(); "
        "listed = model_listing(kinds, ()); "
        "issues = [i for p in sorted(pathlib.Path('workflows').glob('[!_]*.py'))"
        " for i in check_spec(load_workflow(p), kinds, checkpoints=lambda name: False)]; "
        "print(json.dumps([len(listed['models']), [i.code for i in issues],"
        " sorted(m for m in ('torch', 'transformers', 'diffusers') if m in sys.modules)]))"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "studio.settings"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
                         cwd=ROOT, env=env)
    models, codes, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert models >= 7 and codes == [] and loaded == []


def test_the_lazy_kv_package_still_names_every_export() -> None:
    import engine.data.kv as kv

    for name in kv.__all__:
        assert getattr(kv, name) is not None, name
    with pytest.raises(AttributeError, match="no_such_name"):
        kv.__getattr__("no_such_name")
