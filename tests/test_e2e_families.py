"""End to end, once per family: `hetserve serve --model DIR` over HTTP gives transformers' greedy tokens.

For each family of the registry, its tiny checkpoint (tests/family_checkpoints.py, written by
transformers) is served by a real router with one real CPU worker; all routers start side
by side. A greedy `/generate` with `decoder_input_details` returns the prompt's token ids
and the generated ones, which must equal transformers' `generate` on the same ids; and
`/workers` reports the architecture and what it switches on (sliding window, soft-cap,
rotary), with the KV cache's groups (a sliding group beside the full one); the hybrids
(Qwen3.5, Qwen3-Next) their linear layers, the state slots and bytes beside the KV cache, and
no prefix cache.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "olmo2", "olmo3", "granite",
            "qwen3_moe", "mixtral", "gpt_oss", "gemma4", "gemma4_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
PROMPT = "Once upon a time there was a little fox who lived near the river, and every morning it went down"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    paths = {name: make_family_checkpoint(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}

    def start(name: str) -> RouterProcess:
        return RouterProcess(["--model", str(paths[name]), "--max-batch", "4", "--canary-interval", "0"], fake=False,
                             ready_timeout=300)

    with ThreadPoolExecutor(len(FAMILIES)) as pool:
        futures = {name: pool.submit(start, name) for name in FAMILIES}
        routers = {}
        try:
            routers = {name: f.result() for name, f in futures.items()}
        finally:
            if len(routers) != len(FAMILIES):  # one failed: stop the others before raising
                for f in futures.values():
                    if f.exception() is None:
                        f.result().stop()
    yield paths, routers
    with ThreadPoolExecutor(len(routers) or 1) as pool:  # each worker's exit is its own: all at once
        list(pool.map(RouterProcess.stop, routers.values()))
    orphans = {name: r.orphans for name, r in routers.items() if r.orphans}
    assert not orphans, f"workers left running: {orphans}"


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_over_http_generates_transformers_greedy_tokens(served, name):
    paths, routers = served
    with routers[name].client(timeout=120) as c:
        r = c.post("/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": NEW_TOKENS, "details": True, "decoder_input_details": True}})
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        prompt = [t["id"] for t in details["prefill"]]
        got = [t["id"] for t in details["tokens"]]
        worker = c.get("/workers").json()["workers"][0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(paths[name], dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    eos = ref.generation_config.eos_token_id
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=eos)
    want = out[0, len(prompt):].tolist()
    assert len(prompt) > 16 and got == want, name  # the prompt is longer than the sliding window (16)
    # what the worker says it runs
    model, capacity = worker["model"], worker["capacity"]
    assert model["architecture"] == ref.config.model_type.removesuffix("_text") and model["features"]["rope"]
    layer_types = {lt["type"] for lt in model["attention"]["layer_types"]}
    windows = [g["window"] for g in capacity["kv_groups"]]
    if "sliding_window" in model["features"]:
        assert "sliding" in layer_types and model["features"]["sliding_window"] in windows
    else:
        assert layer_types == {"full"} and windows == [None]
    if name == "gemma2":
        assert model["features"]["attn_softcap"] == ref.config.attn_logit_softcapping
    if name == "phi3":
        assert model["features"]["rope"] == "longrope" and "partial_rotary" in model["features"]
    if name in ("qwen3_moe", "mixtral", "gpt_oss"):  # experts: total and active parameters per token
        feats = model["features"]
        assert feats["experts"] == f"{ref.config.num_experts_per_tok} of {ref.config.num_local_experts}"
        assert feats["parameters"] == sum(p.numel() for p in ref.parameters()) > feats["active_parameters"]
        assert "FusedMoE" in worker["kernels"], worker["kernels"]
    if name == "gemma4":  # each layer type's head dim and KV heads, the layers reading another's KV, their groups
        full, sliding = model["attention"]["layer_types"]
        assert (full["head_dim"], full["kv_heads"], full["kv_shared_layers"]) == (32, 1, {"3": 1})
        assert (sliding["head_dim"], sliding["kv_heads"], sliding["kv_shared_layers"]) == (16, 2, {"2": 0})
        assert [(g["layers"], g["kv_heads"], g["head_dim"]) for g in capacity["kv_groups"]] == [(1, 1, 32), (1, 2, 16)]
    if name.startswith("qwen3_5") or name == "qwen3_next":  # Gated DeltaNet layers: a state per sequence, no KV
        linear = model["attention"]["linear"]
        assert linear["layers"] == [0, 1, 2] and linear["kind"] == "gated_deltanet"
        assert [lt["layers"] for lt in model["attention"]["layer_types"]] == [[3]]
        # 4 running slots (--max-batch 4) and 8 spare for snapshots (workers/kv/snapshots.py) x 3 layers
        # x (conv [128, 3] + recurrent [4, 16, 16] fp32), in fp32; the prefix cache on through them
        per = 3 * (128 * 3 + 4 * 16 * 16) * 4
        assert capacity["state_slots"] == 4 and capacity["state_bytes"] == (4 + 8) * per
        snapshots = capacity["state_snapshots"]
        assert capacity["prefix_cache"] is True and (snapshots["slots"], snapshots["bytes_each"]) == (8, per)
        assert "GatedDeltaRule" in worker["kernels"], worker["kernels"]
        if name != "qwen3_5":
            assert "FusedMoE" in worker["kernels"] and model["features"]["shared_expert"] == 48
