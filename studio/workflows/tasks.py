"""Celery tasks of the distributed mode (`OMNIFLOW_DISPATCH=celery`).

`execute_run(run_id)` executes one stored run in the worker through the same seam as the
embedded mode (`runs.execution.execute_run`), with an executor of its own, storing
events in the database and publishing them on the channel layer. Claiming makes it
idempotent: a redelivered task finds the run no longer pending and does nothing.
"""

from __future__ import annotations

import asyncio

from celery import shared_task
from django.db import InterfaceError, OperationalError

from studio.workflows.apps import engine
from studio.workflows.runs.bus import ChannelLayerRunEventBus
from studio.workflows.runs.execution import execute_standalone
from studio.workflows.runs.metrics import RunMetrics
from studio.workflows.runs.store import ThreadedRunStore


@shared_task(name="omniflow.execute_run", bind=True, acks_late=True,
             autoretry_for=(OperationalError, InterfaceError), retry_backoff=True, max_retries=5)
def execute_run(self, run_id: str) -> str | None:
    eng = engine()
    status = asyncio.run(execute_standalone(
        run_id,
        kinds=eng.kinds,
        store=ThreadedRunStore(None),
        bus=ChannelLayerRunEventBus(),
        metrics=RunMetrics(),
    ))
    return None if status is None else str(status)
