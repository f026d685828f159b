"""`hetserve compose`: a docker compose file for this host's GPUs, each pinned by UUID.

Design: one service holds the chosen GPUs, listed in `device_ids` by UUID, never by
position: indices change when a GPU is added, removed or reseated, and inside the container
they are renumbered from 0. The router in that container spawns one worker per GPU. The
command repeats the UUIDs in `--devices`, so the router serves exactly those GPUs even where
the runtime exposes more (an image's `NVIDIA_VISIBLE_DEVICES=all` under a default `nvidia`
runtime does). No GPU and no `--simulate` gives the CPU variant, with a comment saying why.

The file is built as a plain dict and written by a small emitter (strings as double-quoted
JSON, which YAML reads verbatim; `$` doubled against compose interpolation), so the
generator needs no template files or PyYAML and works the same from an installed wheel.
Trade-off: the emitter knows only what a compose file needs (maps, lists, strings, ints,
bools, trailing comments).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from server.commands.inventory import inventory
from server.errors import UsageError
from workers.contract import DeviceInfo, TopologySpecError, select_devices

CONTAINER_PORT = 8000
CONTAINER_MODEL_DIR = "/models"
SIMULATE_EXAMPLE = "sm_80,sm_89,sm_90"
_IMAGE_RE = re.compile(
    r"^[a-z0-9][a-z0-9._-]*(:[0-9]+)?(/[a-z0-9][a-z0-9._-]*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)
_PLAIN_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")

HEALTHCHECK = {
    "test": ["CMD", "hetserve-healthcheck"],
    "interval": "30s",
    "timeout": "5s",
    "retries": 3,
    "start_period": "300s",
}


@dataclass(frozen=True)
class ComposeFile:
    """A generated compose file: the document, its header comment and the GPUs it pins."""

    doc: dict
    header: tuple[str, ...]
    gpus: tuple[DeviceInfo, ...]

    @property
    def text(self) -> str:
        return to_yaml(self.doc, self.header)


@dataclass(frozen=True)
class Commented:
    """A scalar written with a trailing `# comment` (the device behind a UUID)."""

    value: str | int | bool
    comment: str


# ---------------------------------------------------------------------------- emitter


def _scalar(v) -> str:
    if isinstance(v, Commented):
        return f"{_scalar(v.value)}  # {' '.join(v.comment.split())}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v.replace("$", "$$"))
    if v == {} or v == []:
        return "{}" if isinstance(v, dict) else "[]"
    raise TypeError(f"cannot emit {type(v).__name__} `{v!r}`")


def _key(k: str) -> str:
    return k if _PLAIN_KEY_RE.match(k) else json.dumps(k)


def _emit(node, depth: int, out: list[str]) -> None:
    pad = "  " * depth
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, dict | list) and v:
                out.append(f"{pad}{_key(k)}:")
                _emit(v, depth + 1, out)
            else:
                out.append(f"{pad}{_key(k)}: {_scalar(v)}")
        return
    for item in node:  # a list: block sequence, a map item starts on the dash line
        if isinstance(item, dict) and item:
            sub: list[str] = []
            _emit(item, depth + 1, sub)
            out.append(f"{pad}- {sub[0].lstrip()}")
            out.extend(sub[1:])
        elif isinstance(item, list) and item:
            raise TypeError("nested lists are not emitted")
        else:
            out.append(f"{pad}- {_scalar(item)}")


def to_yaml(doc: dict, header: tuple[str, ...] = ()) -> str:
    """`doc` as block YAML, preceded by `header` as `#` comment lines."""
    out = [f"# {line}".rstrip() for line in header]
    _emit(doc, 0, out)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- document


def _check_args(args) -> tuple[int, str, Path | None]:
    port = args.port
    if not 1 <= port <= 65535:
        raise UsageError(f"Invalid `--port {port}`. Accepted: 1-65535")
    image = args.image or ""
    if not _IMAGE_RE.match(image):
        raise UsageError(
            f"Invalid `--image {image}`. Accepted: an image reference such as `hetserve:latest` or "
            "`registry.example.com/team/hetserve:0.1.0` (lowercase repository, optional :tag)"
        )
    model = None
    if args.model is not None:
        model = Path(args.model).expanduser().resolve()
        if not model.is_dir():
            raise UsageError(
                f"Model directory `{args.model}` does not exist. Accepted: a Hugging Face model directory"
            )
        if not (model / "config.json").is_file():
            raise UsageError(
                f"Model directory `{args.model}` has no config.json. Accepted: a Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer.json)"
            )
    return port, image, model


def _gpus(args) -> list[DeviceInfo]:
    """The devices to pin: the inventory (NVML or simulated) narrowed by `--devices`."""
    try:
        devices = select_devices(inventory(args.simulate), getattr(args, "devices", None))
    except TopologySpecError as e:
        raise UsageError(str(e)) from e
    if all(d.type == "cpu" for d in devices):
        return []  # `--simulate cpu`: a host without GPU
    for d in devices:
        if d.type != "cuda":
            raise UsageError(
                f"Device `{d.arch or d.type}` (index {d.index}) is not an NVIDIA GPU; compose files pin NVIDIA "
                f"GPUs only. Accepted in --simulate: sm_XY tokens, e.g. `{SIMULATE_EXAMPLE}`, or `cpu` alone"
            )
    return devices


def _service(image: str, port: int, model: Path | None, command: list[str]) -> dict:
    svc: dict = {"image": image}
    # The model is mounted, not named in the command: the image's entry point serves what is
    # mounted at /models under the name its config.json gives it (deploy/entrypoint.sh), as the
    # shipped compose files do; a `--model /models` here would name it `models`, after the mount.
    if command:  # the image's entry point runs `hetserve serve --host 0.0.0.0 --port 8000` plus these
        svc["command"] = command
    svc["ports"] = [f"{port}:{CONTAINER_PORT}"]
    if model is not None:
        svc["volumes"] = [
            {"type": "bind", "source": str(model), "target": CONTAINER_MODEL_DIR, "read_only": True}
        ]
    svc["healthcheck"] = dict(HEALTHCHECK)
    svc["restart"] = "unless-stopped"
    svc["stop_grace_period"] = "60s"
    svc["init"] = True
    return svc


def _device_comment(d: DeviceInfo) -> str:
    cap = d.capability.sm if d.capability else d.type
    return f"index {d.index}: {d.name}, {cap}"


def _image_lines(image: str, gpu: bool) -> list[str]:
    """How to get `image`: built from a clone of hetserve, or pulled from where it was pushed."""
    lines = [f"The image `{image}`: build it in a clone of hetserve (deploy/Dockerfile) with"]
    if gpu:  # the default build: torch's CUDA wheel, which carries its own CUDA libraries
        lines.append(f"  docker build -f deploy/Dockerfile -t {image} .")
    else:
        lines += [
            f"  docker build -f deploy/Dockerfile -t {image} --build-arg BASE_IMAGE=ubuntu:24.04 \\",
            "      --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \\",
            "      --build-arg TRITON_LAUNCHER_DEPS= .",
        ]
    lines.append(f"or pull it from the registry it was pushed to: `docker pull {image}` (`--image` names another).")
    return lines


def build(args) -> ComposeFile:
    """The compose document and its header comment for `args` (simulate, model, port, image, devices)."""
    port, image, model = _check_args(args)
    gpus = _gpus(args)
    if not gpus:
        header = [
            "hetserve, CPU variant: written by `hetserve compose` for "
            + (
                f"`--simulate {args.simulate}` (no GPU)."
                if args.simulate
                else "a host where NVML reports no NVIDIA GPU."
            ),
            "No device is reserved: the router runs one CPU worker. Run `hetserve compose` on the GPU host to",
            f"pin its GPUs, or add `--simulate`, `{SIMULATE_EXAMPLE}` to `command` to try the mixed-GPU path",
            "(one worker per simulated device) on this CPU.",
            f"  docker compose -f {args.output or 'FILE'} up -d && curl localhost:{port}/workers",
            *_image_lines(image, gpu=False),
        ]
        return ComposeFile(
            {"name": "hetserve", "services": {"hetserve": _service(image, port, model, [])}},
            tuple(header),
            (),
        )
    uuids = [d.uuid for d in gpus]
    svc = _service(image, port, model, ["--devices", ",".join(uuids)])
    svc["deploy"] = {
        "resources": {
            "reservations": {
                "devices": [
                    {
                        "driver": "nvidia",
                        "device_ids": [Commented(d.uuid, _device_comment(d)) for d in gpus],
                        "capabilities": ["gpu"],
                    }
                ]
            }
        }
    }
    header = [
        f"hetserve on {len(gpus)} GPU(s), pinned by UUID: written by `hetserve compose`.",
        "One container holds these GPUs; its router spawns one worker per GPU.",
        f"  docker compose -f {args.output or 'FILE'} up -d && curl localhost:{port}/workers",
        *_image_lines(image, gpu=True),
    ]
    if args.simulate:
        header += [
            f"SIMULATED inventory (`--simulate {args.simulate}`): these UUIDs are placeholders, not real GPUs.",
            "Run `hetserve compose` without --simulate on the GPU host for a file that starts there.",
        ]
    return ComposeFile({"name": "hetserve", "services": {"hetserve": svc}}, tuple(header), tuple(gpus))


def run(args) -> int:
    result = build(args)
    if args.output is None:
        sys.stdout.write(result.text)
        return 0
    out = Path(args.output)
    if not out.parent.is_dir():
        raise UsageError(f"Cannot write `--output {args.output}`: directory `{out.parent}` does not exist")
    out.write_text(result.text)
    what = f"{len(result.gpus)} GPU(s) pinned by UUID" if result.gpus else "CPU variant, no GPU reserved"
    print(f"wrote {out}: {what}", file=sys.stderr)
    return 0
