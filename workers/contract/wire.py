"""The other bodies the router sends a worker: tokenize, detokenize, embed, and a channel's aborts.

Design: like `WorkerRequest` (workers/contract/request.py), each is one frozen pydantic value
defined here and nowhere else: the router builds it at its edge, the worker's route takes it
as its body. `WireRequest` names every shape that may cross, and the router's worker client
sends nothing else. These refuse unknown fields (only the router sends them); the generation
request ignores them, as TGI does, since a TGI client may be pointed at a worker.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from workers.contract.limits import valid_unicode
from workers.contract.request import WorkerRequest

MAX_EMBED_INPUTS = 2048  # texts in one embeddings request (OpenAI's limit)
MAX_TOKENIZE_CHARS = 4_000_000  # characters one `/tokenize` prompt may hold
POOLINGS = ("last", "mean", "cls")
_BODY = ConfigDict(frozen=True, extra="forbid")


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: the token ids a generation request with this text would be given. The
    text is `prompt` (vLLM's name), not `inputs`: routing reads a generation's `inputs` as a
    prompt to cache on the worker it picks, and a count caches nothing."""

    model_config = _BODY

    prompt: str = Field(max_length=MAX_TOKENIZE_CHARS)
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _unicode(cls, value: str) -> str:
        return valid_unicode(value, "prompt")


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: the text of token ids."""

    model_config = _BODY

    tokens: tuple[StrictInt, ...] = Field(max_length=1_000_000)


class EmbedRequest(BaseModel):
    """`POST /embed`: one vector per text (or token ids), pooled as the checkpoint says."""

    model_config = _BODY

    inputs: tuple[StrictStr | tuple[StrictInt, ...], ...] = Field(min_length=1, max_length=MAX_EMBED_INPUTS)
    pooling: Literal["last", "mean", "cls"] = "last"
    normalize: StrictBool = True
    dimensions: StrictInt | None = Field(None, ge=1)

    @field_validator("inputs")
    @classmethod
    def _unicode(cls, value: tuple) -> tuple:
        """A lone surrogate cannot be encoded: a 422 naming the input, never a 500."""
        for k, item in enumerate(value):
            if isinstance(item, str):
                valid_unicode(item, f"input[{k}]")
        return value


class AbortStreams(BaseModel):
    """`POST /streams/abort`: streams of a channel whose clients left (workers/serving/channel.py)."""

    model_config = _BODY

    channel: str
    streams: tuple[StrictInt, ...]


class LoraAdapterRequest(BaseModel):
    """`POST /lora/load` and `/lora/unload` (vLLM's `/v1/load_lora_adapter` body): the adapter's
    name and, to load it, its PEFT directory (workers/lora/)."""

    model_config = _BODY

    lora_name: StrictStr
    lora_path: StrictStr | None = None


WireRequest = WorkerRequest | TokenizeRequest | DetokenizeRequest | EmbedRequest | AbortStreams | LoraAdapterRequest


def wire_bytes(body: WireRequest) -> bytes:
    """The JSON a worker receives for `body`: the fields its sender set (the receiver's contract
    fills in the same defaults). A dict, or any value not declared here, is a `TypeError`: the
    contract's shapes are the only ones that cross."""
    if not isinstance(body, WireRequest):
        raise TypeError(f"`{type(body).__name__}` is not a request the contract declares. Accepted: "
                        f"{', '.join(t.__name__ for t in WireRequest.__args__)}")
    return body.model_dump_json(exclude_unset=True).encode()
