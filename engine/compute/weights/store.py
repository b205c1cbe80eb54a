"""`WeightStore`: the models a worker process holds, so roles that use the same weights share one copy.

A worker process builds one `WeightStore` and passes it to every compute unit it hosts
(`Unit(role, UnitContext(weights=store))`); there is no module-level cache. A unit asks for its
model by key — kind of weights, model reference, device — and gets the one instance the
process holds (`acquire`), loading it on first use; it hands it back when it closes
(`release`), and the last release drops it. So the `llm` role and the `diffusion` role
of one model in one process run on the same `torch.nn.Module` objects.

With `host=HostWeights()` the store also shares CPU weights across the processes of
one host: on a miss it attaches to a copy another process published (see
`engine.compute.weights.shared`) and only loads (and publishes) when there is none.
With `device=DeviceWeights(peer)` it does the same for CUDA weights, by CUDA IPC through
the transfer plane (see `engine.compute.weights.cuda`: attached modules are the
publisher's GPU memory and valid only while the publisher process lives).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine.compute.weights.cuda import DeviceWeights, DeviceWeightsManifest
from engine.compute.weights.shared import HostWeights, SharedWeightsError, WeightsManifest

if TYPE_CHECKING:
    from engine.compute.models.loader import LoadedModel

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", WeightsManifest, DeviceWeightsManifest)


@dataclass(frozen=True, slots=True)
class WeightKey:
    """Which weights: `kind` of model ("llm", "vision_encoder", …), `ref` (a built-in name or a
    checkpoint path, plus whatever else fixes the weights, e.g. a projection size), device."""

    kind: str
    ref: str
    device: str = "cpu"
    dtype: str = "float32"

    def __str__(self) -> str:
        where = f"{self.kind}:{self.ref}@{self.device}"
        return where if self.dtype == "float32" else f"{where}:{self.dtype}"


@dataclass(slots=True)
class _Held:
    value: Any
    users: int = 0
    origin: str = "loaded"  # "loaded", "published" (loaded, then shared on the host) or "attached"
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    publisher: DeviceWeightsManifest | None = None
    """GPU weights attached by CUDA IPC: the index of the process they live in."""


class WeightStore:
    """See the module docstring. Thread-safe; a load runs once however many units ask at once."""

    def __init__(self, host: HostWeights | None = None, device: DeviceWeights | None = None) -> None:
        self.host = host
        self.device = device
        self._held: dict[WeightKey, _Held] = {}
        self._lock = threading.Lock()

    def acquire(self, key: WeightKey, load: Callable[[], Any]) -> Any:
        """The instance held under `key`, loaded with `load()` if none is; counts one user."""
        with self._lock:
            held = self._held.get(key)
            owner = held is None
            if held is None:
                held = self._held[key] = _Held(value=None)
            held.users += 1
        if owner:
            try:
                held.value = load()
            except BaseException as exc:  # handed to the threads waiting on this load, then re-raised here
                held.error = exc
                with self._lock:
                    self._held.pop(key, None)
                raise
            finally:
                held.ready.set()
        else:
            held.ready.wait()
            if held.error is not None:
                raise held.error
        return held.value

    def release(self, key: WeightKey) -> None:
        """One user is done; the last one drops the instance (its memory goes with the last reference)."""
        with self._lock:
            held = self._held.get(key)
            if held is None:
                raise KeyError(str(key))
            held.users -= 1
            if held.users <= 0:
                del self._held[key]

    def users(self, key: WeightKey) -> int:
        with self._lock:
            held = self._held.get(key)
            return held.users if held is not None else 0

    def origin(self, key: WeightKey) -> str | None:
        with self._lock:
            held = self._held.get(key)
            return held.origin if held is not None else None

    def _set_origin(self, key: WeightKey, origin: str, publisher: DeviceWeightsManifest | None = None) -> None:
        with self._lock:
            if key in self._held:
                self._held[key].origin = origin
                self._held[key].publisher = publisher

    # -- modules shared across processes -------------------------------------------------------------

    def module(self, key: WeightKey, build: Callable[[], torch.nn.Module],
               skeleton: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module:
        """A `torch.nn.Module` under `key`. With a host directory and a CPU key (a device
        directory and a CUDA key), `skeleton` (the same module class and config, built without
        weights) attaches to a published copy; otherwise `build()` makes it, and it is
        published for the next process."""

        def load() -> torch.nn.Module:
            if self._on_device(key) and skeleton is not None:
                return self._device_module(key, build, skeleton)
            if self.host is None or key.device != "cpu" or skeleton is None:
                return build().to(key.device)
            host = self.host
            return self._host_load(key, lambda manifest: host.attach(manifest, skeleton), build,
                                   lambda module: host.publish(str(key), module))

        return self.acquire(key, load)

    def llm(self, ref: str, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
        """A causal LM (built-in name or checkpoint directory) as `load_model` gives it in `dtype`,
        shared.

        Release it with `release(WeightStore.llm_key(ref, device, dtype))`."""
        key = self.llm_key(ref, device, dtype)

        def load() -> LoadedModel:
            if self._on_device(key):
                return self._device_llm(key, ref)
            if self.host is None or device != "cpu":
                return _load_llm(ref, device, dtype)
            host = self.host
            return self._host_load(key, lambda manifest: _attach_llm(host, manifest),
                                   lambda: _load_llm(ref, device, dtype),
                                   lambda loaded: host.publish(str(key), loaded.model, meta=_llm_meta(loaded, ref)))

        return self.acquire(key, load)

    def _host_load(self, key: WeightKey, attach: Callable[[WeightsManifest], T], build: Callable[[], T],
                   publish: Callable[[T], object]) -> T:
        """Attach to the copy of `key` a process of this host published; else, holding the key's host
        lock (so processes starting together load it once), look again, then build and publish it."""
        assert self.host is not None
        attached = self._host_attach(key, attach)
        if attached is not None:
            return attached
        with self.host.publishing(str(key)) as locked:
            if locked:  # another process may have published it while this one waited
                attached = self._host_attach(key, attach)
                if attached is not None:
                    return attached
            else:
                log.warning("waited too long for another process of this host to load %s: this process"
                            " loads a copy of its own", key)
            value = build()
            publish(value)
        self._set_origin(key, "published")
        return value

    def _host_attach(self, key: WeightKey, attach: Callable[[WeightsManifest], T]) -> T | None:
        assert self.host is not None
        return self._attach(key, self.host.lookup(str(key)), attach, lambda m: f"segment {m.segment}")

    def _attach(self, key: WeightKey, manifest: M | None, attach: Callable[[M], T],
                where: Callable[[M], str]) -> T | None:
        """What `attach` makes of the copy `manifest` describes (None: there is none, or it cannot
        be attached: logged, and the caller then loads a copy of its own)."""
        if manifest is None:
            return None
        try:
            value = attach(manifest)
        except SharedWeightsError as exc:
            log.warning("cannot attach %s from %s (%s): this process loads a copy of its own", key, where(manifest), exc)
            return None
        self._set_origin(key, "attached", manifest if isinstance(manifest, DeviceWeightsManifest) else None)
        return value

    @staticmethod
    def llm_key(ref: str, device: str = "cpu", dtype: str = "float32") -> WeightKey:
        return WeightKey("llm", ref, device, dtype)

    # -- CUDA weights shared across processes ------------------------------------------------------

    def _on_device(self, key: WeightKey) -> bool:
        return self.device is not None and torch.device(key.device).type == "cuda"

    def _device_attach(self, key: WeightKey, attach: Callable[[DeviceWeightsManifest], Any]) -> Any | None:
        """What `attach` makes of the copy published under `key` by a live process (see `_attach`)."""
        assert self.device is not None
        return self._attach(key, self.device.lookup(str(key)), attach, lambda m: f"the copy published by pid {m.pid}")

    def orphaned(self) -> list[str]:
        """GPU weights this process attached whose publisher is gone, as "key (pid N)": their
        memory went with that process, so whatever uses them must stop (the worker's
        heartbeat checks this and stops the worker)."""
        with self._lock:
            attached = [(key, held.publisher) for key, held in self._held.items() if held.publisher is not None]
        return [f"{key} (pid {manifest.pid})" for key, manifest in attached
                if self.device is not None and not self.device.publisher_alive(manifest)]

    def _device_module(self, key: WeightKey, build: Callable[[], torch.nn.Module],
                       skeleton: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        assert self.device is not None
        device = self.device
        module = self._device_attach(key, lambda manifest: device.attach(manifest, skeleton))
        if module is not None:
            return module
        module = build().to(key.device)
        self._device_publish(key, module, None)
        return module

    def _device_llm(self, key: WeightKey, ref: str) -> LoadedModel:
        assert self.device is not None
        device = self.device
        loaded = self._device_attach(key, lambda manifest: _attach_llm(device, manifest))
        if loaded is not None:
            return loaded
        loaded = _load_llm(ref, key.device, key.dtype)
        self._device_publish(key, loaded.model, _llm_meta(loaded, ref))
        return loaded

    def _device_publish(self, key: WeightKey, module: torch.nn.Module, meta: dict[str, Any] | None) -> None:
        """Publish a module this process loaded; one that cannot be shared is used unshared."""
        assert self.device is not None
        try:
            self.device.publish(str(key), module, meta=meta)
        except SharedWeightsError as exc:
            log.warning("cannot share %s with the other processes of this host (%s): it stays this"
                        " process's own", key, exc)
            return
        self._set_origin(key, "published")

    def close(self) -> None:
        """Drop every instance and withdraw what this process published on the host and its GPUs."""
        with self._lock:
            self._held.clear()
        if self.host is not None:
            self.host.close()
        if self.device is not None:
            self.device.close()


def _load_llm(ref: str, device: str, dtype: str = "float32") -> LoadedModel:
    from pathlib import Path

    from engine.compute.models.loader import load_model  # transformers: only where an llm is loaded

    loaded = load_model(path=ref, dtype=dtype) if Path(ref).is_dir() else load_model(name=ref, dtype=dtype)
    if device != "cpu":
        loaded.model.to(device)
    return loaded


def _llm_meta(loaded: LoadedModel, ref: str) -> dict[str, Any]:
    return {
        "ref": ref,
        "name": loaded.name,
        "model_id": loaded.model_id,
        "eos_token_ids": list(loaded.eos_token_ids),
        "architecture": type(loaded.model).__name__,
        "config": loaded.model.config.to_dict(),
    }


def _attach_llm(host: HostWeights | DeviceWeights, manifest: WeightsManifest | DeviceWeightsManifest) -> LoadedModel:
    import transformers

    from engine.compute.models.loader import LoadedModel, load_tokenizer  # as in _load_llm

    meta = manifest.meta
    model_cls = getattr(transformers, str(meta["architecture"]), None)
    if model_cls is None:
        raise SharedWeightsError(f"unknown architecture {meta['architecture']!r}")
    config_dict = dict(meta["config"])
    config = transformers.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    model = host.attach(manifest, lambda: model_cls(config))
    # The tokenizer by the model's reference: a packaged model's comes from the model cache (a name
    # is not a directory), a checkpoint's from its directory, a tiny model's is built.
    tokenizer = load_tokenizer(str(meta["ref"]))
    return LoadedModel(
        name=str(meta["name"]),
        model_id=str(meta["model_id"]),
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=tuple(int(t) for t in meta["eos_token_ids"]),
    )
