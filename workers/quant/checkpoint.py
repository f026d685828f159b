"""What a quantized checkpoint's reader needs of the model it fills, handed in by the model's loader.

Design: the readers (`fp8_reader.py`, `int4_reader.py`, `mxfp4_reader.py`) know the formats;
where the tensors land is the model's knowledge (the family's Hugging Face name map and the
`FusedMoE` layer quantized experts replace). This package sits below the model, so the loader
passes that knowledge in as one frozen `ModelMap`. Every reader is driven through the same calls,
in order: `bind(model, expected)`, `claims(name)` (a stored tensor handed over as stored),
`covers(name)` (an expected tensor the reader makes), `to_ours(stored)`, `install(model,
state_dict)` (the quantized layers swapped in, on meta) and `describe()` (what `/workers` shows).
Trade-off: the map is a few callables rather than the model's classes, so a reader can be tested
with a stand-in, and cannot ask the model anything the map does not carry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelMap:
    """The model a checkpoint is read into, as the readers see it (built by the loader)."""

    architecture: str  # the family (`gpt_oss`), named in errors
    num_experts: int  # experts per mixture-of-experts layer (0: every layer dense)
    map_name: Callable[[str], tuple[str, object] | None]  # an HF tensor -> (our tensor, its part) or None
    to_ours: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]  # HF tensors -> our state dict
    experts: type[nn.Module]  # the model's experts layer (`FusedMoE`), which quantized experts replace
