"""fp8 weight quantization: what is swapped, buffers in the worker's convention, native and
emulated giving identical logits, the kernel chosen for the device, and greedy agreement
with the unquantized model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from workers.device.bind import BoundDevice
from workers.kernelize.apply import kernelize_for_device
from workers.model.transformer import Transformer
from workers.quant.fp8_convention import EMULATED_E4M3, NATIVE_E4M3, choose_fp8
from workers.quant.quantize_model import Fp8KernelMismatchError, Fp8Linear, quantize_model

TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def tiny_model(dtype=torch.float32, **overrides) -> Transformer:
    from workers.model.config import ModelConfig

    return Transformer.random(ModelConfig(**{**TINY, **overrides}), dtype=dtype, seed=7, std=0.3)


def simulated(device_type: str, cap) -> BoundDevice:
    return BoundDevice(device_type, 0, "GPU-sim", "sim", cap, 0, True)


def _ids(seed: int = 0, shape=(2, 11)) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "conv,storage",
    [(NATIVE_E4M3, torch.float8_e4m3fn), (EMULATED_E4M3, torch.uint8)],
    ids=lambda v: str(v),
)
def test_swaps_projections_with_buffers_in_the_convention(conv, storage):
    model = tiny_model()
    embedding = model.tok_embeddings.weight
    summary = quantize_model(model, conv)
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert (
        len(fp8_layers) == summary["layers"] == 4 * TINY["num_hidden_layers"]
    )  # wqkv, wo, w_gate_up, w_down
    for layer in fp8_layers:
        assert layer.qweight.dtype == storage and layer.fp8_native is conv.native
        assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (layer.out_features,)
    assert type(model.output) is nn.Linear and summary["skipped"] == ["output"]  # LM head kept
    assert model.tok_embeddings.weight is embedding
    assert summary["convention"] == conv.name and summary["storage_dtype"] == conv.storage_dtype_name
    assert summary["weight_bytes_after"] < summary["weight_bytes_before"] / 3.5  # fp32 -> 1 byte + scales


def test_lm_head_is_optional_and_ties_survive():
    tied = tiny_model(tie_word_embeddings=True)
    quantize_model(tied, EMULATED_E4M3)
    assert tied.output.weight is tied.tok_embeddings.weight
    model = tiny_model()
    summary = quantize_model(model, EMULATED_E4M3, include_lm_head=True)
    assert isinstance(model.output, Fp8Linear) and summary["skipped"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_and_emulated_give_identical_logits(dtype):
    """sm_89 (native: fp8 buffers, `torch._scaled_mm` on CPU) and sm_80 (emulated: uint8
    buffers, dequantize + matmul) from the same weights: the same bytes, the same logits."""
    base = tiny_model(dtype)
    native_model, emulated_model = copy.deepcopy(base), copy.deepcopy(base)
    kernelize_for_device(native_model, simulated("cuda", (8, 9)))
    kernelize_for_device(emulated_model, simulated("cuda", (8, 0)))
    quantize_model(native_model, choose_fp8("cuda", (8, 9))[0])
    quantize_model(emulated_model, choose_fp8("cuda", (8, 0))[0])
    for a, b in zip(native_model.modules(), emulated_model.modules(), strict=True):
        if isinstance(a, Fp8Linear):
            assert a.qweight.dtype == torch.float8_e4m3fn and b.qweight.dtype == torch.uint8
            assert torch.equal(a.qweight.view(torch.uint8), b.qweight)
    with torch.no_grad():
        native, emulated = native_model(_ids()), emulated_model(_ids())
        assert torch.equal(native, emulated)
        # the unkernelized reference forward agrees with both
        reference = copy.deepcopy(base)
        quantize_model(reference, NATIVE_E4M3)
        torch.testing.assert_close(reference(_ids()), native, rtol=0, atol=0)


def test_the_devices_fp8_kernel_is_installed():
    from kernels import LocalLayerRepository

    from kernels_local.mapping import REPO_ROOT

    model = tiny_model()
    kernelize_for_device(model, simulated("cuda", (9, 0)))
    summary = quantize_model(model, NATIVE_E4M3)
    assert summary["kernel"]["layer"] == "Fp8LinearTritonNativeSm90"
    chosen = LocalLayerRepository(
        repo_path=REPO_ROOT / "fp8_linear", layer_name="Fp8LinearTritonNativeSm90"
    ).load()
    assert all(m.forward.__func__ is chosen.forward for m in model.modules() if isinstance(m, Fp8Linear))


def test_a_kernel_of_the_other_convention_is_refused():
    model = tiny_model()
    kernelize_for_device(model, simulated("cuda", (9, 0)))  # native kernel chosen
    with pytest.raises(Fp8KernelMismatchError, match="`native_e4m3-triton`.*`emulated`"):
        quantize_model(model, EMULATED_E4M3)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())  # nothing swapped


def _greedy(model, prompts: int = 8, prompt_len: int = 6, new_tokens: int = 20) -> torch.Tensor:
    """Greedy continuations of random prompts, batched: [prompts, prompt_len + new_tokens]."""
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, model.config.vocab_size, (prompts, prompt_len), generator=gen)
    with torch.no_grad():
        for _ in range(new_tokens):
            seqs = torch.cat([seqs, model(seqs)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seqs


def _agreement(model, seqs: torch.Tensor, prompt_len: int = 6) -> tuple[int, int]:
    """Teacher-forced: how often `model`'s argmax equals each sequence's next token."""
    with torch.no_grad():
        got = model(seqs)[:, prompt_len - 1 : -1].argmax(-1)  # [P, new_tokens]
    return int((got == seqs[:, prompt_len:]).sum()), got.numel()


def test_greedy_agreement_with_bf16(tmp_path, record_property):
    """fp8 (native, sm_90 kernels) vs the same bf16 test checkpoint (tests/checkpoints.py),
    teacher-forced along the bf16 model's own greedy continuations; bf16 vs fp32 is printed
    beside it as the noise floor. A random checkpoint has flat logits: for trained models
    this is a lower bound."""
    from tests.checkpoints import make_checkpoint
    from workers.model.loader import load_model

    ckpt = make_checkpoint(tmp_path / "ckpt", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    bf16 = load_model(ckpt, "bfloat16").model
    fp32 = load_model(ckpt, "float32").model
    quant = copy.deepcopy(bf16)
    kernelize_for_device(quant, simulated("cuda", (9, 0)))
    quantize_model(quant, NATIVE_E4M3)
    seqs = _greedy(bf16)
    agree, total = _agreement(quant, seqs)
    floor, _ = _agreement(fp32, seqs)
    rate = agree / total
    record_property("fp8_vs_bf16_greedy_agreement", rate)
    print(
        f"greedy agreement with bf16: fp8 {agree}/{total} = {rate:.3f}; fp32 {floor}/{total} = {floor / total:.3f}"
    )
    assert rate >= 0.75
