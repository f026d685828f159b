"""What every route needs, and the dependency that hands it over.

`RouterContext` holds the run's settings, supervisor, dispatcher, metrics and stats, plus the
model facts that the workers reported (`/capability`). The app puts one on
`app.state.ctx`; routes take it through `get_ctx` and import nothing from the app module,
so the app can import every router at the top (FastAPI's "bigger applications" shape).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from fastapi import Request

from server.canary.monitor import CanaryMonitor
from server.config.settings import RouterSettings
from server.dispatch.dispatcher import Dispatcher
from server.fleet.history import WorkerStats
from server.fleet.metrics import RouterMetrics
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
    started_at: float = field(default_factory=time.time)
    _chat: ChatTemplate | None = None

    def _model_info(self) -> ModelDescription:
        """The `model` object of the first worker that has reported one."""
        for h in self.supervisor.workers.values():
            if h.info is not None and h.info.model.id:
                return h.info.model
        return ModelDescription()

    def model_id(self) -> str:
        return self._model_info().id or self.settings.model_dir.name

    def context_length(self) -> int | None:
        value = self._model_info().context_length
        return value if value is not None and value > 0 else None

    def sampling_defaults(self) -> dict:
        """The model's generation_config sampling values, as the workers reported them."""
        return dict(self._model_info().sampling_defaults)

    def chat_template(self) -> ChatTemplate:
        """Loaded once, from the model directory (or what the worker reported)."""
        if self._chat is None:
            self._chat = load_chat_template(self.settings.model_dir, self._model_info(),
                                            self.settings.special_tokens_in_content)
            logger.info("chat template from %s", self._chat.origin)
        return self._chat


def get_ctx(request: Request) -> RouterContext:
    """The route dependency: this app's `RouterContext`."""
    return request.app.state.ctx
