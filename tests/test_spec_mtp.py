"""`--speculative mtp`: a tiny random Qwen3.5 checkpoint given `mtp.*` tensors (named as Qwen3.5's
checkpoints name them) loads its MTP head, whose forward is the published formula, and its drafts
leave greedy output as plain decoding's, bit for bit in deterministic mode; a checkpoint without
them is refused by name, by the worker and by the router."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.family_checkpoints import make_family_checkpoint
from workers.engine.core import Engine
from workers.engine.mtp import MtpDrafter
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.speculate import speculator_for
from workers.model.deterministic import enable_deterministic
from workers.model.loader import load_model
from workers.model.mtp import load_mtp
from workers.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
FULL_LAYER = 3  # the tiny hybrid's full-attention layer, whose tensors the MTP layer starts from


def with_mtp(model_dir: Path, seed: int = 0) -> Path:
    """Add an MTP head to a checkpoint: its layer the full-attention layer's tensors perturbed, a random
    `fc`, and norms (the model's final one too) near Qwen3.5's `(1 + w)` identity."""
    sd = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    h = sd["model.embed_tokens.weight"].shape[1]
    prefix = f"model.layers.{FULL_LAYER}."
    for name in [n for n in sd if n.startswith(prefix)]:
        t = sd[name]
        sd["mtp.layers.0." + name[len(prefix):]] = t + 0.02 * torch.randn(t.shape, generator=gen)
    sd["mtp.fc.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    for norm in ("mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "model.norm"):
        sd[f"{norm}.weight"] = 0.1 * torch.randn(h, generator=gen)  # the model's final norm not 1 either
    save_file(sd, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return with_mtp(make_family_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5_mtp")))


@pytest.fixture(scope="module")
def lm(checkpoint):
    torch.set_num_threads(1)
    lm = load_model(checkpoint, "float32")
    enable_deterministic(lm.model)
    return lm


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def test_the_head_is_the_published_formula(lm, checkpoint):
    """logits = lm_head(norm(layer(fc([norm_e(embed(x_{p+1})) | norm_h(h_p)])))), the layer a full-attention
    decoder layer of the family as transformers runs it, loaded from `mtp.layers.0.*`."""
    import transformers

    head = load_mtp(lm.model, checkpoint)
    sd = load_file(checkpoint / "model.safetensors")
    cfg = transformers.AutoConfig.from_pretrained(checkpoint)
    cfg.num_hidden_layers, cfg.layer_types = 1, ["full_attention"]
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ref.load_state_dict({**{"model." + k[4:]: v for k, v in sd.items() if k.startswith("mtp.layers.")},
                         "model.norm.weight": sd["mtp.norm.weight"],
                         "model.embed_tokens.weight": sd["model.embed_tokens.weight"],
                         "lm_head.weight": sd["lm_head.weight"]}, strict=True)
    gen = torch.Generator().manual_seed(1)
    hidden, ids = torch.randn(9, 64, generator=gen), torch.randint(3, 4096, (9,), generator=gen)
    eps = cfg.rms_norm_eps
    x = torch.cat((_rms(sd["model.embed_tokens.weight"][ids], sd["mtp.pre_fc_norm_embedding.weight"], eps),
                   _rms(hidden, sd["mtp.pre_fc_norm_hidden.weight"], eps)), dim=-1) @ sd["mtp.fc.weight"].T
    positions = torch.arange(5, 14)
    with torch.no_grad():
        want = ref(inputs_embeds=x[None], position_ids=positions[None]).logits[0]
        logits, out = head(hidden, ids, positions)
    torch.testing.assert_close(logits, want[-1], atol=1e-4, rtol=1e-4)
    assert out.shape == (9, 64)


def serve(lm, prompts, drafter=None):
    pool = lm.model.new_kv_pool(96, 4, state_slots=len(prompts))
    config = SchedulerConfig(len(prompts), 512, 96, 4, 256, False, eos_token_ids=(), state_slots=len(prompts))
    scheduler = Scheduler(config)
    speculator = None if drafter is None else speculator_for("mtp", 3, scheduler, mtp=drafter)
    engine = Engine(ModelRunner(lm.model, pool, "cpu", mirror=False), scheduler, lm.tokenizer, max_queue=8,
                    speculator=speculator)
    streams = [engine.submit(lm.tokenizer.encode(p).ids, SamplingParams.create(max_new_tokens=16)) for p in prompts]
    while engine.step():
        pass
    return [[(e.token_id, e.logprob) for e in s.events] for s in streams], engine


def test_mtp_drafts_keep_greedy_output_bit_for_bit_and_report_acceptance(lm, checkpoint):
    prompts = ["Once upon a time there was a little fox", "def main(): print('hello') return 0"]
    plain, _ = serve(lm, prompts)
    spec, engine = serve(lm, prompts, MtpDrafter(lm.model, load_mtp(lm.model, checkpoint)))
    assert spec == plain
    described = engine.speculation()
    assert described["method"] == "mtp" and described["drafts"] > 0 and described["draft_tokens"] > 0
    assert 0 <= described["acceptance_rate"] <= 1


def test_drafts_come_from_the_models_own_hidden_states(lm, checkpoint):
    """The drafter's hidden states (tapped from the engine's steps, prompt chunk and decode rows) are
    the full forward's after the final norm, and its first draft is the head's over those. Guards the
    tap and `capture` (the final norm, rows in chunk order)."""
    drafter = MtpDrafter(lm.model, load_mtp(lm.model, checkpoint), window=8)
    seen = []
    propose = drafter.propose

    def record(seq, k):
        drafts = propose(seq, k)
        if k:
            t = seq.num_computed
            seen.append((seq.token_ids()[: t + 1], drafts, drafter._hidden[seq.uid][:t].clone()))
        return drafts

    drafter.propose = record
    serve(lm, ["Once upon a time there was a little fox"], drafter)
    taken = []
    hook = lm.model.norm.register_forward_hook(lambda m, a, out: taken.append(out))
    try:
        for ids, drafts, kept in seen[:3]:
            taken.clear()
            with torch.no_grad():
                lm.model(torch.tensor([ids]))
            t = len(ids) - 1
            h, start = taken[0][0], max(0, t - 8)
            torch.testing.assert_close(kept, h[:t], atol=1e-4, rtol=1e-4)  # every position, prompt and output
            logits, _ = drafter.head(h[start:t], torch.tensor(ids[start + 1:]), torch.arange(start, t))
            assert drafts and drafts[0] == int(logits.argmax())
    finally:
        hook.remove()
    assert len(seen) >= 3


def test_a_checkpoint_without_mtp_tensors_is_refused_by_name(tmp_path):
    plain = make_family_checkpoint("qwen3_5", tmp_path / "plain")
    lm = load_model(plain, "float32")
    assert load_mtp(lm.model, plain) is None
    with pytest.raises(ValueError, match=r"`--speculative mtp` needs a checkpoint that ships an MTP head"):
        speculator_for("mtp", 4, Scheduler(SchedulerConfig(2, 512, 96, 4, 256, False, state_slots=2)))
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(plain), "--speculative", "mtp"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "`--speculative mtp`" in out.stderr and "`mtp.*`" in out.stderr and "Accepted for it:" in out.stderr


@pytest.mark.slow
def test_a_worker_serves_with_its_checkpoints_mtp_head(checkpoint):
    """`hetserve serve --speculative mtp` on a checkpoint with an MTP head: the worker loads it (every
    step eager), answers, and `/workers` shows the head drafting."""
    from tests.router_harness import RouterProcess

    router = RouterProcess(["--model", str(checkpoint), "--dtype", "float32", "--max-batch", "2",
                            "--speculative", "mtp", "--num-speculative-tokens", "2"], fake=False, ready_timeout=240)
    try:
        with router.client(timeout=120) as c:
            r = c.post("/generate", json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 24}})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 30
            while True:  # /workers shows what the router's last /health probe of the worker said
                described = c.get("/workers").json()["workers"][0]["speculative"]
                if described.get("drafts") or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        assert described["method"] == "mtp" and described["drafts"] > 0
        assert described["acceptance_rate"] is not None
    finally:
        router.stop()
    assert not router.orphans
