"""The LoRA adapters one `hetserve serve` offers over its default model: `--lora NAME=DIR`
(repeatable), `--lora-modules-dir DIR` (each subdirectory with PEFT's `adapter_config.json` is an
adapter named after it), `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`.

Design: validated once into a frozen `LorasConfig` before any worker starts (a malformed entry,
a name that clashes with a model's, a directory without PEFT's `adapter_config.json` is a
`UsageError` naming it; a bad entry of `--lora-modules-dir` is named with the adapters found beside
it, and an explicit `--lora` of the same name wins over the scanned one); every worker of the
default model is configured with all of them and reads and checks the weights itself
(workers/lora/). The OpenAI `model` field (or
`X-Hetserve-Model`) naming an adapter picks the default model's workers and the adapter.
Trade-off: adapters belong to the default model only, and every one of its workers holds all of
them (no per-worker placement yet)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from server.config.models import ACCEPTED_NAMES, NAME_RE, ModelsConfig
from server.errors import UsageError, shown
from workers.contract.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, parse_loras

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LorasConfig:
    adapters: tuple[tuple[str, Path], ...] = ()  # (name, directory), in the order given
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None  # host copies kept per worker (None: the worker's default)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.adapters)

    def worker_value(self) -> str | None:
        """The worker's `--lora` value (`NAME=DIR,...`), None without adapters."""
        return ",".join(f"{name}={path}" for name, path in self.adapters) or None


def add_lora_flags(serve) -> None:
    g = serve.add_argument_group("LoRA adapters", "PEFT adapters over the default model, picked by the `model` field")
    g.add_argument("--lora", action="append", default=None, metavar="NAME=DIR",
                   help="serve the PEFT LoRA adapter in DIR as model NAME (repeatable)")
    g.add_argument("--lora-modules-dir", default=None, metavar="DIR",
                   help="serve every subdirectory of DIR holding an adapter_config.json as an adapter named after it")
    g.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help=f"adapters each worker holds in memory at once (default {DEFAULT_MAX_LORAS})")
    g.add_argument("--max-lora-rank", type=int, default=None, metavar="N",
                   help=f"the highest adapter rank accepted (default {DEFAULT_MAX_LORA_RANK})")
    g.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="adapters each worker keeps in host memory, so one evicted from the device comes back "
                        "without a disk read (at least --max-loras; default 4x --max-loras)")


def scan_lora_modules_dir(root: str) -> tuple[tuple[str, str], ...]:
    """(name, directory) of every subdirectory of `root` holding an `adapter_config.json` that reads as a
    PEFT LoRA config, in name order; a bad one is a `UsageError` naming it and listing what was found."""
    base = Path(root).expanduser()
    if not base.is_dir():
        raise UsageError(f"`--lora-modules-dir {shown(root)}` is not a directory. Accepted: a directory whose "
                         f"subdirectories are PEFT adapters (each with an `{ADAPTER_CONFIG}`)")
    subs = sorted(p for p in base.iterdir() if p.is_dir())
    found = [p for p in subs if (p / ADAPTER_CONFIG).is_file()]
    listed = ", ".join(f"`{shown(p.name)}`" for p in found) or "none"
    if not found:
        others = ", ".join(f"`{shown(p.name)}`" for p in subs) or "no subdirectory"
        raise UsageError(f"`--lora-modules-dir {shown(root)}` holds no adapter (a subdirectory with an "
                         f"`{ADAPTER_CONFIG}`). Found: {others}")
    out = []
    for sub in found:
        where = f"`--lora-modules-dir {shown(root)}`: `{shown(sub.name)}`"
        if not NAME_RE.match(sub.name) or "," in str(sub.resolve()):
            raise UsageError(f"{where} is no adapter name ({ACCEPTED_NAMES}; no `,` in its path); rename the "
                             f"directory. Adapters found: {listed}")
        try:
            cfg = json.loads((sub / ADAPTER_CONFIG).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{where} has an `{ADAPTER_CONFIG}` that is not JSON ({e}). Adapters found: "
                             f"{listed}") from None
        peft_type = cfg.get("peft_type", "LORA") if isinstance(cfg, dict) else None
        if peft_type != "LORA":
            raise UsageError(f"{where} is of PEFT type `{shown(str(peft_type))}`. Accepted: `LORA`. Adapters "
                             f"found: {listed}")
        out.append((sub.name, str(sub)))
    return tuple(out)


def loras_from_args(args, models: ModelsConfig) -> LorasConfig:
    """`--lora`, `--lora-modules-dir`, `--max-loras`, `--max-lora-rank` checked (`UsageError` names the
    bad value)."""
    given = getattr(args, "lora", None) or []
    try:
        pairs = parse_loras(given)
    except ValueError as e:
        raise UsageError(str(e)) from e
    modules_dir = getattr(args, "lora_modules_dir", None)
    if modules_dir is not None:
        explicit = {name for name, _ in pairs}
        pairs += tuple(p for p in scan_lora_modules_dir(modules_dir) if p[0] not in explicit)
    model_names = {entry.name for entry in models.entries}
    adapters = []
    for name, raw in pairs:
        if not NAME_RE.match(name):
            raise UsageError(f"`--lora {shown(name)}=...`: the name is not accepted. Accepted: {ACCEPTED_NAMES}")
        if name in model_names:
            raise UsageError(f"`--lora {name}=...` has a model's name. Accepted: a name no `--model` uses")
        path = Path(raw).expanduser().resolve()
        if ("," in str(path)) or not (path / ADAPTER_CONFIG).is_file():
            raise UsageError(f"`--lora {name}={raw}`: no `{ADAPTER_CONFIG}` in `{path}`. Accepted: a directory as "
                             f"PEFT's `save_pretrained` writes it (no `,` in its path)")
        adapters.append((name, path))
    limits = {}
    for flag in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        value = getattr(args, flag, None)
        if value is not None:
            if value < 1:
                raise UsageError(f"`--{flag.replace('_', '-')} {value}` must be at least 1")
            limits[flag] = value
    host, slots = limits.get("max_cpu_loras"), limits.get("max_loras", DEFAULT_MAX_LORAS)
    if host is not None and host < slots:
        raise UsageError(f"`--max-cpu-loras {host}` must be at least `--max-loras` ({slots})")
    return LorasConfig(tuple(adapters), **limits)
