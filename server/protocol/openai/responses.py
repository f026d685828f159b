"""OpenAI response objects built from the workers' TGI-shaped answers (pure functions).

Workers speak TGI; the OpenAI routes translate: `generated_text` -> choice text,
`details.finish_reason` `length` -> `length`, `eos_token`/`stop_sequence` -> `stop` (and
`tool_calls` when the output became tool calls), `details.input_length` / `generated_tokens`
-> `usage`. Special tokens (EOS) are dropped from text and streamed deltas, as from TGI's
`generated_text`, but keep their logprob entry (an evaluation harness counts entries: `echo`
with `max_tokens` = 1 must end with exactly one generated entry). Logprob entries take OpenAI's
shapes (docs/serving.md); a token's `token` is its own bytes as text, or `bytes:\\xNN...` when
they are not valid UTF-8 on their own. Trade-off: one translation for every OpenAI route, so the
workers keep a single answer shape whatever protocol asked.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(details: dict | None) -> str | None:
    if not details:
        return None
    return "length" if details.get("finish_reason") == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# --- logprobs ------------------------------------------------------------------------------
def token_str(raw: Iterable[int] | None, fallback: str = "") -> str:
    """A token's text for logprobs: its bytes as UTF-8, else `bytes:\\xNN...`."""
    if raw is None:
        return fallback
    b = bytes(raw)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def _bytes(d: dict) -> list[int]:
    return d["bytes"] if d.get("bytes") is not None else list(d.get("text", "").encode())


def chat_logprob_entries(tokens: list[dict], tops: list[list[dict] | None]) -> list[dict]:
    """Chat `logprobs.content` items for worker token dicts and their alternatives."""
    return [{"token": token_str(t.get("bytes"), t.get("text", "")), "logprob": t.get("logprob"), "bytes": _bytes(t),
             "top_logprobs": [{"token": token_str(a.get("bytes"), a.get("text", "")), "logprob": a.get("logprob"),
                               "bytes": _bytes(a)} for a in top or ()]}
            for t, top in zip(tokens, tops, strict=True)]


def completion_logprobs(tokens: list[dict], tops: list[list[dict] | None], offset: int = 0) -> dict:
    """Completion `logprobs` columns for worker token dicts (prompt ones included when echoed);
    `offset` is where the first token starts in the choice's text."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, top in zip(tokens, tops, strict=True):
        s, lp = token_str(t.get("bytes"), t.get("text", "")), t.get("logprob")
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["text_offset"].append(offset)
        offset += 0 if t.get("special") else len(s)  # special tokens are not in the text
        if lp is None:
            out["top_logprobs"].append(None)
            continue
        alts = {token_str(a.get("bytes"), a.get("text", "")): a.get("logprob") for a in top or ()}
        alts.setdefault(s, lp)
        out["top_logprobs"].append(alts)
    return out


def merge_completion_logprobs(parts: list[dict]) -> dict:
    return {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prefill_tops(prefill: list[dict]) -> list[list[dict] | None]:
    return [p.get("top_tokens") for p in prefill]


# --- objects -------------------------------------------------------------------------------
def completion(cid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def completion_choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def chat_completion(cid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def chat_choice(index: int, text: str | None, finish: str, logprobs: list[dict] | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "finish_reason": finish,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}


def completion_chunk(cid: str, created: int, model: str, choice: dict) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(cid: str, created: int, model: str, choice: dict) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


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
