"""hetserve-rotary: the rotary position embedding in C++ (CPU, one pass per token), with its torch reference."""

from . import layers
from .rotary import rotary_reference

__all__ = ["layers", "rotary_reference"]
