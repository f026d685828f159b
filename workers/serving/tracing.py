"""The worker's span per request: queue time, prefill, decode and tokens, under the router's span.

A span opens when a generation request reaches the worker's socket, as a child of the
router's span (the `traceparent` header the router sends), and ends with the request's last
event. Its attributes name the worker (id, capability, fp8 convention, device) and carry
the engine's `RequestTimings` and token counts under the `gen_ai.*` names vLLM uses, so
trace backends' existing LLM views read them. Prompt and generated text are never recorded.
With tracing off, `start()` returns None and `end()` returns at once.
"""

from __future__ import annotations

from collections.abc import Mapping

from workers.contract import CapabilityPayload
from workers.contract.tracing import Tracing
from workers.engine.events import ErrorEvent, TokenEvent
from workers.sampling.params import SamplingParams


def worker_span_attributes(info: CapabilityPayload) -> dict:
    """What names this worker on each of its spans (the router uses the same keys)."""
    attributes = {
        "hetserve.worker.id": info.worker_id or "",
        "hetserve.worker.capability": info.device.capability or "cpu",
        "hetserve.fp8.convention": info.fp8.label or info.fp8.convention or "unknown",  # as X-Fp8-Convention
        "hetserve.device.name": info.device.name or "",
        "hetserve.device.simulated": bool(info.device.simulated),
    }
    if info.model.id:
        attributes["gen_ai.response.model"] = info.model.id
    return attributes


class RequestTracer:
    """Opens and closes the worker's request spans (one per `/generate*` call)."""

    def __init__(self, tracing: Tracing, info: CapabilityPayload):
        self.tracing = tracing
        self.attributes = worker_span_attributes(info) if tracing.enabled else {}

    def start(self, path: str, headers: Mapping[str, str]):
        """The request's span (None with tracing off)."""
        if not self.tracing.enabled:
            return None
        return self.tracing.start_span(f"POST {path}", headers=headers, attributes=self.attributes)

    def end(self, span, last: TokenEvent | ErrorEvent | None, request_id: str | None = None,
            params: SamplingParams | None = None, refused: str | None = None) -> None:
        """Close `span` with what happened: finished (`last` carries `finish`), failed (an
        `ErrorEvent`), refused before it was queued, or abandoned by its client (`last` None)."""
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        if request_id is not None:
            span.set_attribute("gen_ai.request.id", request_id)
        if params is not None:
            span.set_attributes({"gen_ai.request.max_tokens": params.max_new_tokens,
                                 "gen_ai.request.temperature": float(params.temperature)})
        if refused is not None:
            span.set_status(Status(StatusCode.ERROR, refused))
        elif isinstance(last, ErrorEvent):
            span.set_status(Status(StatusCode.ERROR, last.message))
        elif last is None or last.finish is None:
            span.set_attribute("hetserve.aborted", True)  # the client went away first
        else:
            finish = last.finish
            span.set_attributes({
                "gen_ai.usage.prompt_tokens": finish.input_length,
                "gen_ai.usage.completion_tokens": finish.generated_tokens,
                "gen_ai.response.finish_reasons": [finish.reason],
            })
            t = finish.timings
            if t is not None:
                span.set_attributes({
                    "gen_ai.latency.time_in_queue": t.queue_s,
                    "gen_ai.latency.time_in_model_prefill": t.prefill_s,
                    "gen_ai.latency.time_in_model_decode": t.decode_s,
                    "gen_ai.latency.time_to_first_token": t.queue_s + t.prefill_s,
                    "gen_ai.latency.e2e": t.queue_s + t.prefill_s + t.decode_s,
                })
        span.end()
