"""The local cache of built checkpoints: a packaged model's GGUF, dequantized once into safetensors.

Layout: `<root>/models/<name>-<version>/` holds a standard Hugging Face checkpoint
(config, `model.safetensors`, tokenizer files, chat template) plus `MANIFEST`, the
sha256 of every other file in it. Contract:

* A checkpoint directory appears whole or not at all: it is built in a temporary
  directory beside it and renamed into place. Builders take an exclusive lock file
  (`flock`, so a crashed builder's lock goes with its process), and the one that gets
  it second finds the directory built and reuses it.
* Every load checks the manifest: a missing, extra or changed file is a
  `CorruptCacheError` that says which file and which directory to delete. A file is hashed
  until it has been found right in its present state (size, times, inode; kept in a stamp file
  beside the directory), then only when that state changes: a write changes it.
* Nothing is downloaded: the GGUF comes from an installed distribution, transformers
  reads it with `local_files_only=True`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from engine.compute.models.errors import ModelLoadError
from engine.compute.models.packaged import DistributionLookup, GGUFSource, PackagedModel, find_gguf

log = logging.getLogger(__name__)

CheckpointWriter = Callable[[PackagedModel, GGUFSource, Path, TextIO | None], None]
"""Writes a checkpoint of a packaged model from its GGUF into a directory (`write_checkpoint`)."""

MANIFEST = "omniflow-manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 22
_WEIGHT_SUFFIXES = (".safetensors",)
_PROJECT_ROOT = Path(__file__).resolve().parents[3]
"""The repository root: the studio's default data dir (`.omniflow`) is under it too."""


class CorruptCacheError(ModelLoadError):
    """A cached checkpoint does not match its manifest (or has none)."""


@dataclass(frozen=True, slots=True)
class ModelCacheConfig:
    """Where built checkpoints live: `OMNIFLOW_CACHE_DIR`, else `cache/` in the data dir
    (`OMNIFLOW_DATA_DIR`, else `.omniflow` in the project, as for the studio)."""

    root: Path

    ENV_CACHE_DIR = "OMNIFLOW_CACHE_DIR"
    ENV_DATA_DIR = "OMNIFLOW_DATA_DIR"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ModelCacheConfig:
        raw = environ.get(cls.ENV_CACHE_DIR) or None
        if raw is None:
            data_dir = Path(environ.get(cls.ENV_DATA_DIR) or _PROJECT_ROOT / ".omniflow")
            root = data_dir / "cache"
        else:
            root = Path(raw)
        root = root.expanduser().resolve()
        if root.exists() and not root.is_dir():
            source = cls.ENV_CACHE_DIR if raw is not None else cls.ENV_DATA_DIR
            raise ModelLoadError(f"model cache {str(root)!r} (from {source}) exists and is not a directory")
        return cls(root=root)


@dataclass(frozen=True, slots=True)
class CachedCheckpoint:
    """A verified checkpoint directory; `digest` names its contents (the manifest's sha256)."""

    path: Path
    digest: str


@dataclass(frozen=True, slots=True)
class _Manifest:
    model: str
    source: str
    files: dict[str, str]

    def encode(self) -> bytes:
        body = {"version": MANIFEST_VERSION, "model": self.model, "source": self.source, "files": self.files}
        return json.dumps(body, indent=1, sort_keys=True).encode()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


FileState = list[int]
"""A file's size, mtime_ns, ctime_ns, inode and device: what changes when its content does."""
_RACY_NS = 2_000_000_000
"""A file changed this recently is not stamped: file times tick coarsely (milliseconds), so a write
in the same tick as the hashing would leave them as they were (git's "racy clean" problem)."""


def _file_state(path: Path) -> FileState:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


@dataclass(slots=True)
class _Stamps:
    """Which files of a checkpoint were hashed and found right, in which state (`FileState`): a file
    in the same state is not hashed again, so a process loading the model does not read 500 MB
    through SHA-256 each time (12 s on two busy cores). Kept beside the checkpoint directory, for
    the manifest `digest` it was made under; any change of content changes the state (a write sets
    ctime, which no user can set back), and the file is hashed again."""

    digest: str
    files: dict[str, FileState]
    loaded: dict[str, FileState]

    @classmethod
    def read(cls, path: Path, digest: str) -> _Stamps:
        try:
            body = json.loads(path.read_bytes())
            files = {str(k): [int(x) for x in v] for k, v in body["files"].items()} if body["digest"] == digest else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            files = {}  # none yet, or unreadable: every file is hashed
        return cls(digest, files, dict(files))

    def write(self, path: Path) -> None:
        if self.files == self.loaded:
            return
        body = json.dumps({"digest": self.digest, "files": self.files}, sort_keys=True).encode()
        staging = path.with_name(f"{path.name}.{os.getpid()}")
        try:
            staging.write_bytes(body)
            os.replace(staging, path)
        except OSError as exc:  # a cache this user may read but not write: it is hashed each time
            log.info("cannot record the verified files of %s in %s: %s", path.parent, path, exc)
            with contextlib.suppress(OSError):
                staging.unlink()


class ModelCache:
    """Builds packaged models into checkpoints under `config.root` and hands out verified ones.

    `lookup` finds installed distributions (`importlib.metadata.distribution`); `progress`
    is where the build's progress bar goes (None: silent); `writer` builds a checkpoint
    from the GGUF (`write_checkpoint`), the cache adds the manifest.
    """

    def __init__(
        self,
        config: ModelCacheConfig,
        lookup: DistributionLookup = importlib.metadata.distribution,
        progress: TextIO | None = sys.stderr,
        writer: CheckpointWriter | None = None,
    ) -> None:
        self.config = config
        self._lookup = lookup
        self._progress = progress
        self._writer = writer if writer is not None else write_checkpoint

    def directory(self, spec: PackagedModel) -> Path:
        return self.config.root / "models" / f"{spec.name}-{spec.version}"

    def checkpoint(self, spec: PackagedModel) -> CachedCheckpoint:
        """The verified checkpoint of `spec`, built first if the cache does not hold it."""
        path = self.directory(spec)
        if not path.exists():
            with self._locked(spec):
                if not path.exists():  # another process may have built it while we waited
                    self._build(spec, path)
        return self.verify(spec, path)

    def text_files(self, spec: PackagedModel) -> Path:
        """The checkpoint directory of `spec` (built first if the cache does not hold it) with its
        tokenizer and config files verified, not its weights: what a process that needs only the
        text side (a router, the studio's chat templates, a worker attaching weights another
        process loaded and verified) reads."""
        path = self.directory(spec)
        if not path.exists():
            self.checkpoint(spec)
            return path
        self.verify(spec, path, weights=False)
        return path

    def verify(self, spec: PackagedModel, path: Path, *, weights: bool = True) -> CachedCheckpoint:
        """Check every file of `path` against its manifest (`weights=False`: all but the weight files,
        `*.safetensors`); `CorruptCacheError` names the fix."""
        fix = f"delete the directory {path} and it is rebuilt from {spec.distribution} on next use"
        try:
            raw = (path / MANIFEST).read_bytes()
            body = json.loads(raw)
            files = dict(body["files"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptCacheError(f"model {spec.name!r}: cache {path} has no readable manifest ({exc}); {fix}") from None
        present = {p.name for p in path.iterdir()} - {MANIFEST}
        if present != set(files):
            odd = sorted(present ^ set(files))
            raise CorruptCacheError(f"model {spec.name!r}: cache {path} has missing or extra files {odd}; {fix}")
        digest = hashlib.sha256(raw).hexdigest()
        stamps = _Stamps.read(self._stamp_path(path), digest)
        now = time.time_ns()
        for name, expected in sorted(files.items()):
            if not weights and name.endswith(_WEIGHT_SUFFIXES):
                continue
            state = _file_state(path / name)
            if stamps.files.get(name) == state:
                continue  # hashed before, and not changed since
            if _sha256(path / name) != expected:
                raise CorruptCacheError(f"model {spec.name!r}: {path / name} fails its checksum (corrupt); {fix}")
            if now - max(state[1], state[2]) > _RACY_NS:
                stamps.files[name] = state
        stamps.write(self._stamp_path(path))
        return CachedCheckpoint(path=path, digest=digest)

    @staticmethod
    def _stamp_path(path: Path) -> Path:
        return path.parent / f".{path.name}.verified"

    @contextlib.contextmanager
    def _locked(self, spec: PackagedModel) -> Iterator[None]:
        self.config.root.mkdir(parents=True, exist_ok=True)
        with (self.config.root / f".{spec.name}-{spec.version}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _build(self, spec: PackagedModel, path: Path) -> None:
        source = find_gguf(spec, self._lookup)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a builder that died
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            self._writer(spec, source, tmp, self._progress)
            write_manifest(spec, tmp)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users of the data dir
            os.rename(tmp, path)
        except Exception:  # an interrupted build's folder is removed as stale by the next builder
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(path.parent)


_STEPS = ("checking the GGUF", "reading the tokenizer", "dequantizing the weights", "writing safetensors")


def write_manifest(spec: PackagedModel, directory: Path) -> None:
    """Record the sha256 of every file of `directory` in its manifest (after syncing them to disk)."""
    files = {}
    for item in sorted(directory.iterdir()):
        if item.name != MANIFEST:
            _fsync_file(item)
            files[item.name] = _sha256(item)
    manifest = _Manifest(model=spec.name, source=f"{spec.distribution}=={spec.version}:{spec.gguf_file}", files=files)
    (directory / MANIFEST).write_bytes(manifest.encode())
    _fsync_file(directory / MANIFEST)


def write_checkpoint(spec: PackagedModel, source: GGUFSource, out: Path, progress: TextIO | None) -> None:
    """Dequantize `source` with transformers' GGUF loader and save it as a checkpoint in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"building model {spec.name!r} needs the gguf package: pip install gguf==0.19.0")
    bar = tqdm(total=len(_STEPS), desc=f"building {spec.name}", unit="step", file=progress,
               disable=progress is None, leave=True)
    with bar:
        bar.set_postfix_str(_STEPS[0])
        if source.sha256 is not None and _sha256(source.path) != source.sha256:
            raise ModelLoadError(
                f"model {spec.name!r}: {source.path} does not match its distribution's RECORD;"
                f" reinstall with `{spec.install_command} --force-reinstall`"
            )
        bar.update()
        folder, name = str(source.path.parent), source.path.name
        try:
            bar.set_postfix_str(_STEPS[1])
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            bar.update()
            bar.set_postfix_str(_STEPS[2])
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                         dtype=torch.float32)
            bar.update()
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"model {spec.name!r}: cannot read {source.path}: {exc}") from exc
        bar.set_postfix_str(_STEPS[3])
        # The weights are dequantized float32 now; without this, transformers refuses to save a
        # "quantized" model.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        bar.update()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
