"""lm-eval (the `lm_eval` harness) against a real `hetserve serve` on the embedded model, on the
small tasks in tests/lm_eval_tasks/: a loglikelihood task through `local-completions` (prompt
scoring: token-id prompts, `echo`, `logprobs`) and a `generate_until` task through
`local-chat-completions`. The harness's numbers are checked against our own: each choice's
loglikelihood and greediness, and the accuracy, recomputed from our API's logprobs; each
generation, and the exact-match score, recomputed from our own chat requests.

The harness runs in one child process (it imports much, and seeds global RNGs), both tasks in
it, offline: the tasks read their JSONL files from tests/lm_eval_tasks/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from tests.router_harness import RouterProcess
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
HARNESS = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

url, model_dir, out = sys.argv[1:4]
tasks = TaskManager(include_path=".")
common = {"model": "default_model", "num_concurrent": 1, "max_retries": 1}
runs = {
    "choice": dict(model="local-completions", tasks=["hetserve_fortune_choice"], model_args={
        **common, "base_url": url + "/v1/completions", "tokenizer": model_dir, "tokenizer_backend": "huggingface"}),
    "chat": dict(model="local-chat-completions", tasks=["hetserve_fortune_chat"], apply_chat_template=True,
                 model_args={**common, "base_url": url + "/v1/chat/completions"}),
}
found = {}
for name, kw in runs.items():
    r = simple_evaluate(task_manager=tasks, log_samples=True, **kw)
    task = kw["tasks"][0]
    found[name] = {"results": r["results"][task], "samples": r["samples"][task]}
json.dump(found, open(out, "w"), default=str)
"""


@pytest.fixture(scope="module")
def router():
    r = RouterProcess(["--dtype", "float32"], fake=False, ready_timeout=240)
    yield r
    r.stop()
    assert not r.orphans


@pytest.fixture(scope="module")
def harness(router, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lm_eval") / "results.json"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(out.parent / "datasets")}
    proc = subprocess.run([sys.executable, "-c", HARNESS, router.url, str(DEFAULT_MODEL_DIR), str(out)],
                          cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_loglikelihood_task_matches_our_own_logprobs(router, harness):
    """Each (context, choice) loglikelihood the harness reports is the sum of our logprobs over
    the choice's tokens, its `is_greedy` says whether each was our top token, and the task's
    accuracy is the one these give."""
    tok = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    samples = harness["choice"]["samples"]
    assert len(samples) == sum(1 for _ in (TASKS / "fortune_choice.jsonl").open())
    correct = 0
    with httpx.Client(base_url=router.url, timeout=120) as client:
        for s in samples:
            doc, ours = s["doc"], []
            for k, choice in enumerate(doc["choices"]):
                context = tok.encode(doc["context"], add_special_tokens=False).ids
                whole = tok.encode(f"{doc['context']} {choice}", add_special_tokens=False).ids
                body = {"prompt": whole, "echo": True, "max_tokens": 0, "logprobs": 1}
                lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
                cont = slice(len(context), len(whole))
                total = sum(lp["token_logprobs"][cont])
                greedy = all(v == max(top.values())
                             for v, top in zip(lp["token_logprobs"][cont], lp["top_logprobs"][cont], strict=True))
                loglikelihood, is_greedy = s["resps"][k][0]
                assert float(loglikelihood) == pytest.approx(total, abs=1e-3), (doc, choice)
                assert str(is_greedy) == str(greedy)
                ours.append(total)
            correct += max(range(len(ours)), key=ours.__getitem__) == doc["answer"]
    assert harness["choice"]["results"]["acc,none"] == pytest.approx(correct / len(samples))
    assert 0 < correct  # the fortune model knows some of its proverbs


def test_generate_until_task_matches_our_own_chat_answers(router, harness):
    """Each generation the harness got is what the same chat request returns (greedy, its
    `until` strings as `stop`, cut off the text), and exact match is recomputed from them."""
    samples = harness["chat"]["samples"]
    hits = 0
    with httpx.Client(base_url=router.url, timeout=120) as client:
        for s in samples:
            (chat_json, kwargs), = s["arguments"]  # what the harness asked: the messages and its generation kwargs
            messages = json.loads(chat_json[0])
            r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": kwargs["max_gen_toks"],
                                                           "temperature": 0, "stop": kwargs["until"], "seed": 1234})
            ours = r.json()["choices"][0]["message"]["content"]
            assert s["resps"][0][0] == ours
            assert not any(u in ours for u in kwargs["until"])  # stop strings are cut off, as OpenAI does
            hits += ours.strip() == s["target"].strip()
    assert harness["chat"]["results"]["exact_match,none"] == pytest.approx(hits / len(samples))
