"""The workflows app. Its AppConfig owns the process's engine objects (`StudioEngine`):
the kind catalogue, the `RunService`, the deployments it hosts and the metrics history. They are built once in
`ready()` from `settings.OMNIFLOW` and reached through `engine()`; nothing else holds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.apps import AppConfig, apps
from django.conf import settings

from studio.workflows.sockets import SocketSlots

if TYPE_CHECKING:
    from engine.client.plane import PromptTokenizer
    from engine.spec.kinds import KindRegistry
    from engine.spec.ops import OpConfig
    from studio.config import StudioConfig
    from studio.workflows.chat.templates import ChatTemplates
    from studio.workflows.deployments.embedded import EmbeddedDeployments
    from studio.workflows.history import MetricsSampler
    from studio.workflows.runs.service import RunService


@dataclass(frozen=True, slots=True)
class StudioEngine:
    config: StudioConfig
    kinds: KindRegistry
    ops: OpConfig
    """The ops this studio's runs may name: the registered ones, and module ops only with
    `OMNIFLOW_ALLOW_MODULE_OPS` (validation, in-process units and the workers it starts)."""
    runs: RunService
    deployments: EmbeddedDeployments
    """Coroutines to run on `runs.call(...)`: the engine loop owns the deployments' workers."""
    templates: ChatTemplates
    """The chat templates of the models chat deployments run, loaded once per model."""
    history: MetricsSampler
    """The workers' metrics over time: its `store`, and the sampler that fills it once started."""
    prompt_tokenizer: PromptTokenizer
    """The llm roles' tokenizers, loaded once per model, for KV-aware routing of text prompts."""
    sockets: SocketSlots
    """The WebSockets each user holds open in this process, within their quota."""


def build_engine(config: StudioConfig) -> StudioEngine:
    from engine.client.models import RoleTokenizers
    from engine.spec.kinds import default_kinds
    from engine.spec.ops import OpConfig, default_ops
    from engine.spec.userfiles import UsersRoot
    from studio.workflows.chat.templates import ChatTemplates
    from studio.workflows.deployments.embedded import EmbeddedDeployments
    from studio.workflows.history import build_sampler
    from studio.workflows.runs.bus import ChannelLayerRunEventBus, LocalRunEventBus
    from studio.workflows.runs.service import RunService

    kinds = default_kinds()
    ops = OpConfig(default_ops(), allow_module_ops=config.allow_module_ops)
    bus = ChannelLayerRunEventBus() if config.redis_url else LocalRunEventBus()
    prompt_tokenizer = RoleTokenizers()
    deployments = EmbeddedDeployments(config, kinds, prompt_tokenizer)
    runs = RunService(kinds, bus, ops=ops, deployments=deployments, lease_s=config.run_lease_s,
                      lease_retries=config.run_lease_retries, max_runs=config.max_runs,
                      users=UsersRoot(config.users_root))
    return StudioEngine(config=config, kinds=kinds, ops=ops, runs=runs, deployments=deployments,
                        templates=ChatTemplates(), history=build_sampler(config, runs, deployments),
                        prompt_tokenizer=prompt_tokenizer, sockets=SocketSlots(config.quotas.websockets))


class WorkflowsConfig(AppConfig):
    name = "studio.workflows"
    label = "workflows"
    verbose_name = "Workflows and runs"
    default_auto_field = "django.db.models.BigAutoField"

    engine: StudioEngine | None = None

    def ready(self) -> None:
        self.engine = build_engine(settings.OMNIFLOW)

    def install(self, studio: StudioEngine) -> StudioEngine:
        """Replace this process's engine objects (tests, embedding); returns the previous ones,
        which the caller stops or puts back."""
        previous, self.engine = self.engine, studio
        assert previous is not None
        return previous


def engine() -> StudioEngine:
    """This process's engine objects (built when Django starts)."""
    config = apps.get_app_config("workflows")
    assert isinstance(config, WorkflowsConfig) and config.engine is not None, "Django is not set up"
    return config.engine
