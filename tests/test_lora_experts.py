"""LoRA on a mixture-of-experts model's experts, as PEFT writes it with `target_parameters`
(workers/lora/experts.py): fp32 logits within 1e-4 of PEFT's model with the adapter (unmerged and
merged), PEFT's greedy tokens through the engine beside a base row, on Qwen3-MoE and Mixtral, and
experts this server cannot add an adapter to refused at load by name."""

from __future__ import annotations

import json

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.lora_adapters import make_adapter, peft_model
from tests.test_compiled_step import make_engine
from workers.contract import WorkerConfig
from workers.lora.adapter import LoraError, read_adapter
from workers.lora.apply import LoraBatch, lora_rows
from workers.lora.worker import install_loras
from workers.model.loader import load_model
from workers.model.moe import FusedMoE
from workers.sampling.params import SamplingParams

pytest.importorskip("peft")
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    """The family's case with an adapter on its attention and every layer's experts, and one on the experts only."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_family_checkpoint(request.param, root / "base")
    both = make_adapter(base, root / "both", 5, r=4, alpha=8.0, targets=("q_proj", "v_proj"),
                        target_parameters=EXPERTS, std=0.2)
    experts = make_adapter(base, root / "experts", 6, r=2, alpha=4.0, targets=(), target_parameters=EXPERTS[1:],
                           std=0.3)
    return base, {"both": both, "experts": experts}, load_model(base, "float32")


def _ids(lm) -> torch.Tensor:
    ids = lm.tokenizer.encode("Once upon a time there was a little fox who lived near the river, and every "
                              "morning it went down to the water").ids
    return torch.tensor([ids[:18], ids[2:20]])  # [2, 18]


@pytest.mark.parametrize("name", ["both", "experts"])
def test_expert_adapters_match_peft(moe, name):
    base, dirs, lm = moe
    engine = make_engine(lm, None)
    table = install_loras(engine, WorkerConfig(socket="/tmp/unused.sock", lora=f"{name}={dirs[name]}"), lm, "cpu")
    adapter = table.acquire(name)
    table.release(name)
    assert len(adapter.experts) == sum(isinstance(m, FusedMoE) for m in lm.model.modules()) > 1  # every sparse layer
    ids = _ids(lm)
    with torch.no_grad():
        want = peft_model(base, dirs[name])(ids).logits
        plain = lm.model(ids).float()
        with lora_rows(lm.model, LoraBatch.from_rows([adapter] * ids.numel())):
            got = lm.model(ids).float()
        merged = peft_model(base, dirs[name]).merge_and_unload()(ids).logits
    assert (plain - want).abs().max() > 1e-2, "the adapter changes nothing: the test proves nothing"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(got, merged, atol=1e-4, rtol=0)
    # greedy tokens through the engine, the adapter's row beside a base row of the same prompt
    prompt = ids[0].tolist()
    streams = [engine.submit(prompt, SamplingParams.create(max_new_tokens=8), lora=lora) for lora in (name, None)]
    while engine.step():
        pass
    with torch.no_grad():
        ref = peft_model(base, dirs[name])
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
        plain_out = peft_model(base).generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                              pad_token_id=0, eos_token_id=None)
    assert [e.token_id for e in streams[0].events] == out[0, len(prompt):].tolist()
    assert [e.token_id for e in streams[1].events] == plain_out[0, len(prompt):].tolist()  # the base row's own
    lm.model.lora_state = None  # the next case installs its own table on the same model


def test_experts_an_adapter_cannot_reach_are_refused_by_name(moe, tmp_path):
    base, dirs, lm = moe
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in dirs["experts"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["mlp.gate.weight"]
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match=r"targets the parameter `mlp.gate.weight`.*Accepted `target_parameters`"):
        read_adapter("bad", bad, lm.config, lm.model, 16, torch.float32)
    fp8 = load_model(base, "float32")
    for m in fp8.model.modules():
        if isinstance(m, FusedMoE):
            m.w_gate_up.data = m.w_gate_up.data.to(torch.float8_e4m3fn)
    with pytest.raises(LoraError, match=r"cannot add adapters to them \(its experts are `torch.float8_e4m3fn` blocks"):
        read_adapter("experts", dirs["experts"], fp8.config, fp8.model, 16, torch.float32)
