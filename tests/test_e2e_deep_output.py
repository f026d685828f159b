"""Model output nested a thousand deep, through a real `hetserve serve` and real HTTP streams.

A client can force it: `guided_choice` (or a schema) makes the model write a tool call whose
arguments nest 1,000 arrays deep, with `tools` present so the router reads the output for
calls. `json.loads` recursed past Python's limit on that text: the non-streamed answer was a
422 that blamed the request ("The request nests too deeply"), and the stream was a 200 that
ended with no finish reason, no `[DONE]` and no error event. The embedded model's weights
with a 4,096-token context (a copy whose config says so) write the 2,000 brackets.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.router_harness import RouterProcess, sse_events
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

DEPTH = 1000
DEEP = '{"name": "get_weather", "arguments": {"a": ' + "[" * DEPTH + "]" * DEPTH + "}}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "guided_choice": [DEEP],
        "max_tokens": 2 * DEPTH + 100, "temperature": 0}
FILES = ("config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
         "tokenizer_config.json")


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    model = tmp_path_factory.mktemp("deep") / "m"
    model.mkdir()
    for name in FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, model / name)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    r = RouterProcess(["--model", str(model), "--dtype", "float32", "--compile", "off"], fake=False, ready_timeout=360)
    yield r
    r.stop()
    assert not r.orphans


def test_a_whole_answer_nested_a_thousand_deep_is_content_not_a_422(router):
    """Guards `loads`' depth bound in the splitter's `json_object` (region.py): the output
    is the model's, so it is content (no call of a listed tool with arguments this deep)."""
    r = httpx.post(f"{router.url}/v1/chat/completions", json=CHAT, timeout=300)
    assert r.status_code == 200, r.text[:300]
    (choice,) = r.json()["choices"]
    assert (choice["message"]["content"], choice["message"].get("tool_calls"), choice["finish_reason"]) == (
        DEEP, None, "stop")


def test_a_stream_nested_a_thousand_deep_ends_with_a_finish_and_done(router):
    """The same streamed: every chunk is read and the stream ends with a finish reason and
    `[DONE]`, never cut (a call begun keeps what it streamed, as streams do)."""
    r = httpx.post(f"{router.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=300)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    chunks = sse_events(r.text)
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    written = "".join((d.get("content") or "") + "".join(t["function"].get("arguments") or ""
                                                           for t in d.get("tool_calls") or ()) for d in deltas)
    assert "[" * DEPTH + "]" * DEPTH in written

