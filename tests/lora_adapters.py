"""LoRA adapters written by PEFT itself over the tiny checkpoints of tests/family_checkpoints.py.

PEFT initialises each B matrix to zero (an adapter that changes nothing); these adapters get
random A and B of a spread that moves the logits visibly, then `save_pretrained` writes
`adapter_config.json` and `adapter_model.safetensors` as any PEFT user's adapter is written.
"""

from __future__ import annotations

from pathlib import Path

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_model(base_dir: Path, adapter_dir: Path | None = None):
    """The base checkpoint in fp32 with the adapter in `adapter_dir` (PEFT's own loading), eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir)
    return model.eval()


def make_adapter(base_dir: Path, out: Path, seed: int, r: int = 4, alpha: float = 8.0, targets=ALL,
                 rslora: bool = False, std: float = 0.1, **options) -> Path:
    """Write a PEFT LoRA adapter over `base_dir` to `out`, its A and B random (`seed`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0,
                        task_type="CAUSAL_LM", **options)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out)
    return out
