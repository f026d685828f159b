"""What every route needs, and the dependency that hands it over.

`RouterContext` holds the run's settings, supervisor, dispatcher, metrics and stats, the
models (server/fleet/models.py), plus the model facts that the workers reported
(`/capability`). The app puts one on `app.state.ctx`; routes take it through `get_ctx` and
import nothing from the app module, so the app can import every router at the top (FastAPI's
"bigger applications" shape). A request for one model sees it through `ModelContext`
(`ctx.model(name)`): the same methods, answered for that model (its name, context, sampling
defaults and chat template), so a route reads the same for one model or several.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from server.canary.monitor import CanaryMonitor
from server.config.settings import RouterSettings
from server.dispatch.dispatcher import Dispatcher
from server.errors import shown
from server.fleet.history import WorkerStats
from server.fleet.metrics import RouterMetrics
from server.fleet.models import ModelManager, ModelUnavailable
from server.fleet.supervisor import Supervisor
from server.protocol.chat import ChatTemplate, load_chat_template
from workers.contract import ModelDescription

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


@dataclass
class RouterContext:
    """What every route needs: settings, supervisor, dispatcher, metrics and model facts."""

    settings: RouterSettings
    supervisor: Supervisor
    dispatcher: Dispatcher
    metrics: RouterMetrics
    stats: WorkerStats | None = None  # the status page's per-worker history
    canary: CanaryMonitor | None = None  # the cross-worker numerics check
    models: ModelManager | None = None  # the models offered, where each is loaded
    started_at: float = field(default_factory=time.time)
    _chats: dict[str, ChatTemplate] = field(default_factory=dict)
    # LoRA adapters over the default model, name -> directory: `--lora`, then loads at run time
    loras: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.loras.update(self.settings.loras.adapters)

    def model(self, name: str | None = None) -> ModelContext:
        """The context of a request for model `name` (the default when None; a LoRA adapter's name:
        the default model with that adapter); `ModelUnavailable` (404) for a model this router does
        not offer (with adapters, an unknown name is never taken for the one model served)."""
        loras = list(self.loras)
        if name is not None and name in loras:
            return ModelContext(self, self.model().name, lora=name)
        if loras and name is not None and name not in self.model_names():
            raise ModelUnavailable(404, f"The model `{shown(name)}` does not exist. Models: "
                                        f"{', '.join(self.model_names())}; LoRA adapters: {', '.join(loras)}")
        resolved = self.models.resolve(name) if self.models is not None else self.settings.model_dir.name
        return ModelContext(self, resolved)

    def model_names(self) -> list[str]:
        return list(self.models.models) if self.models is not None else [self.settings.model_dir.name]

    # The default model's facts, for the routes that name no model (/health, /info, /stats).
    def model_id(self) -> str:
        return self.model().model_id()

    def context_length(self) -> int | None:
        return self.model().context_length()


@dataclass
class ModelContext:
    """What a request for one model needs: the run's context, answered for that model."""

    ctx: RouterContext
    name: str
    lora: str | None = None  # the LoRA adapter the request runs with over model `name`

    @property
    def settings(self) -> RouterSettings:
        return self.ctx.settings

    @property
    def dispatcher(self) -> Dispatcher:
        return self.ctx.dispatcher

    @property
    def metrics(self) -> RouterMetrics:
        return self.ctx.metrics

    @property
    def supervisor(self) -> Supervisor:
        return self.ctx.supervisor

    @property
    def started_at(self) -> float:
        return self.ctx.started_at

    def reported(self) -> ModelDescription:
        """The `model` object of the first worker of this model that has reported one."""
        for h in self.ctx.supervisor.workers.values():
            if h.model in (self.name, "") and h.info is not None and h.info.model.id:
                return h.info.model
        return ModelDescription()

    def _dir(self):
        models = self.ctx.models
        return models.models[self.name].entry.path if models is not None else self.ctx.settings.model_dir

    def model_id(self) -> str:
        """The name clients ask for and every answer carries (an adapter's own, as vLLM answers)."""
        return self.lora or self.name

    def context_length(self) -> int | None:
        value = self.reported().context_length
        if (value is None or value <= 0) and self.ctx.models is not None:
            value = self.ctx.models.models[self.name].ask.profile.context_length
        return value if value is not None and value > 0 else None

    def sampling_defaults(self) -> dict:
        """The model's generation_config sampling values, as its workers reported them."""
        return dict(self.reported().sampling_defaults)

    def chat_template(self) -> ChatTemplate:
        """Loaded once per model, from its directory (or what its worker reported)."""
        chat = self.ctx._chats.get(self.name)
        if chat is None:
            chat = load_chat_template(self._dir(), self.reported(), self.ctx.settings.special_tokens_in_content)
            self.ctx._chats[self.name] = chat
            logger.info("chat template of %s from %s", self.name, chat.origin)
        return chat


def get_ctx(request: Request) -> RouterContext:
    """The route dependency: this app's `RouterContext`."""
    return request.app.state.ctx
