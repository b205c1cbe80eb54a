"""A file a run wrote on another node, read there by the node's own rules and sent back over Redis
(`studio.workflows.runs.nodefiles` over `deployments.queries`): answered by the agent's query
threads, refusing what is not its query, a dead node an error within the timeout; and through a
real node agent busy with a long task, a file that arrives all the same, downloaded over REST.
The whole path through two Celery node agents is also in `test_run_folders`."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from django.conf import settings as django_settings
from django.db import connections, transaction
from django.utils import timezone

from engine.client.cluster import NodeRecord
from engine.client.runs import NodeOutputEvent
from engine.spec.resources import Amounts
from studio.config import StudioConfig
from studio.workflows.deployments import queries
from studio.workflows.deployments.node import node_queue
from studio.workflows.deployments.queries import QueryServer, Refused
from studio.workflows.models import Deployment, NodeHeartbeat, NodeRun, Run, RunEvent, RunFile
from studio.workflows.runs import nodefiles
from studio.workflows.runs.lease import LeaseCheck, LeaseTerms
from studio.workflows.runs.nodefiles import NodeFile, NodeFileError, UserFileQuery, read_user_file
from studio.workflows.runs.store import claim, record, renew
from tests.studio.factories import create_workflow, spec_doc
from tests.studio.holding import agent_held
from tests.studio.limits import configured
from tests.studio.test_celery_deploy import leftover_workers, running_node, started_node, wait_ready
from tests.studio.test_run_folders import node_live, run_to_end, saving_spec
from tests.studio.test_run_leases import started_events, stored_run, wait_until


def test_a_node_reads_only_regular_files_that_resolve_in_the_owners_folder(tmp_path: Path) -> None:
    root = tmp_path / "users"
    mine, theirs = root / "7", root / "8"
    (mine / "out").mkdir(parents=True)
    theirs.mkdir()
    (mine / "out" / "reply.txt").write_bytes(b"hello")
    (mine / "out" / "big.bin").write_bytes(b"x" * 2048)
    (theirs / "secret.txt").write_text("theirs")
    (mine / "linked").symlink_to(theirs)
    (mine / "out" / "alias.txt").symlink_to(theirs / "secret.txt")
    assert read_user_file(root, "7", "out/reply.txt", 1024) == NodeFile(b"hello")
    assert read_user_file(root, "7", "out", 1024) == NodeFile(None)  # a folder: shown by its name
    assert read_user_file(root, "7", "out/gone.txt", 1024) == NodeFile(None)
    for owner, name, why in [("7", "../8/secret.txt", ".."), ("7", "linked/secret.txt", "symbolic link"),
                             ("7", "out/alias.txt", "symbolic link"),
                             ("7", "/etc/passwd", "relative"), ("7/../8", "secret.txt", "not a user id"),
                             ("7", "out/big.bin", "larger than 1024 bytes")]:
        with pytest.raises(NodeFileError, match=why):
            read_user_file(root, owner, name, 1024)


def test_reply_keys_are_the_studios_own() -> None:
    queries.check_reply_key("omniflow", queries.reply_key("omniflow"))
    for forged in ("omniflow:runs:lease", "other:node-reply:" + "a" * 32, "omniflow:node-reply:" + "a" * 31 + "Z"):
        with pytest.raises(queries.NodeQueryError, match="not a reply key"):
            queries.check_reply_key("omniflow", forged)


# --------------------------------------------------------------- the agent's query threads
@pytest.fixture
def node_config(tmp_path: Path) -> StudioConfig:
    """Node `n2`, its data dir `tmp_path`, on a Redis prefix of its own."""
    return dataclasses.replace(django_settings.OMNIFLOW, redis_url=os.environ["REDIS_URL"],
                               redis_prefix=f"t{uuid.uuid4().hex[:8]}", data_dir=tmp_path, node_name="n2",
                               max_run_file_bytes=4096)


def query_server(config: StudioConfig, **handlers: Any) -> QueryServer:
    serve = handlers.get("serve", functools.partial(nodefiles.serve, config))
    assert config.redis_url is not None
    return QueryServer(config.redis_url, config.redis_prefix, config.node_name, {UserFileQuery: serve}, poll_s=0.2)


@pytest.fixture
def serving(node_config: StudioConfig) -> Iterator[QueryServer]:
    """Node `n2`'s query threads, as its agent runs them."""
    server = query_server(node_config)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def left_in_redis(config: StudioConfig) -> list[bytes]:
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        return sorted(client.keys(f"{config.redis_prefix}:*"))
    finally:
        client.close()


@pytest.mark.redis
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_a_nodes_files_come_back_from_its_query_threads(node_config: StudioConfig, serving: QueryServer) -> None:
    home = node_config.users_root / "7"
    (home / "out").mkdir(parents=True)
    picture = b"\x89PNG" + bytes(range(256))
    (home / "out" / "picture.png").write_bytes(picture)
    (home / "big.bin").write_bytes(b"x" * 4097)
    fetch = functools.partial(nodefiles.fetch, node_config, "n2", timeout_s=10)
    assert fetch("7", "out/picture.png") == NodeFile(picture)  # the bytes that were written
    assert fetch("7", "out") == NodeFile(None)
    assert fetch("7", "out/gone.png") == NodeFile(None)
    for owner, name, why in [("7", "../8/x", r"\.\."), ("7", "big.bin", "larger than 4096 bytes"),
                             ("7/..", "x", "not a user id")]:
        with pytest.raises(NodeFileError, match=why):
            fetch(owner, name)
    assert left_in_redis(node_config) == []  # every answer taken, no query left


@pytest.mark.redis
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_the_agent_drops_what_is_not_its_query_and_keeps_serving(node_config: StudioConfig,
                                                                 serving: QueryServer) -> None:
    prefix = node_config.redis_prefix
    (node_config.users_root / "7").mkdir(parents=True)
    (node_config.users_root / "7" / "a.txt").write_bytes(b"a")
    forged = f"{prefix}:runs:lease"
    good = {"kind": "read_user_file", "node": "n2", "reply": queries.reply_key(prefix), "owner": "7", "name": "a.txt"}
    dropped = [b"x" * (queries.MAX_QUERY_BYTES + 1), b"not json", b"[]",
               msgspec.json.encode({**good, "kind": "run_shell"}),
               msgspec.json.encode({**good, "reply": forged}),
               msgspec.json.encode({**good, "node": "n3"}),
               msgspec.json.encode({**good, "extra": 1})]
    for raw in dropped:
        assert serving.reply(raw) is None
    answered = serving.reply(msgspec.json.encode(good))
    assert answered is not None and answered.key == good["reply"]
    assert msgspec.json.decode(answered.payload) == {"kind": "answered", "value": {"data": "YQ=="}}

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        client.rpush(queries.queue_key(prefix, "n2"), *dropped)
        assert nodefiles.fetch(node_config, "n2", "7", "a.txt", timeout_s=10) == NodeFile(b"a")
        assert not client.exists(forged)
    finally:
        client.close()
    assert left_in_redis(node_config) == []

    def broken(query: UserFileQuery) -> NodeFile:
        raise RuntimeError(f"a bug reading {query.name}")

    failing = query_server(node_config, serve=broken).reply(msgspec.json.encode(good))
    assert failing is not None
    assert msgspec.json.decode(failing.payload, type=Refused) == Refused(
        "node 'n2' failed to answer (RuntimeError); its agent's log says why")


@pytest.mark.redis
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_a_dead_node_is_an_error_within_the_timeout(node_config: StudioConfig) -> None:
    began = time.monotonic()
    with pytest.raises(NodeFileError, match="node 'gone' did not answer within 0.3 s: nothing took the query there"):
        nodefiles.fetch(node_config, "gone", "7", "out/reply.txt", timeout_s=0.3)
    assert time.monotonic() - began < 3.0
    assert left_in_redis(node_config) == []  # the query was taken back: a node back later never sees it


# ------------------------------------------------- the run's row while a node answers
@pytest.fixture
def studio() -> Iterator[StudioConfig]:
    """This process's studio, on a Redis prefix of its own."""
    with configured(redis_prefix=f"t{uuid.uuid4().hex[:8]}") as installed:
        yield installed.config


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_the_runs_row_is_not_locked_while_a_nodes_file_is_fetched(tmp_path: Path, api: Any, user: Any,
                                                                  studio: StudioConfig) -> None:
    """A node output names two files a role worker wrote on node `there`. Its agent's query threads
    (a real `QueryServer` serving `nodefiles.serve`) take the first query and hold it until the test
    lets them answer, as a node slow to answer (or gone within its heartbeat's TTL) does. While
    `record` waits on that answer, another connection locks the run's row without waiting
    (`SELECT ... FOR UPDATE NOWAIT`) and renews its lease. Once answered, the file is a run file of the
    run's owner with the bytes the node wrote; the other, over the node's size limit, is refused by
    the node and shown by name and why, the event stored all the same."""
    assert studio.redis_url is not None
    node = f"there-{uuid.uuid4().hex[:8]}"
    there = dataclasses.replace(studio, data_dir=tmp_path / "there", node_name=node, max_run_file_bytes=4096)
    home = there.users_root / str(user.pk) / "out"
    home.mkdir(parents=True)
    written = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
    (home / "picture.png").write_bytes(written)
    (home / "big.bin").write_bytes(b"x" * 4097)
    total = Amounts(0, 1, 1)
    announced = NodeRecord(name=node, address="10.0.0.2", total=total, free=total, users_root=str(there.users_root))
    NodeHeartbeat.objects.create(name=node, seen_at=timezone.now(), lapses_at=timezone.now() + dt.timedelta(seconds=30),
                                 ttl_s=30, record=msgspec.to_builtins(announced))

    asked, answer = threading.Event(), threading.Event()

    def slow(query: UserFileQuery) -> NodeFile:
        asked.set()
        if not answer.wait(60):
            raise queries.NodeQueryError("the test never let the node answer")
        return nodefiles.serve(there, query)

    server = QueryServer(studio.redis_url, studio.redis_prefix, node, {UserFileQuery: slow}, poll_s=0.2)
    server.start()
    run = stored_run(user, create_workflow(api, spec_doc()))
    run_id, lease = str(run.pk), LeaseTerms("worker-a", 30.0)
    assert claim(run_id, lease) is not None
    record(run_id, started_events(run_id, 0), owner=lease.owner)
    output = NodeOutputEvent(seq=2, run_id=run_id, time=timezone.now().timestamp(), node="step", port="out",
                             value={"files": [f"{home}/picture.png", f"{home}/big.bin"]})

    def write() -> list[dict[str, Any]]:
        try:
            return record(run_id, [output], owner=lease.owner)
        finally:
            connections.close_all()  # this thread's connection

    try:
        with ThreadPoolExecutor(1) as pool:
            writing = pool.submit(write)
            try:
                assert asked.wait(30), "the node was never asked"
                with transaction.atomic():  # record waits on the node: the row is free
                    locked = Run.objects.select_for_update(nowait=True).get(pk=run_id)
                    assert locked.last_seq == 1
                assert renew(lease, [run_id]) == LeaseCheck(lost=frozenset(), cancel=frozenset())
            finally:
                answer.set()
            (stored,) = writing.result(timeout=60)
    finally:
        server.stop()

    picture, big = stored["value"]["files"]
    assert big == ("out/big.bin (not stored as a run file: on node " + node
                   + ", larger than 4096 bytes, OMNIFLOW_MAX_RUN_FILE_BYTES)")
    assert set(picture) == {"$file", "url", "name"} and picture["name"] == "out/picture.png"
    file = RunFile.objects.get(pk=picture["$file"])
    assert (file.run_id, file.owner_id, file.role, file.content_type) == (run.pk, user.pk, "output", "image/png")
    with file.file.open("rb") as fh:
        assert fh.read() == written
    assert file.sha256 == hashlib.sha256(written).hexdigest()
    assert list(RunEvent.objects.filter(run_id=run_id).values_list("seq", "type")) == [
        (0, "run_started"), (1, "node_state"), (2, "node_output")]
    assert NodeRun.objects.get(run_id=run_id, node="step").outputs == {"out": stored["value"]}
    assert str(tmp_path) not in json.dumps(stored)
    assert left_in_redis(studio) == []  # every answer taken, no query left


# --------------------------------------------------------- a real node agent, busy
@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL (the Celery broker)")
def test_a_file_arrives_from_a_node_agent_busy_with_a_long_task(tmp_path: Path, api: Any, user: Any,
                                                                settings: Any) -> None:
    """Node `host` runs the deployment's python role, whose `media.save_outputs` writes under the
    host's data dir; its agent (a solo Celery worker) is held by a long task from before the run is
    submitted until after the file was downloaded. The run worker `runner` (whose data dir this
    server serves) fetches the file from the host all the same: it arrives as a run file with the
    bytes the host wrote, while the agent is still busy."""
    (tmp_path / "runner").mkdir()
    (tmp_path / "host").mkdir()
    host = started_node(tmp_path / "host", {"OMNIFLOW_NODE_TTL_S": "2"}, include=("tests.studio.holding",))
    try:
        wait_ready(host)
        with running_node(tmp_path / "runner", {"OMNIFLOW_NODE_TTL_S": "2"}) as runner:
            settings.MEDIA_ROOT = tmp_path / "runner" / "data" / "files"  # where the runner stores run files
            wait_until("both nodes live", lambda: node_live(host.node) and node_live(runner.node))
            workflow = create_workflow(api, saving_spec())
            d = api.post("/api/deployments/", {"workflow": workflow["id"], "node": host.node}, format="json").json()
            host.wait_for("running", lambda: Deployment.objects.get(pk=d["id"]).status == "running")

            with agent_held(os.environ["REDIS_URL"], node_queue(host.node)) as hold:
                run_id = run_to_end(api, runner, d["id"], "hello")
                written = (tmp_path / "host" / "data" / "users" / str(user.pk) / "outputs" / run_id
                           / "reply.txt").read_bytes()
                text = api.get(f"/api/runs/{run_id}/").json()["outputs"]["result"]["files"]["text"]
                assert isinstance(text, dict) and set(text) == {"$file", "url", "name"}, text
                download = api.get(text["url"])
                assert download.status_code == 200, download.content
                assert b"".join(download.streaming_content) == written == b"hello"
                assert hold.holding()  # the agent was busy with the long task all along

            api.post(f"/api/deployments/{d['id']}/stop/")
            host.wait_for("stopped", lambda: Deployment.objects.get(pk=d["id"]).status == "stopped")
    finally:
        if host.proc.poll() is None:
            host.stop()
        for process in leftover_workers(host.node):
            process.kill()
