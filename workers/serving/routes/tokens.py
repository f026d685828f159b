"""`POST /tokenize` and `POST /detokenize`: the worker's tokenizer, as generation uses it.

The router's `/tokenize`, `/detokenize` (vLLM's shapes) and Anthropic's `count_tokens` ask a
worker, so a count is the count of the tokens a generation request with the same text would
be given (the same tokenizer, the same special-token handling: `add_special_tokens` true is
what `/generate` does with `inputs`). The text comes as `prompt` (vLLM's name), not `inputs`:
the router's routing reads a body's `inputs` as a prompt to be cached on the worker it picks,
and a count caches nothing. Long texts are encoded off the event loop. Token ids outside the
vocabulary are a 422 naming the first one.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from workers.contract import DetokenizeRequest, TokenizeRequest
from workers.serving.context import get_ctx
from workers.serving.errors import APIError

router = APIRouter()

_INLINE_CHARS = 4096  # longer texts are encoded on a thread


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict:
    ctx = get_ctx(request)

    def encode():
        return ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    encoding = await asyncio.to_thread(encode) if len(req.prompt) > _INLINE_CHARS else encode()
    return {"count": len(encoding.ids), "tokens": list(encoding.ids),
            "token_strs": list(encoding.tokens) if req.return_token_strs else None,
            "max_model_len": ctx.info.model.context_length}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
    ctx = get_ctx(request)
    vocab = ctx.grammars.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(422, f"`tokens` holds `{bad}`, outside the vocabulary (0 to {vocab - 1})", "validation")
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}
