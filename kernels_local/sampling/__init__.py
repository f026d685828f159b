"""hetserve-sampling: greedy rows (each row's token and logprob without the [N, V] logprobs) in C++
(CPU), with its torch reference."""

from . import layers
from .greedy import greedy_reference

__all__ = ["greedy_reference", "layers"]
