"""hetserve-lora-sgmv: the LoRA delta of a batch mixing adapters and base-only rows (segmented shrink and
expand, SGMV / BGMV) in Triton, with its torch reference."""

from . import layers
from .lora_sgmv import TUNINGS, LoraSegments, LoraStack, LoraTuning, lora_sgmv, lora_sgmv_reference

__all__ = ["TUNINGS", "LoraSegments", "LoraStack", "LoraTuning", "layers", "lora_sgmv", "lora_sgmv_reference"]
