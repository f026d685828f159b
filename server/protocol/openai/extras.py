"""vLLM's extra sampling fields on the OpenAI routes, honoured end to end (vLLM's names).

vLLM's own tools send them (`vllm bench serve --ignore-eos`, its evaluation harnesses), so an
OpenAI-compatible server that drops them measures or answers something else. Each becomes a
worker parameter the engine implements (workers/sampling/params.py); what each does:
docs/clients.md. `prompt_logprobs` is refused with `stream`, as vLLM refuses it. Trade-off: a
prompt token's `rank` is its place among the alternatives asked for (null when it is not one of
them), not its rank in the whole vocabulary, which the worker does not compute.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from server.protocol.base import TOKENS_MAX, EdgeRequest
from workers.contract import MAX_LOGPROBS, MAX_STOP_SEQUENCES

StopTokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class VLLMExtras(EdgeRequest):
    """The extra fields (see the module docstring); `extra_parameters` gives them in the contract's names."""

    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=TOKENS_MAX)
    stop_token_ids: list[StopTokenId] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _extras(self):
        if self.prompt_logprobs is not None and getattr(self, "stream", False):
            raise ValueError("`prompt_logprobs` is answered whole, not streamed. Accepted: `stream` false, or no "
                             "`prompt_logprobs`")
        return self

    def extra_parameters(self) -> dict:
        """The contract's fields these ask for, in its names (`min_p` is the contract's to drop
        when the request turns out greedy). OpenAI cuts a matched stop string off the text; with
        nothing to stop on but EOS, the text keeps what the worker's default keeps."""
        stopping = bool(getattr(self, "stop", None) or self.stop_token_ids or not self.skip_special_tokens)
        return {"ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids,
                "skip_special_tokens": self.skip_special_tokens, "min_p": self.min_p,
                "include_stop_str_in_output": self.include_stop_str_in_output or not stopping,
                "decoder_input_details": self.prompt_logprobs is not None,
                "prompt_top_n_tokens": self.prompt_logprobs}


def prompt_logprobs(body: dict) -> list[dict | None]:
    """vLLM's `prompt_logprobs` from a worker answer's `details.prefill`: per prompt token
    `{"<id>": {"logprob", "rank", "decoded_token"}}` for the token and its alternatives
    (the first token has none: null)."""
    out: list[dict | None] = []
    for entry in (body.get("details") or {}).get("prefill") or ():
        if entry.get("logprob") is None:
            out.append(None)
            continue
        tops = entry.get("top_tokens") or []
        ranks = {t.get("id"): k + 1 for k, t in enumerate(tops)}
        item = {str(entry["id"]): {"logprob": entry["logprob"], "rank": ranks.get(entry["id"]),
                                   "decoded_token": entry.get("text", "")}}
        for t in tops:
            item.setdefault(str(t["id"]), {"logprob": t.get("logprob"), "rank": ranks[t["id"]],
                                           "decoded_token": t.get("text", "")})
        out.append(item)
    return out
