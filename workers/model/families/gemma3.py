"""Gemma 3 text (`Gemma3ForCausalLM`, model type `gemma3_text`): Gemma 2's layer with q/k norms,
five sliding layers to one global, and the sliding layers' own rotary base.

What differs from Gemma 2 (workers/model/families/gemma2.py): a Gemma RMSNorm over each head
of q and k; one full-attention layer in six (`sliding_window_pattern`, or as `layer_types`
lists them); the sliding layers rotate with their own base (`rope_local_base_freq`, 10,000 by
default; transformers 5: `rope_parameters["sliding_attention"]`) while the global ones take
`rope_theta` (1,000,000 by default) and any scaling; no soft-capping unless the config asks.
"""

from __future__ import annotations

from workers.model.families.base import LLAMA_WEIGHTS, QK_NORM_WEIGHTS, Family, rope_fields, with_weights
from workers.model.families.gemma2 import GEMMA_NORMS, read_gemma


def _read(hf: dict) -> dict:
    caps = {"attn_softcap": hf.get("attn_logit_softcapping"), "final_softcap": hf.get("final_logit_softcapping")}
    return {**rope_fields(hf, 1_000_000.0, "rope_local_base_freq", 10_000.0),
            **read_gemma(hf, int(hf.get("sliding_window_pattern") or 6)), "qk_norm": "head",
            **{k: None if v is None else float(v) for k, v in caps.items()}}


GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",),
                with_weights(LLAMA_WEIGHTS, {**GEMMA_NORMS, **QK_NORM_WEIGHTS}), _read)
