"""`--disaggregate auto|off`, `--prefill DEVS`, `--decode DEVS`, `--disaggregate-min-prompt N`.

Disaggregated prefill gives each worker a role: `prefill` (it computes long prompts and their
first token, then hands the request on), `decode` (it continues them and serves short requests)
or `both` (today's worker). This module only validates the flags into one frozen value; the
roles are resolved against the workers the placement made (server/routing/roles.py) and the
handoff runs in server/dispatch/handoff.py. Explicit roles (`--prefill gpu0 --decode gpu1,gpu2`)
turn disaggregation on without `--disaggregate`; `--disaggregate off` with explicit roles is a
contradiction and refused. Trade-off: the default is off, since a handoff costs one more
dispatch and a host-tier write and read per long prompt, paid back only where the devices differ
in kind (server/routing/roles.py says when `auto` chooses to).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from server.errors import UsageError

OFF, AUTO, EXPLICIT = "off", "auto", "explicit"
MODES = (AUTO, OFF)  # what `--disaggregate` accepts (explicit roles come from --prefill/--decode)
# A prompt at least this long (tokens) is prefilled on a prefill worker. Below it a prefill costs
# about as much as a few decode steps, and the handoff's fixed costs (a second dispatch, the
# blocks written to and read from the host tier) would outweigh what it saves.
DEFAULT_MIN_PROMPT_TOKENS = 256
# The most a prefill worker may take to compute a handed-off prompt and publish its blocks before
# the request is prefilled on a decode worker instead (a stalled or swamped prefill worker).
DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DisaggregateConfig:
    """The flags' value: `mode` off, auto or explicit; the device tokens of each explicit role;
    the prompt length (tokens) from which a request is prefilled on a prefill worker."""

    mode: str = OFF
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def enabled(self) -> bool:
        return self.mode != OFF


def add_disaggregate_flags(g: argparse._ActionsContainer) -> None:
    """The flags, in `g` (the serve command's routing group)."""
    g.add_argument("--disaggregate", default=None, metavar="|".join(MODES),
                   help="prefill long prompts on one worker and decode them on another, the KV moved through "
                        "the host KV tier: auto (roles from each device's published compute and bandwidth, "
                        "only where they differ in kind) or off (default; explicit --prefill/--decode turn it on)")
    g.add_argument("--prefill", default=None, metavar="DEVS",
                   help="workers that prefill long prompts (`gpu0`, an index or a UUID; comma-separated); "
                        "unlisted workers decode")
    g.add_argument("--decode", default=None, metavar="DEVS",
                   help="workers that continue handed-off requests and serve short ones (comma-separated); "
                        "unlisted workers prefill; a worker in both lists does both")
    g.add_argument("--disaggregate-min-prompt", type=int, default=None, metavar="N",
                   help=f"prompt tokens from which a request is prefilled on a prefill worker "
                        f"(default {DEFAULT_MIN_PROMPT_TOKENS})")
    g.add_argument("--disaggregate-timeout", type=float, default=None, metavar="S",
                   help=f"seconds a prefill worker may take to compute a handed-off prompt and publish its KV "
                        f"blocks; past them the prompt is computed on a decode worker (default {DEFAULT_TIMEOUT_S:g})")


def parse_devices(flag: str, value: str | None) -> tuple[str, ...]:
    """`gpu0,gpu2` as its tokens; `UsageError` for an empty list or a token given twice."""
    if value is None:
        return ()
    tokens = tuple(t.strip() for t in value.split(","))
    if not value.strip() or any(not t for t in tokens):
        raise UsageError(f"`{flag} {value}` has an empty device. Accepted: worker ids (`gpu0`), indices or "
                         f"UUIDs, comma-separated, e.g. `{flag} gpu0,gpu1`")
    seen = set()
    for t in tokens:
        if t.lower() in seen:
            raise UsageError(f"`{flag} {value}` names `{t}` twice. Accepted: each device once")
        seen.add(t.lower())
    return tokens


def disaggregate_from_args(args) -> DisaggregateConfig:
    """The flags' value; `UsageError` names a bad mode, list or threshold and says what is accepted."""
    raw = getattr(args, "disaggregate", None)
    mode = None if raw is None else str(raw).strip().lower()
    if mode is not None and mode not in MODES:
        raise UsageError(f"`--disaggregate {raw}` is not a mode. Accepted: {', '.join(MODES)} "
                         "(explicit roles: --prefill DEVS --decode DEVS)")
    prefill = parse_devices("--prefill", getattr(args, "prefill", None))
    decode = parse_devices("--decode", getattr(args, "decode", None))
    explicit = bool(prefill or decode)
    if explicit and mode is not None:
        given = f"--disaggregate {raw}"
        raise UsageError(f"`{given}` cannot go with --prefill/--decode. Accepted: --disaggregate auto|off alone, "
                         "or explicit roles (--prefill DEVS --decode DEVS) alone")
    threshold = getattr(args, "disaggregate_min_prompt", None)
    if threshold is not None and threshold < 1:
        raise UsageError(f"`--disaggregate-min-prompt {threshold}` must be an integer >= 1 (prompt tokens)")
    n = DEFAULT_MIN_PROMPT_TOKENS if threshold is None else threshold
    timeout = getattr(args, "disaggregate_timeout", None)
    if timeout is not None and not (0 < timeout <= 3600):  # NaN fails both
        raise UsageError(f"`--disaggregate-timeout {timeout}` must be a number of seconds in (0, 3600]")
    return DisaggregateConfig(EXPLICIT if explicit else (mode or OFF), prefill, decode, n,
                              DEFAULT_TIMEOUT_S if timeout is None else timeout)
