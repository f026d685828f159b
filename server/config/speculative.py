"""`--speculative auto|off|ngram|suffix|mtp` and `--num-speculative-tokens N`: workers' speculative decoding.

The router validates both flags against the contract's names (workers/contract/speculative.py) and
forwards them in each worker's configuration (server/fleet/spec.py); each worker then decides for
its own engine (workers/engine/speculate.py `speculator_for`) and reports method, k, acceptance
and the reason on `/workers`. `mtp` is refused here for a model whose checkpoint ships no MTP head.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from server.errors import UsageError
from workers.contract.speculative import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_SPECULATIVE,
    SPECULATIVE_MODES,
    mtp_error,
    speculative_error,
)


@dataclass(frozen=True)
class SpeculativeConfig:
    mode: str = DEFAULT_SPECULATIVE
    num_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS


def add_speculative_flags(g: argparse._ActionsContainer) -> None:
    """The two flags, in `g` (the serve command's engine group)."""
    g.add_argument("--speculative", default=None, metavar="|".join(SPECULATIVE_MODES),
                   help="draft tokens each decode row verifies per step: ngram (n-gram lookup in the prompt and "
                        "output), suffix (suffix trees over the request and recent outputs), mtp (the "
                        "checkpoint's own MTP head, where it ships one), k chosen per "
                        "step from the worker's measured step costs, off, or auto (default: suffix where output "
                        "stays exact, under --deterministic; else off, with the reason)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="N",
                   help=f"most draft tokens per decode row and step (default {DEFAULT_NUM_SPECULATIVE_TOKENS})")


def speculative_from_args(args, model_dirs=()) -> SpeculativeConfig:
    """The flags' value for the models served from `model_dirs`; `UsageError` names a bad method or count
    (or `mtp` for a checkpoint without an MTP head) and lists what is accepted."""
    mode = getattr(args, "speculative", None) or DEFAULT_SPECULATIVE
    num = getattr(args, "num_speculative_tokens", None)
    error = speculative_error(mode, num) or next(filter(None, (mtp_error(mode, d) for d in model_dirs)), None)
    if error:
        raise UsageError(error)
    return SpeculativeConfig(mode, DEFAULT_NUM_SPECULATIVE_TOKENS if num is None else num)
