"""OpenAI response objects built from the workers' TGI-shaped answers (pure functions).

Workers speak TGI; the OpenAI routes translate: `generated_text` -> choice text,
`details.finish_reason` `length` -> `length`, `eos_token`/`stop_sequence` -> `stop`,
`details.input_length` / `generated_tokens` -> `usage`. Special tokens (EOS) are dropped
from streamed deltas, as from TGI's `generated_text`.
"""

from __future__ import annotations

import json
import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(details: dict | None) -> str | None:
    if not details:
        return None
    return "length" if details.get("finish_reason") == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(cid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def completion_choice(index: int, text: str, details: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason(details) or "stop", "logprobs": None}


def chat_completion(cid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def chat_choice(index: int, text: str, details: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason(details) or "stop", "logprobs": None}


def completion_chunk(cid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def chat_chunk(cid: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def usage_chunk(cid: str, created: int, model: str, obj: str, use: dict) -> dict:
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def worker_error(content: bytes) -> tuple[str, str]:
    """(message, kind) of a worker's JSON error body."""
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode(errors="replace")[:500] or "worker error", "internal"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err)), str(err.get("type", "internal"))
        return str(err or body), str(body.get("error_type") or "internal")
    return str(body), "internal"
