"""API key, overload (429 + Retry-After, never a hang) and unchanged clients, over one stand-in worker."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def router():
    r = RouterProcess(["--simulate", "sm_90", "--max-batch", "1", "--max-queue", "1", "--api-key", KEY],
                      env={"FAKE_TOKEN_S": "0.01"})
    yield r
    r.stop()
    assert not r.orphans


@pytest.fixture(scope="module")
def client(router):
    with router.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_health_is_open_everything_else_needs_the_key(router, client):
    assert httpx.get(f"{router.url}/health").status_code == 200
    for method, path in (("GET", "/workers"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/v1/models"),
                         ("POST", "/generate"), ("POST", "/v1/chat/completions"), ("GET", "/nope")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, f"{router.url}{path}", headers=headers, json={})
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and "API key" in json_error(r)
    assert client.get("/workers").status_code == 200


def json_error(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"] if isinstance(body["error"], dict) else body["error"]


def test_overload_answers_429_with_retry_after_quickly(client):
    body = {"inputs": "x", "parameters": {"max_new_tokens": 30}}  # 0.3 s each; capacity 2

    def one(_):
        t0 = time.monotonic()
        r = client.post("/generate", json=body)
        return r.status_code, r.headers.get("retry-after"), time.monotonic() - t0, r.json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    codes = [c for c, *_ in results]
    assert codes.count(200) >= 2 and codes.count(429) >= 1, codes
    assert set(codes) <= {200, 429}
    for code, retry_after, seconds, body in results:
        if code == 429:
            assert retry_after == "1" and seconds < 1.0 and body["error_type"] == "overloaded"


def test_openai_client_works_unchanged(router):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY, max_retries=0)
    model = c.models.list().data[0].id
    assert model == "default_model"  # the model's name: its directory's (the embedded model's)
    done = c.completions.create(model=model, prompt="a b", max_tokens=3)
    assert done.choices[0].text == " t0 t1 t2" and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (2, 3, 5)
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content == " t0 t1" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 2
    raw = c.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=1)
    assert raw.headers["x-worker-id"] == "gpu0" and raw.headers["x-fp8-convention"] == "native_e4m3"
    chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == " t0 t1 t2"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 3
    stream = list(c.completions.create(model=model, prompt="p", max_tokens=2, stream=True))
    assert "".join(ch.choices[0].text for ch in stream) == " t0 t1"
    with pytest.raises(openai.UnprocessableEntityError, match="`suffix`"):  # a field this server cannot honour
        c.completions.create(model=model, prompt="p", max_tokens=2, suffix="!")


def test_huggingface_inference_client_works_unchanged(router):
    hub = pytest.importorskip("huggingface_hub")
    c = hub.InferenceClient(model=router.url, token=KEY)
    assert c.text_generation("a b", max_new_tokens=3) == " t0 t1 t2"
    out = c.text_generation("a b", max_new_tokens=2, details=True)
    assert out.generated_text == " t0 t1" and out.details.generated_tokens == 2
    assert "".join(c.text_generation("a", max_new_tokens=3, stream=True)) == " t0 t1 t2"
    streamed = list(c.text_generation("a", max_new_tokens=2, stream=True, details=True))
    assert streamed[-1].details.finish_reason == "length"
