"""LoRA over projections that are not `nn.Linear`: a model quantized to fp8 (and likewise int4 and
packed GGUF layers, which expose the same `in_features` / `out_features`) gets its adapters' pairs
added after each quantized projection, as over float ones."""

from __future__ import annotations

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.lora_adapters import make_adapter
from workers.contract import WorkerConfig
from workers.lora.apply import LoraBatch, lora_rows
from workers.lora.worker import build_loras
from workers.model.loader import load_model
from workers.quant.fp8_convention import EMULATED_E4M3
from workers.quant.quantize_model import Fp8Linear, quantize_model

pytest.importorskip("peft")


def test_an_fp8_models_projections_take_the_adapter(tmp_path):
    """Guards `is_projection` in workers/lora/apply.py `install_lora` and workers/lora/pool.py (before,
    only `nn.Linear` was hooked and pooled: an fp8, int4 or GGUF model's adapter failed at placement
    with a KeyError, or, hooked nowhere, changed nothing)."""
    torch.set_num_threads(1)
    base = make_family_checkpoint("llama", tmp_path / "base")
    path = make_adapter(base, tmp_path / "coder", 4, std=0.3)
    lm = load_model(base, "float32")
    quantize_model(lm.model, EMULATED_E4M3)
    wqkv = lm.model.layers[0].attention.wqkv
    assert isinstance(wqkv, Fp8Linear)
    table = build_loras(WorkerConfig(socket="/tmp/unused.sock", lora=f"coder={path}"), lm, "cpu")
    adapter = table.acquire("coder")
    # one projection: its output plus the pairs' product on the adapter's rows, the base row untouched
    x = torch.randn(3, wqkv.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = wqkv(x)
        with lora_rows(lm.model, LoraBatch.from_rows([adapter, None, adapter])):
            got = wqkv(x)
    want = plain.clone()
    for t in adapter.targets["layers.0.attention.wqkv"]:
        want[[0, 2], t.offset:t.offset + t.size] += ((x[[0, 2]] @ t.a.T) @ t.b.T) * adapter.scale
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(got[1], plain[1])
    # the whole model: the adapter's logits move, a base row beside them does not
    ids = torch.tensor([lm.tokenizer.encode("Once upon a time there was a little fox").ids])
    with torch.no_grad():
        base_logits = lm.model(ids)
        with lora_rows(lm.model, LoraBatch.from_rows([adapter] * ids.numel())):
            adapted = lm.model(ids)
    assert (adapted - base_logits).abs().max() > 1e-2
