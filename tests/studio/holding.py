"""A node agent busy with a long task, as starting a deployment's workers can keep it: a Celery task
that holds its worker until the test releases it, and says when it has it (readiness, never a sleep).
An agent loads it with `--include tests.studio.holding` (`test_celery_deploy.started_node(include=)`)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import redis
from celery import current_app, shared_task

from studio.workflows.apps import engine

HOLD_TASK = "tests.hold_agent"


@shared_task(name=HOLD_TASK, ignore_result=True)
def hold_agent(key: str, limit_s: float) -> None:
    """Push to `<key>:held`, wait for `<key>:release` (at most `limit_s`), push to `<key>:done`."""
    client = redis.Redis.from_url(engine().config.redis_url, socket_timeout=limit_s + 10)
    try:
        client.rpush(f"{key}:held", b"1")
        client.blpop([f"{key}:release"], timeout=limit_s)
        client.rpush(f"{key}:done", b"1")
    finally:
        client.close()


@dataclass(frozen=True)
class Hold:
    client: redis.Redis
    key: str

    def holding(self) -> bool:
        """Whether the task still holds the agent."""
        return not self.client.exists(f"{self.key}:done")


@contextlib.contextmanager
def agent_held(redis_url: str, queue: str, limit_s: float = 180.0) -> Iterator[Hold]:
    """The agent consuming `queue` held by `hold_agent` from when it took the task until the block
    ends (it is released then, and waited for)."""
    key = f"tests-hold:{uuid.uuid4().hex}"
    client = redis.Redis.from_url(redis_url, socket_timeout=70)  # above its longest wait (redis-py's default: 5 s)
    try:
        current_app.send_task(HOLD_TASK, args=[key, limit_s], queue=queue)
        if client.blpop([f"{key}:held"], timeout=60) is None:
            raise TimeoutError(f"the agent of {queue} did not take the holding task within 60 s")
        try:
            yield Hold(client, key)
        finally:
            client.rpush(f"{key}:release", b"1")
            if client.blpop([f"{key}:done"], timeout=30) is None:
                raise TimeoutError(f"the agent of {queue} did not end the holding task within 30 s")
    finally:
        client.delete(f"{key}:held", f"{key}:release", f"{key}:done")
        client.close()
