"""What the studio's web process imports to route runs and launch workers must not load torch or
transformers.

The web process (and `manage.py migrate`, `setup_demo`, every Celery beat) imports the client's
model catalogue, the flow executor and `KVRef`; torch and transformers cost seconds of every such
start on a loaded 2-core machine, and only a process that computes (a role worker) needs them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


def test_the_lazy_kv_package_still_names_every_export() -> None:
    import engine.data.kv as kv

    for name in kv.__all__:
        assert getattr(kv, name) is not None, name
    with pytest.raises(AttributeError, match="no_such_name"):
        kv.__getattr__("no_such_name")
