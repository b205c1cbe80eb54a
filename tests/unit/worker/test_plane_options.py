"""The worker plane's keys at the command line: `omniflow keys generate DIR` writes keys a
worker can load, `--keys` is required (no silent plaintext), `--plaintext` is explicit, and a
local cluster hands its workers a private copy of its keys."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from engine.cli import main
from engine.data.curve import BulkMode, PlaneKeys
from engine.spec.graph import GraphSpec
from engine.worker.launcher import LocalCluster
from engine.worker.options import WorkerOptionError, add_worker_arguments, plane_keys


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(["--role", "py", "--workflow", "w.json", *argv])


def test_keys_generate_writes_keys_a_worker_loads(capsys, tmp_path: Path) -> None:
    directory = tmp_path / "plane"
    assert main(["keys", "generate", str(directory)]) == 0
    keys = plane_keys(parse("--keys", str(directory)))
    assert keys == PlaneKeys.load(directory) and keys.public in capsys.readouterr().out
    assert main(["keys", "generate", str(directory)]) == 1  # never overwritten by accident
    assert "not empty" in capsys.readouterr().err
    assert main(["keys", "generate", str(directory), "--force"]) == 0
    assert PlaneKeys.load(directory) != keys
    assert keys.bulk is BulkMode.CLEAR


def test_keys_generate_takes_the_planes_bulk_mode(capsys, tmp_path: Path) -> None:
    """An operator on a network others can read keeps tensors and KV pages inside CURVE."""
    assert main(["keys", "generate", str(tmp_path / "plane"), "--bulk", "encrypted"]) == 0
    assert "bulk encrypted" in capsys.readouterr().out
    assert plane_keys(parse("--keys", str(tmp_path / "plane"))).bulk is BulkMode.ENCRYPTED
    with pytest.raises(SystemExit):
        main(["keys", "generate", str(tmp_path / "other"), "--bulk", "plaintext"])


def test_a_worker_needs_keys_or_an_explicit_plaintext(tmp_path: Path) -> None:
    with pytest.raises(WorkerOptionError, match="--keys DIR is required"):
        plane_keys(parse())
    assert plane_keys(parse("--plaintext")) is None
    directory = PlaneKeys.generate().write(tmp_path / "keys")
    with pytest.raises(WorkerOptionError, match="choose one"):
        plane_keys(parse("--plaintext", "--keys", str(directory)))
    os.chmod(directory / "plane.secret", 0o644)
    with pytest.raises(WorkerOptionError, match=r"--keys .*mode 0644 lets group or others in"):
        plane_keys(parse("--keys", str(directory)))


def test_a_cluster_makes_fresh_keys_unless_given_or_told_plaintext() -> None:
    spec = GraphSpec(version=1, name="empty", roles=[], nodes=[], edges=[])
    first, second = LocalCluster(spec, allow_module_ops=True), LocalCluster(spec, allow_module_ops=True)
    assert first.keys is not None and second.keys is not None and first.keys != second.keys
    given = PlaneKeys.generate()
    assert LocalCluster(spec, allow_module_ops=True, keys=given).keys == given
    assert LocalCluster(spec, allow_module_ops=True, plaintext=True).keys is None
    with pytest.raises(ValueError, match="plaintext"):
        LocalCluster(spec, allow_module_ops=True, keys=given, plaintext=True)
