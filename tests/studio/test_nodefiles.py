"""A file a run wrote on another node, read there by the node's own rules and sent back over a
Redis list (`studio.workflows.runs.nodefiles`); the whole path through two Celery node agents is
in `test_run_folders`."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import redis

from studio.workflows.runs import nodefiles
from studio.workflows.runs.nodefiles import NodeFile, NodeFileError, read_user_file


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
    nodefiles.check_reply_key("omniflow", nodefiles.reply_key("omniflow"))
    for forged in ("omniflow:runs:lease", "other:nodefile:" + "a" * 32, "omniflow:nodefile:" + "a" * 31 + "Z"):
        with pytest.raises(NodeFileError, match="not a reply key"):
            nodefiles.check_reply_key("omniflow", forged)


@pytest.mark.redis
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_answers_cross_a_redis_list_and_silence_is_an_error_naming_the_node(tmp_path: Path) -> None:
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "picture.png").write_bytes(b"\x89PNG" + bytes(range(256)))
    cases = {"picture.png": NodeFile(b"\x89PNG" + bytes(range(256))), "gone.png": NodeFile(None)}
    for name, expected in cases.items():
        key = nodefiles.reply_key("t")
        payload = nodefiles.encode_answer(lambda name=name: read_user_file(tmp_path, "7", name, 4096))
        answering = threading.Thread(target=nodefiles.answer, args=(client, key, payload))
        answering.start()
        assert nodefiles.await_answer(client, key, "n2", timeout_s=10) == expected
        answering.join()
        assert not client.exists(key)
    key = nodefiles.reply_key("t")
    nodefiles.answer(client, key, nodefiles.encode_answer(lambda: read_user_file(tmp_path, "7", "../8/x", 10)))
    with pytest.raises(NodeFileError, match=r"\.\."):
        nodefiles.await_answer(client, key, "n2", timeout_s=10)
    with pytest.raises(NodeFileError, match="node 'n2' did not answer within 0.2 s"):
        nodefiles.await_answer(client, nodefiles.reply_key("t"), "n2", timeout_s=0.2)
    client.close()
