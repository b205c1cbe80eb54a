"""User files (`engine.spec.userfiles`): a run's output folder names resolved by the process that
writes, under its own users root and the run's owner; the same refusals wherever that is."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from engine.spec.userfiles import (
    DEFAULT_OUT_DIR,
    OwnerId,
    UserPathRefused,
    UsersRoot,
    output_params,
    owner_id,
)

OWNER = OwnerId("7")


def test_a_name_resolves_in_the_owners_folder_made_0700(tmp_path: Path) -> None:
    users = UsersRoot(tmp_path / "users")
    assert users.resolve(OWNER, "out/./a") == tmp_path / "users" / "7" / "out" / "a"
    assert stat.S_IMODE((tmp_path / "users" / "7").stat().st_mode) == 0o700
    assert not (tmp_path / "users" / "7" / "out").exists()  # the writer makes the named folder


@pytest.mark.parametrize(("name", "why"), [
    ("../6/out", "climbs out"), ("a/../../x", "climbs out"), ("/etc", "absolute"), ("~/x", "absolute"),
    ("a\\b", "backslash"), ("", "not a name"), (3, "not a name"),
])
def test_names_that_escape_are_refused(tmp_path: Path, name: object, why: str) -> None:
    with pytest.raises(UserPathRefused, match=why):
        UsersRoot(tmp_path).resolve(OWNER, name)


def test_a_link_in_the_owners_folder_or_as_the_folder_is_refused(tmp_path: Path) -> None:
    users = UsersRoot(tmp_path / "users")
    (tmp_path / "elsewhere").mkdir()
    users.folder(OWNER)
    (tmp_path / "users" / "7" / "out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserPathRefused, match="'out' is a symbolic link"):
        users.resolve(OWNER, "out/run")
    (tmp_path / "users" / "8").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserPathRefused, match="not a plain directory"):
        users.folder(OwnerId("8"))


@pytest.mark.parametrize("value", ["..", "a/b", "", ".", "x" * 65, "7 "])
def test_an_owner_id_is_one_plain_path_component(value: str) -> None:
    with pytest.raises(UserPathRefused, match="not an owner id"):
        owner_id(value)
    assert owner_id(12) == "12"


def test_output_params_resolve_out_dir_and_declared_folders_defaulting_to_outputs(tmp_path: Path) -> None:
    users = UsersRoot(tmp_path)
    params = {"out_dir": "a", "other": "b", "k": 1}
    got = output_params(params, ("folder",), users, OWNER, node_id="n")
    assert got == {"out_dir": str(tmp_path / "7" / "a"), "folder": str(tmp_path / "7" / DEFAULT_OUT_DIR),
                   "other": "b", "k": 1}
    assert params == {"out_dir": "a", "other": "b", "k": 1}  # not modified


def test_without_an_owner_names_stay_as_given(tmp_path: Path) -> None:
    assert output_params({"out_dir": "../x"}, ("folder",), None, None, node_id="n") == {"out_dir": "../x"}
    assert not list(tmp_path.iterdir())


def test_an_owner_without_a_users_root_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(UserPathRefused, match=r"node 'n': params.folder: this worker has no users root"):
        output_params({}, ("folder",), None, OWNER, node_id="n")
    with pytest.raises(UserPathRefused, match=r"node 'n': params.out_dir: '/abs' is an absolute path"):
        output_params({"out_dir": "/abs"}, (), UsersRoot(tmp_path), OWNER, node_id="n")
