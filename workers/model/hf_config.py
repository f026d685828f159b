"""A `ModelConfig`'s Hugging Face round trip: the one place that reads and writes config.json's spellings.

Design: `hf_fields(hf)` reads the fields every family shares (transformers 4 and 5 alike) and
hands the rest to the family's own `read` (workers/model/families/); `hf_dict(fields)` writes
the Llama baseline's families back as transformers 5 reads them. `ModelConfig.from_hf_config`
and `to_hf_config` (workers/model/config.py) wrap them with its error. Trade-off: the two
directions are not symmetric: every registered family reads, only the families checkpoints are
exported as write.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from workers.model.families.base import text_part
from workers.model.families.registry import family, family_of


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def hf_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig`'s fields from a Hugging Face config.json dict (transformers 4 or 5 spellings);
    a `FamilyConfigError` or `RopeConfigError` naming what is wrong."""
    fam = family_of(hf)
    hf = text_part(hf)  # a multimodal checkpoint: its text model's config
    heads = int(hf["num_attention_heads"])
    shared = dict(
        architecture=fam.name,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf.get("intermediate_size") or 0),  # none where every layer has experts
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_eos_ids(hf.get("eos_token_id")),
        torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
    )
    return {**shared, **fam.read(hf)}


def hf_dict(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json dict of a `ModelConfig`'s fields (a family with an `hf_class`) that this loader
    and transformers 5 read; fields, not the config, so that this module needs nothing of config.py."""
    config = SimpleNamespace(**fields)
    fam = family(config.architecture)
    rope = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
    out: dict[str, Any] = {
        "architectures": [fam.hf_class],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(rope) if config.rope_scaling else None,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": (
            None if not config.eos_token_id
            else config.eos_token_id[0] if len(config.eos_token_id) == 1 else list(config.eos_token_id)
        ),
        "torch_dtype": config.torch_dtype or "float32",
    }
    if config.architecture == "llama":
        out["attention_bias"] = config.attention_bias
        out["mlp_bias"] = config.mlp_bias
    if config.architecture == "mistral":
        out["sliding_window"] = config.sliding_window
    if config.architecture == "qwen2":
        out["use_sliding_window"] = bool(config.sliding_window)
        out["sliding_window"] = config.sliding_window
        out["layer_types"] = list(config.layer_types) or None
    return out
