"""`--routing` and its parameters: one frozen value, checked once, with the flags that set it
and the defaults of the routing stages (server/routing/).

Policies:
- `cache-aware` (default): prefix affinity blended with load and measured speed; sessions stick;
  an imbalance rule overrides prefix affinity (server/routing/policy.py).
- `least-loaded`: the worker with the fewest requests in flight (ties: the one picked least
  often); sessions stick.
- `round-robin`: the next worker in id order that can take the request; sessions stick.

A request pinned to a worker (`X-Hetserve-Worker`) goes there whatever the policy.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from server.errors import UsageError

CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN = "cache-aware", "least-loaded", "round-robin"
POLICIES = (CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN)

DEFAULT_LOAD_FACTOR = 1.1  # bounded loads (server/routing/policy.py `bounded_load`)
DEFAULT_CHUNK_CHARS = 64  # characters per prefix chunk of text (a few tokens short of a KV block of 16)
DEFAULT_LORA_MAX_REPLICAS = 2  # workers an adapter is placed on before only its heat replicates it
DEFAULT_MAX_CHUNKS = 8192  # prefix chunks remembered per worker: 512 Ki characters, about 150 Ki tokens
# A prefix held in the host KV tier a worker shares (workers/kvtier/) counts this share of its
# tokens as held: copied in, not recomputed, but read and copied rather than found in place.
TIER_HIT_WEIGHT = 0.8


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = CACHE_AWARE
    # Imbalance: prefix affinity is ignored while the most loaded worker's load exceeds the least
    # loaded one's by `balance_abs` tokens AND is `balance_rel` times as large (loads are tokens in
    # flight, scaled by each worker's speed relative to the fleet's median).
    balance_abs: int = 4096
    balance_rel: float = 1.5
    # Bounded load: a session stays on its worker, and a prompt no worker holds (or a hot one) goes
    # to a worker, only while that worker stays within factor x the mean requests in flight (+1).
    load_factor: float = DEFAULT_LOAD_FACTOR
    tree_size: int = DEFAULT_MAX_CHUNKS  # prefix chunks remembered per worker
    chunk_chars: int = DEFAULT_CHUNK_CHARS
    # A LoRA adapter is placed on at most this many workers unless it is hot (server/routing/
    # lora_affinity.py); 0: no cap.
    lora_max_replicas: int = DEFAULT_LORA_MAX_REPLICAS

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise UsageError(f"Unknown routing policy `{self.policy}`. Accepted: {', '.join(POLICIES)}")
        checks = (("--routing-balance-abs", self.balance_abs, self.balance_abs >= 0, ">= 0 tokens"),
                  ("--routing-balance-rel", self.balance_rel, self.balance_rel >= 1.0, ">= 1.0"),
                  ("--routing-load-factor", self.load_factor, self.load_factor >= 1.0,
                   ">= 1.0"),
                  ("--routing-tree-size", self.tree_size, self.tree_size >= 1, ">= 1 chunk"),
                  ("--lora-max-replicas", self.lora_max_replicas, self.lora_max_replicas >= 0,
                   ">= 0 workers (0: no cap)"))
        for flag, value, ok, bound in checks:
            if not ok:
                raise UsageError(f"`{flag} {value}` must be {bound}")


def add_routing_flags(serve: argparse.ArgumentParser) -> None:
    d = RoutingConfig()
    g = serve.add_argument_group("routing", "which worker serves a request")
    g.add_argument("--routing", choices=POLICIES, default=None, metavar="|".join(POLICIES),
                   help=f"routing policy (default {d.policy}): prefix affinity with load and measured speed, "
                        "fewest requests in flight, or turns")
    g.add_argument("--routing-balance-abs", type=int, default=None, metavar="TOKENS",
                   help="cache-aware: prefix affinity yields to the least loaded worker once the load gap exceeds "
                        f"this many tokens (default {d.balance_abs}) ...")
    g.add_argument("--routing-balance-rel", type=float, default=None, metavar="R",
                   help=f"... and the most loaded worker carries R times the least loaded one's load "
                        f"(default {d.balance_rel:g})")
    g.add_argument("--routing-load-factor", type=float, default=None, metavar="F",
                   help="bounded load: a session (X-Session-Id, OpenAI `user`) leaves its worker, and a new or "
                        "shared prefix skips a worker, once that worker would have more than F times the mean "
                        f"requests in flight, plus one (default {d.load_factor:g})")
    g.add_argument("--routing-tree-size", type=int, default=None, metavar="CHUNKS",
                   help=f"prompt prefix chunks of {d.chunk_chars} characters remembered per worker, least recently "
                        f"used forgotten first (default {d.tree_size})")
    g.add_argument("--lora-max-replicas", type=int, default=None, metavar="N",
                   help="a LoRA adapter is placed on at most N workers; beyond, only while it is hot (its own "
                        "requests in flight on each holder past the bounded load) does it get another (0: no cap; "
                        f"default {d.lora_max_replicas})")


_FLAGS = {"routing": "policy", "routing_balance_abs": "balance_abs", "routing_balance_rel": "balance_rel",
          "routing_load_factor": "load_factor", "routing_tree_size": "tree_size",
          "lora_max_replicas": "lora_max_replicas"}


def routing_from_args(args) -> RoutingConfig:
    """The routing flags that were given, over the defaults (`UsageError` names a bad one)."""
    given = {name: getattr(args, flag) for flag, name in _FLAGS.items() if getattr(args, flag, None) is not None}
    return RoutingConfig(**given)
