"""Fixtures of the studio tests.

Django is configured here when pytest-django was not told a settings module (until
`DJANGO_SETTINGS_MODULE = "studio.settings"` is in pyproject). Tests read DATABASE_URL
(PostgreSQL when set, else SQLite) and REDIS_URL (channels-redis layer when set).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_DATA_DIR = None
if "OMNIFLOW_DATA_DIR" not in os.environ and "DJANGO_SETTINGS_MODULE" not in os.environ:
    _DATA_DIR = tempfile.mkdtemp(prefix="omniflow-studio-test-")
    os.environ["OMNIFLOW_DATA_DIR"] = _DATA_DIR
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "studio.settings")

import django  # noqa: E402
from channels.layers import channel_layers  # noqa: E402
from django.apps import apps  # noqa: E402

if not apps.ready:
    django.setup()

from django.conf import settings as django_settings  # noqa: E402
from rest_framework.test import APIClient  # noqa: E402

from studio.accounts.models import ApiToken  # noqa: E402
from studio.workflows.apps import StudioEngine, build_engine  # noqa: E402


def pytest_unconfigure(config: pytest.Config) -> None:
    if _DATA_DIR is not None:
        shutil.rmtree(_DATA_DIR, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _close_connection_pools(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    """PostgreSQL pools keep their connections open, and a pooled connection another thread
    still holds outlives the pool's close: end them all before the test database is dropped
    (else PostgreSQL refuses, the database being in use)."""
    yield
    import psycopg
    from django.db import connections

    with django_db_blocker.unblock():
        for connection in connections.all(initialized_only=True):
            if connection.vendor != "postgresql":
                continue
            connection.close()  # back to the pool, which closes every idle connection
            connection.close_pool()
            params = connection.get_connection_params()
            with psycopg.connect(**params, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                              " WHERE datname = current_database() AND pid <> pg_backend_pid()")


@pytest.fixture(autouse=True)
def _test_settings(settings: Any, tmp_path: Path) -> None:
    settings.MEDIA_ROOT = tmp_path / "media"
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast, tests only
    # Throttle counts start afresh in each test (this process's memory, not the shared Redis).
    settings.CACHES = {**settings.CACHES, "throttle": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                                       "LOCATION": f"throttle-{tmp_path.name}"}}


@pytest.fixture(autouse=True)
def _fresh_channel_layers() -> Iterator[None]:
    """Each test its own channel layers. Channels caches a layer per alias for the process, and a
    Redis layer's receive lock binds to the event loop of the first consumer that waited on it:
    a test whose consumer was still receiving when its loop ended left that lock held, bound to
    a loop that is gone, for the next test's consumers ("bound to a different event loop")."""
    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


def _installed(allow_module_ops: bool) -> Iterator[StudioEngine]:
    """A fresh engine installed as the app's for the test, stopped and replaced by the previous one after."""
    app = apps.get_app_config("workflows")
    studio = build_engine(dataclasses.replace(django_settings.OMNIFLOW, allow_module_ops=allow_module_ops))
    previous = app.install(studio)
    try:
        yield studio
    finally:
        studio.runs.stop()
        app.install(previous)


@pytest.fixture(autouse=True)
def studio_engine() -> Iterator[StudioEngine]:
    """A fresh engine per test (its own RunService; module ops allowed: the tests name their own
    functions in `tests.studio.fns`), stopped afterwards. `strict_engine` is a studio as deployed."""
    yield from _installed(allow_module_ops=True)


@pytest.fixture
def strict_engine(studio_engine: StudioEngine) -> Iterator[StudioEngine]:
    """The engine of a studio as deployed (`OMNIFLOW_ALLOW_MODULE_OPS` off): registered ops only."""
    yield from _installed(allow_module_ops=False)


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("alice", password="alice-password-1")


@pytest.fixture
def other_user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("bob", password="bob-password-1")


@pytest.fixture
def staff(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("root", password="root-password-1", is_staff=True)


def client_for(user: Any) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {ApiToken.objects.issue(user, 'test').secret}")
    return client


@pytest.fixture
def api(user: Any) -> APIClient:
    return client_for(user)


@pytest.fixture
def other_api(other_user: Any) -> APIClient:
    return client_for(other_user)


@pytest.fixture(scope="module")
def live_studio(django_db_setup: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One live studio for the module's tests (its own daphne); see tests/studio/livestudio.py."""
    from tests.studio.livestudio import LiveStudio

    live = LiveStudio(tmp_path_factory.mktemp("live-studio"))
    try:
        yield live
    finally:
        live.close()
