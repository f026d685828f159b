"""Llama 3's rope scaling from a GGUF's `rope_freqs` tensor (workers/gguf/rope_freqs.py).

What must hold:
- the divisors llama.cpp's converter writes for Llama 3.1's and 3.2's scalings read back as those
  scalings (`low_freq_factor` 1, `high_freq_factor` 4, 8192 original positions, factor 8 and 32);
- divisors that fit no Llama 3 scaling are refused by name;
- a tiny Llama written with a Llama 3 scaling (the `rope_freqs` tensor, as llama.cpp writes it) loads
  with that scaling, its fp32 logits within 1e-4 of the transformers model it was written from.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from workers.gguf.files import GGUFError
from workers.gguf.rope_freqs import llama3_factors, llama3_from_rope_freqs

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama_3_1_and_3_2_divisors_read_back_as_their_scaling(factor):
    values = llama3_factors(500000.0, 128, factor, 1.0, 4.0, 8192)
    assert llama3_from_rope_freqs(values, 500000.0, 128) == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert llama3_from_rope_freqs(np.ones(64, dtype=np.float32), 500000.0, 128) is None  # no scaling


def test_divisors_of_no_llama3_scaling_are_refused_by_name():
    values = llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    values[40] *= 1.01  # one frequency off the line
    with pytest.raises(GGUFError, match=r"`rope_freqs.weight`: its divisors fit no Llama 3 rope scaling"):
        llama3_from_rope_freqs(values, 500000.0, 128)
    with pytest.raises(GGUFError, match=r"has 10 values"):
        llama3_from_rope_freqs(np.ones(10), 500000.0, 128)


def test_a_llama3_gguf_loads_with_its_scaling_and_the_written_models_logits(tmp_path):
    """Guards `hf_config(meta, tensors, rope_freqs)` in workers/gguf/prepare.py: without the tensor's values
    the file is refused; read as default rope, the logits move far past 1e-4."""
    pytest.importorskip("gguf")
    from tests.gguf_checkpoints import make_gguf, reference_model
    from workers.gguf.prepare import prepare
    from workers.model.loader import load_model

    path = make_gguf("llama", "F32", tmp_path, options={"rope_scaling": LLAMA3})
    directory = prepare(path, tmp_path / "cache")
    assert json.loads((directory / "config.json").read_text())["rope_parameters"] == {"rope_theta": 10000.0, **LLAMA3}
    ours = load_model(directory, "float32")
    ref = reference_model("llama", options={"rope_scaling": LLAMA3})
    ids = torch.arange(5, 45)[None]  # 40 positions: the scaled low frequencies turn visibly
    with torch.no_grad():
        torch.testing.assert_close(ours.model(ids).float(), ref(ids).logits, atol=1e-4, rtol=0)
