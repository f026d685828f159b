"""`/v1/embeddings` end to end: the `openai` client against a real router and worker serving a
tiny Qwen3 checkpoint that transformers wrote, given a sentence-transformers config as
Qwen3-Embedding ships one (last-token pooling, then Normalize), checked against
sentence-transformers' own vectors of the same checkpoint; `dimensions` on a
matryoshka-marked config; refusals in OpenAI's shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.family_checkpoints import make_family_checkpoint
from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow

TEXTS = ["A fortune cookie.", "The weather in Paris is sunny today", "x"]


def _embedding_checkpoint(out):
    make_family_checkpoint("qwen3", out)
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    config = json.loads((out / "config.json").read_text())
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config["hidden_size"], "pooling_mode_lasttoken": True,
        "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False, "include_prompt": True}))
    (out / "2_Normalize").mkdir()
    (out / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}, indent=2))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _embedding_checkpoint(tmp_path_factory.mktemp("qwen3-embedding"))


@pytest.fixture(scope="module")
def router(ckpt):
    r = RouterProcess(["--model", str(ckpt), "--dtype", "float32", "--task", "embed"], fake=False, ready_timeout=120)
    yield r
    r.stop()
    assert not r.orphans


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(ckpt):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(ckpt), device="cpu")
    return [model.encode(t, convert_to_numpy=True) for t in TEXTS]  # one at a time: no padding


def test_vectors_equal_sentence_transformers_pooling_of_the_same_checkpoint(client, reference):
    import numpy as np

    r = client.embeddings.create(model="m", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list"
    for got, want in zip(r.data, reference, strict=True):
        np.testing.assert_allclose(np.array(got.embedding), want, atol=1e-4)
        assert abs(np.linalg.norm(got.embedding) - 1.0) < 1e-5
    floats = client.embeddings.create(model="m", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, r.data[0].embedding, atol=1e-6)
    assert r.usage.prompt_tokens == r.usage.total_tokens > floats.usage.prompt_tokens > 0


def test_dimensions_cuts_a_matryoshka_vector_and_normalises_it_again(client, reference):
    import numpy as np

    r = client.embeddings.create(model="m", input=TEXTS[1], dimensions=16)
    cut = reference[1][:16] / np.linalg.norm(reference[1][:16])
    np.testing.assert_allclose(np.array(r.data[0].embedding), cut, atol=1e-4)


def test_token_ids_embed_as_their_text_does(client, router):
    import numpy as np

    text = client.embeddings.create(model="m", input=TEXTS[0], encoding_format="float").data[0].embedding
    ids = httpx.post(f"{router.url}/tokenize", json={"prompt": TEXTS[0]}, timeout=30).json()["tokens"]
    by_ids = client.embeddings.create(model="m", input=[ids], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(by_ids, text, atol=1e-6)


def test_bad_input_is_refused_in_openais_shape_naming_it(client, router):
    """Guards `EmbedRequest._unicode` in workers/serving/routes/embed.py: a lone surrogate is a 422
    naming the input (the tokenizer raised, a 500, before)."""
    reply = httpx.post(f"{router.url}/v1/embeddings", content=b'{"model": "m", "input": ["ok", "\\ud800"]}',
                       headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 422 and "`input[1]`" in reply.json()["error"]["message"], reply.text
    for kw, error, needle in ((dict(input=[]), openai.UnprocessableEntityError, "`input`"),
                              (dict(input="x", dimensions=10_000), openai.UnprocessableEntityError, "`dimensions`"),
                              (dict(input=[[10**8]]), openai.UnprocessableEntityError, "`100000000`"),
                              (dict(input="x", extra_body={"truncate_prompt_tokens": 3}), openai.BadRequestError,
                               "`truncate_prompt_tokens`")):
        with pytest.raises(error) as e:
            client.embeddings.create(model="m", encoding_format="float", **kw)
        assert needle in e.value.message, (kw, e.value.message)


def test_embeddings_count_as_running_and_stop_when_their_client_leaves(router):
    """Guards `engine.side_work()` and `stop.set()` in workers/serving/routes/embed.py: a request of
    many inputs shows as running in `/workers` while it runs, and once its client has gone the
    worker stops embedding (before, it ran all 2,048 inputs to the end, unseen in `/workers`)."""
    import threading
    import time

    counted = "hetserve_worker_embedding_inputs_total"
    before = router.metric(counted) or 0.0
    body = {"model": "m", "input": [list(range(10, 310))] * 2048, "encoding_format": "float"}
    seen_running = []

    def leave_early():
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{router.url}/v1/embeddings", json=body, timeout=httpx.Timeout(30, read=1.5))

    client = threading.Thread(target=leave_early)
    client.start()
    while client.is_alive():
        seen_running.append(router.metric("hetserve_worker_running_requests"))
        time.sleep(0.1)
    client.join()
    assert max(seen_running) == 1, seen_running  # the worker's own count of what it runs
    router.wait_for(lambda: router.metric("hetserve_worker_running_requests") == 0, timeout=10)
    stopped_at = router.metric(counted)
    time.sleep(1.0)
    assert router.metric(counted) == stopped_at, "the worker kept embedding after its client left"
    assert stopped_at - before < 2048, (before, stopped_at)


def test_task_generate_refuses_embeddings_by_name():
    r = RouterProcess(["--simulate", "sm_80", "--task", "generate"])
    try:
        reply = httpx.post(f"{r.url}/v1/embeddings", json={"model": "m", "input": "x"}, timeout=30)
        assert reply.status_code == 400 and "`--task generate`" in reply.json()["error"]["message"]
    finally:
        r.stop()
