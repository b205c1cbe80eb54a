"""The ASGI application: HTTP (Django, with static files in the embedded mode) and
WebSockets (Channels), e.g. `daphne -b 127.0.0.1 -p 8000 studio.asgi:application`.

The engine objects (kind catalogue, RunService with the executor loop) belong to the
workflows AppConfig, built when Django sets up below; this module only wires protocols.
On startup the process takes up the runs a previous process left behind
(`RunService.resume_stale`: pending ones are executed, running ones whose lease lapsed are
executed again once or failed) and from then on sweeps lapsed leases every half lease
period: at ASGI `lifespan` startup (uvicorn, hypercorn), or before the first request under
daphne, which has no lifespan. It also starts
the metrics sampler (`studio.workflows.history`), in every dispatch mode. Lifespan shutdown
stops both.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "studio.settings")
django_http = get_asgi_application()  # sets Django up; import models and consumers after it

from asgiref.sync import sync_to_async  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from studio.accounts.auth import websocket_auth  # noqa: E402
from studio.config import Dispatch  # noqa: E402
from studio.dbcalls import orm  # noqa: E402
from studio.workflows.apps import StudioEngine, engine  # noqa: E402
from studio.workflows.deployments.service import resume_embedded  # noqa: E402
from studio.workflows.routing import websocket_urlpatterns  # noqa: E402

log = logging.getLogger(__name__)


class EngineStartup:
    """Runs `resume_stale` (runs) and `resume_embedded` (deployments this process hosts)
    once per process, before the first scope is served, and starts the metrics sampler
    (`enabled=False`, for tests sharing a database: neither)."""

    def __init__(self, studio: StudioEngine, inner: Any, *, enabled: bool) -> None:
        self.studio = studio
        self.inner = inner
        self._sample = enabled
        self._done = not enabled or studio.config.dispatch is not Dispatch.LOCAL
        self._lock = asyncio.Lock()

    async def ensure(self) -> None:
        if self._sample:
            self._sample = False
            self.studio.history.start()  # one point per worker per interval, whoever watches
        if self._done:
            return
        async with self._lock:
            if not self._done:
                resumed = await orm(resume_embedded, thread_sensitive=False)()
                if resumed.started:
                    log.info("starting %d deployment(s) recorded to start with the server", len(resumed.started))
                if resumed.redeployed:
                    log.warning("deploying again %d deployment(s) a previous process hosted", len(resumed.redeployed))
                stale = await orm(self.studio.runs.resume_stale, thread_sensitive=False)()
                if stale:
                    log.warning("took up %d run(s) a previous process left (executed again, or failed)", len(stale))
                self._done = True

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        await self.ensure()
        return await self.inner(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.ensure()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await sync_to_async(self.studio.history.stop, thread_sensitive=False)()
                await sync_to_async(self.studio.runs.stop, thread_sensitive=False)()
                await send({"type": "lifespan.shutdown.complete"})
                return


def build_application(studio: StudioEngine, *, resume_stale: bool = True) -> EngineStartup:
    """The studio's ASGI app. `resume_stale=False` for tests that share a database with
    runs in flight."""
    http = ASGIStaticFilesHandler(django_http) if not settings.OMNIFLOW.distributed else django_http
    router = ProtocolTypeRouter({
        "http": http,
        "websocket": websocket_auth(URLRouter(websocket_urlpatterns)),
    })
    return EngineStartup(studio, router, enabled=resume_stale)


application = build_application(engine())
