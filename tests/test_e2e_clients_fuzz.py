"""Schema fuzzing of the routes the 2026 clients use (Responses, Messages, embeddings, the
tokenizer routes) against a real `hetserve serve` on the embedded model: schemathesis sends
requests generated from /openapi.json, and no answer may be a 5xx; every refusal is a 4xx in
its protocol's shape (OpenAI's `error` object, Anthropic's `type: error`)."""

from __future__ import annotations

import pytest

from tests.router_harness import running_router
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

PATHS = ("/v1/responses", "/v1/responses/{response_id}", "/v1/messages", "/v1/messages/count_tokens",
         "/v1/embeddings", "/tokenize", "/detokenize")


@pytest.fixture(scope="module")
def router():
    yield from running_router(["--dtype", "float32", "--max-batch", "8"], fake=False, ready_timeout=240)


def _shaped(path: str, body) -> bool:
    """The error body is the protocol's own."""
    if not isinstance(body, dict):
        return False
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and isinstance(body.get("error"), dict) and "message" in body["error"]
    return isinstance(body.get("error"), dict) and "message" in body["error"]


def test_schema_fuzzing_of_the_client_routes_finds_no_server_error(router):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{router.url}/openapi.json")
    failures, seen = [], set()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path not in PATHS:
            continue
        seen.add(operation.path)

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(base_url=router.url, timeout=120)
            if response.status_code >= 500:
                failures.append((case.method, case.path, response.status_code, response.text[:300]))
            elif response.status_code >= 400:
                try:
                    body = response.json()
                except ValueError:
                    body = None
                if not _shaped(case.path, body):
                    failures.append((case.method, case.path, response.status_code, response.text[:300]))

        fuzz()
    assert seen == set(PATHS)
    assert not failures, sorted(set(failures))[:10]
    with router.client() as c:
        assert c.get("/health").json()["status"] == "ok"  # the fuzzing crashed no worker
