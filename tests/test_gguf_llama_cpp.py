"""GGUF files quantized by llama.cpp's own quantizer (tests/llama_cpp/, written by
scripts/llama_cpp_fixtures.py from a tiny random Llama): every K- and IQ-type as llama.cpp lays its
blocks out from real weights (its scales and minimums fitted, not random bytes), mixed per tensor as
its file types mix them. Our dequantization equals gguf-py's bit for bit on every tensor, and the
Q4_K_M file served through our loader gives transformers' fp32 logits within 1e-4 and its greedy
tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from workers.gguf.dequant import dequantize  # noqa: E402
from workers.gguf.prepare import prepare  # noqa: E402
from workers.model.loader import load_model  # noqa: E402

FIXTURES = Path(__file__).parent / "llama_cpp"
FILES = sorted(FIXTURES.glob("llama-*.gguf"))
K_AND_IQ = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
TEXT = "Once upon a time there was a little fox who lived near the river, and every morning it went down."


def test_the_fixtures_hold_every_k_and_iq_type_and_were_written_by_llama_cpp():
    """Together the files hold every K- and IQ-type we dequantize, each file stamped by llama.cpp's
    quantizer (`general.file_type`, `general.quantization_version`)."""
    assert len(FILES) >= 4, FILES
    held = set()
    for path in FILES:
        reader = gguf.GGUFReader(path)
        assert "general.quantization_version" in reader.fields and "general.file_type" in reader.fields, path
        held |= {t.tensor_type.name for t in reader.tensors}
    assert held >= K_AND_IQ, sorted(held)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_tensor_dequantizes_as_gguf_py_does_bit_for_bit(path):
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name in ("F32", "F16"):
            continue
        raw = np.asarray(t.data)
        want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, t.tensor_type)))
        got = dequantize(torch.from_numpy(np.array(raw)), t.tensor_type.name, tuple(want.shape))
        assert torch.equal(got.float(), want.float()), (path.name, t.name, t.tensor_type.name)


def test_a_llama_cpp_q4_k_m_file_serves_transformers_logits_and_greedy_tokens(tmp_path):
    torch.set_num_threads(1)
    path = FIXTURES / "llama-Q4_K_M.gguf"
    ours = load_model(prepare(path, tmp_path), "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ids = ours.tokenizer.encode(TEXT).ids
    with torch.no_grad():
        torch.testing.assert_close(ours.model(torch.tensor([ids])).float(), ref(torch.tensor([ids])).logits,
                                   atol=1e-4, rtol=0)
        want = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(ids):].tolist()
        seq = list(ids)
        for _ in range(16):
            seq.append(int(ours.model(torch.tensor([seq]))[0, -1].argmax()))
    assert seq[len(ids):] == want
