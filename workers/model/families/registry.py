"""Which family a checkpoint is: its config.json `architectures[0]`, else its `model_type`.

An architecture not listed here is refused at load with the list of those that are; within a
family, what its `read` cannot compute is refused too (workers/model/families/base.py). The
families' Hugging Face names are also the contract's table (workers/contract/checkpoint_check.py
`ARCHITECTURES`), which the router checks a checkpoint against before any worker starts;
tests/test_checkpoint_check.py holds the two equal.
"""

from __future__ import annotations

from workers.contract.checkpoint_check import supported_architectures
from workers.model.families.base import Family, FamilyConfigError
from workers.model.families.gemma2 import GEMMA2
from workers.model.families.gemma3 import GEMMA3
from workers.model.families.gemma4 import GEMMA4
from workers.model.families.granite import GRANITE
from workers.model.families.llama import LLAMA, MISTRAL, QWEN2
from workers.model.families.moe import GPT_OSS, MIXTRAL, QWEN3_MOE
from workers.model.families.olmo2 import OLMO2, OLMO3
from workers.model.families.phi3 import PHI3
from workers.model.families.qwen3 import QWEN3
from workers.model.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from workers.model.families.smollm3 import SMOLLM3

FAMILIES: dict[str, Family] = {f.name: f for f in (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, SMOLLM3, OLMO2, OLMO3, GRANITE, QWEN3_MOE, MIXTRAL, GPT_OSS,
    QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT,
    GEMMA4)}
_BY_NAME = {n: f for f in FAMILIES.values() for n in (*f.architectures, *f.model_types)}


def family_of(hf: dict) -> Family:
    """The checkpoint's family; `FamilyConfigError` naming it and listing what is supported."""
    names = list(hf.get("architectures") or []) + [hf.get("model_type")]
    for name in names:
        if name in _BY_NAME:
            return _BY_NAME[name]
    shown = (hf.get("architectures") or [None])[0] or hf.get("model_type")
    raise FamilyConfigError(f"Unsupported architecture `{shown}`. Supported: {', '.join(supported_architectures())}")


def family(name: str) -> Family:
    """A family by our name (`ModelConfig.architecture`)."""
    if name not in FAMILIES:
        raise FamilyConfigError(f"Unsupported architecture `{name}`. Supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]
