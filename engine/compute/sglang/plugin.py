"""The `sglang.srt.plugins` entry point: `--sampling-backend omniflow` and
`--disaggregation-transfer-backend omniflow`.

SGLang 0.5.23 calls `register()` through `sglang.srt.plugins.load_plugins()` in every process
it starts (engine, scheduler, detokenizer), then applies the hooks registered with its
`HookRegistry`. The sampler has a registry of its own (`register_sampler_backend`); the
transfer backend does not: `get_kv_class` maps a closed `TransferBackend` enum to classes with
an if/elif chain. So for the transfer backend `register()`

* adds `omniflow` to the CLI choices (`add_disagg_transfer_backend_choices`, SGLang's
  extension point for them),
* replaces `TransferBackend` with the same enum plus `OMNIFLOW = "omniflow"` (a class
  REPLACE hook: `HookRegistry` rebinds every module that imported the old class), and
* wraps `get_kv_class` (an AROUND hook) to answer our classes for `omniflow` and defer to
  SGLang for every other backend.

Called outside `load_plugins()`, the hooks take effect at the next
`HookRegistry.apply_hooks()`.
"""

from __future__ import annotations

import enum
from typing import Any

from engine.compute.sglang import sampler

TRANSFER_BACKEND = "omniflow"


def register() -> None:
    """Register the omniflow sampler and transfer backends with SGLang (idempotent)."""
    sampler.register()
    register_transfer_backend()


def register_transfer_backend(name: str = TRANSFER_BACKEND) -> None:
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if name in DISAGG_TRANSFER_BACKEND_CHOICES:
        return
    add_disagg_transfer_backend_choices([name])
    HookRegistry.register(f"{utils.__name__}.TransferBackend", extended_backend_enum(utils.TransferBackend, name),
                          HookType.REPLACE)
    HookRegistry.register(f"{utils.__name__}.get_kv_class", _kv_class_hook(name), HookType.AROUND)


def extended_backend_enum(backends: type[enum.Enum], name: str) -> type[enum.Enum]:
    """SGLang's `TransferBackend` members plus `name` (same class name and module)."""
    members = {member.name: member.value for member in backends}
    members[name.upper()] = name
    return enum.Enum(backends.__name__, members, module=backends.__module__, qualname=backends.__qualname__)


def _kv_class_hook(name: str) -> Any:
    def get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
        if getattr(transfer_backend, "value", transfer_backend) != name:
            return original(transfer_backend, class_type)
        from sglang.srt.disaggregation.base.conn import KVArgs

        from engine.compute.sglang.transfer import KV_CLASSES

        if class_type.value == "kvargs":
            return KVArgs
        return KV_CLASSES.get(class_type.value)

    return get_kv_class
