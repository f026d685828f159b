"""deploy/ for real: the CPU image built and run with `docker compose`, checked over HTTP and by Docker.

scripts/docker_check.sh does the Docker work, the same steps a person runs by hand: an engine
(Debian's docker.io installed and dockerd started when there is none and we are root), the
base image (a local debootstrap one when no registry answers), the torch wheel in
deploy/wheels, `docker compose build`, `up` until every worker is ready, `down`, and at the
end `clean`, which removes what it made. Two stacks are checked, one after the other, each
serving a test checkpoint mounted read-only at /models: deploy/docker-compose.cpu.yml, and the
file `hetserve compose --simulate --model` writes, with only its GPU reservation reset (no
NVIDIA runtime here) and `--simulate` put before its command, so the UUIDs it pins name
simulated devices. The checkpoint has no end-of-sequence token, so a stream runs as long as
asked while `down` drains it. Trade-off: one image build (minutes) serves every
test, and the tests of a stack share one running container; `down` is each stack's last test.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from deploy_tools import DEPLOY, DOCKERFILE, ROOT

from server.cli import main as hetserve_main
from tests.checkpoints import make_checkpoint
from tests.docker_background import image_build
from tests.preflight_checks import EXPECTED_GEMM, assert_every_kernel_compiled_and_fits
from workers.contract import parse_simulate
from workers.device.build import runs_on
from workers.kernelize.arch_limits import PREFLIGHT_ARCHS

SCRIPT = ROOT / "scripts" / "docker_check.sh"
STATE = Path(os.environ.get("HETSERVE_DOCKER_STATE", ROOT / ".cache" / "docker-check"))  # the script's records
SIM = "sm_80,sm_89,sm_90"
SIM_UUIDS = [d.uuid for d in parse_simulate(SIM)]
EXPECTED = [("gpu0", "8.0", "emulated"), ("gpu1", "8.9", "native_e4m3"), ("gpu2", "9.0", "native_e4m3")]
PROBE_MODEL = "hetserve-docker-probe"
CONTEXT = 16384
STREAM_S = 8.0
UID = 10001
# The image is built in the first test's setup: minutes on two shared cores.
pytestmark = pytest.mark.timeout(2400)


def _script(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _docker(*args: str, timeout: float = 60) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"docker {' '.join(args)}: {r.stderr}"
    return r.stdout


def _logs(cid: str) -> str:
    """The container's output, stdout and stderr interleaved (the entry point writes to stderr)."""
    r = subprocess.run(["docker", "logs", cid], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    return r.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def docker_image() -> str:
    """The CPU image, built once; after this module everything the script made is removed
    (engine included), so the rest of the suite runs without it."""
    try:
        r = image_build()  # started in the background once the suite was collected (tests/docker_background.py)
        if r.returncode == 2:  # no engine can be had here
            reason = r.stderr.strip().splitlines()[-1]
            if os.geteuid() == 0 and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail(f"{reason} (CI runs as root: the docker checks must run)")
            pytest.skip(reason)
        assert r.returncode == 0, r.stderr[-6000:]
        yield r.stdout.split()[-1]
    finally:
        _script("clean", timeout=600)


@dataclass(frozen=True)
class Stack:
    """One running compose project: its files, published port and the env they interpolate."""

    name: str
    project: str
    files: tuple[Path, ...]
    port: int
    env: dict

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grace_s(self) -> float:
        svc = yaml.safe_load(self.files[0].read_text())["services"]["hetserve"]
        return float(str(svc["stop_grace_period"]).removesuffix("s"))

    def container(self) -> str:
        out = _docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}")
        (cid,) = out.split()
        return cid


def _model_dir() -> Path:
    """A world-readable directory (pytest's tmp dirs are 0700: uid 10001 could not enter them)."""
    d = Path(tempfile.mkdtemp(prefix="hetserve-docker-"))
    d.chmod(0o755)
    return d


def _generated_files(d: Path, image: str, port: int, model: Path) -> tuple[Path, ...]:
    """`hetserve compose --simulate` output, and the override that lets it start without GPUs."""
    out = d / "hetserve.yml"
    argv = ["--simulate", SIM, "--port", str(port), "--image", image, "--model", str(model), "-o", str(out)]
    assert hetserve_main(["compose", *argv]) == 0
    command = yaml.safe_load(out.read_text())["services"]["hetserve"]["command"]
    override = d / "no-gpu.yml"
    override.write_text(
        "services:\n  hetserve:\n    deploy: !reset {}\n"
        f"    command: {json.dumps(['--simulate', SIM, *command])}\n"
    )
    return out, override


def _probe_model(d: Path) -> Path:
    """A small checkpoint without an end-of-sequence token: every stream runs to max_new_tokens."""
    model = make_checkpoint(
        d / "model", _name_or_path=PROBE_MODEL, max_position_embeddings=CONTEXT,
        eos_token_id=None, tokenizer_config={"eos_token": None},
    )
    for f in model.iterdir():  # safetensors writes 0600: the container user must read it
        f.chmod(0o644)
    return model


@pytest.fixture(scope="module", params=["cpu_compose", "generated"])
def stack(request, docker_image):
    d = _model_dir()
    model = _probe_model(d)
    env = {"HETSERVE_IMAGE": docker_image, "HETSERVE_MODEL_DIR": str(model)}
    if request.param == "cpu_compose":
        files, port = (DEPLOY / "docker-compose.cpu.yml",), "auto"
    else:
        port = str(_free_port())
        files = _generated_files(d, docker_image, int(port), model)
    project = f"hetserve-test-{request.param.replace('_', '-')}-{os.getpid()}"
    try:
        r = _script("up", project, port, *map(str, files), env=env)
        assert r.returncode == 0, r.stderr[-6000:]
        yield Stack(request.param, project, files, int(r.stdout.split()[-1]), env)
    finally:
        _script("down", project, *map(str, files), env=env)
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------- serving


@pytest.mark.docker
def test_health_ok_and_three_simulated_workers(stack):
    assert httpx.get(f"{stack.url}/health", timeout=30).status_code == 200
    workers = httpx.get(f"{stack.url}/workers", timeout=30).json()["workers"]
    assert [(w["id"], w["device"]["capability"], w["fp8"]["convention"]) for w in workers] == EXPECTED
    assert all(w["state"] == "ready" and w["device"]["simulated"] for w in workers)
    if stack.name == "generated":  # the UUIDs the file pins are the ones served
        assert [w["device"]["uuid"] for w in workers] == SIM_UUIDS


@pytest.mark.docker
def test_generate_answers_with_the_routing_headers(stack):
    for wid, cap, _conv in EXPECTED:
        r = httpx.post(
            f"{stack.url}/generate", headers={"X-Hetserve-Worker": wid}, timeout=120,
            json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
        )
        assert r.status_code == 200, r.text
        # no --quantize fp8: the header says fp8 is not used (the device's convention stays in /workers)
        assert (r.headers["x-worker-id"], r.headers["x-worker-capability"], r.headers["x-fp8-convention"]) == (
            wid, cap, "not used (float32)",
        )
        assert isinstance(r.json()["generated_text"], str)


@pytest.mark.docker
def test_the_mounted_model_is_the_one_served(stack):
    (model,) = httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"]
    assert model["id"] == PROBE_MODEL  # not the embedded default_model
    assert "serving the model mounted at /models" in _logs(stack.container())


@pytest.mark.docker
def test_every_process_runs_as_uid_10001(stack):
    cid = stack.container()
    assert _docker("exec", cid, "id", "-u").strip() == str(UID)
    uids = [ln.split()[0] for ln in _docker("top", cid, "-eo", "uid,pid,args").splitlines()[1:]]
    assert len(uids) >= 5 and set(uids) == {str(UID)}  # init, router, three workers


@pytest.mark.docker
def test_model_mount_is_read_only(stack):
    cid = stack.container()
    (mount,) = [m for m in json.loads(_docker("inspect", cid))[0]["Mounts"] if m["Destination"] == "/models"]
    assert mount["Type"] == "bind" and mount["RW"] is False
    r = subprocess.run(["docker", "exec", cid, "touch", "/models/probe"], capture_output=True, text=True)
    assert r.returncode != 0 and "Read-only file system" in r.stderr


@pytest.mark.docker
def test_docker_reports_the_container_healthy(stack):
    cid = stack.container()
    deadline = time.monotonic() + 180  # the first probe runs `interval` (30 s) after start
    while True:
        health = json.loads(_docker("inspect", "-f", "{{json .State.Health}}", cid))
        if health["Status"] != "starting" or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert health["Status"] == "healthy", health
    assert health["Log"][-1]["ExitCode"] == 0 and "/health: 200" in health["Log"][-1]["Output"]


# ------------------------------------------------------------------- stop


def _stream_tokens(stack: Stack) -> int:
    """Tokens for a stream of about STREAM_S on this machine: it outlives the arrival of SIGTERM
    (under 2 s after `down` starts) and ends well inside the router's 30 s drain."""
    t0 = time.monotonic()
    r = httpx.post(f"{stack.url}/generate", json={"inputs": "Once", "parameters": {"max_new_tokens": 200}}, timeout=120)
    assert r.status_code == 200, r.text
    return int(min(max(200 / (time.monotonic() - t0) * STREAM_S, 500), CONTEXT - 100))


def _stream(stack: Stack, tokens: int, started: threading.Event, out: dict) -> None:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": tokens}}
    events = []
    with httpx.stream("POST", f"{stack.url}/generate_stream", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append((time.time(), json.loads(line[5:])))
                started.set()
    out["events"] = events


@pytest.mark.docker
def test_compose_down_drains_and_stops_every_worker_within_the_grace_period(stack):
    cid = stack.container()
    since = time.time()
    with tempfile.TemporaryFile("w+") as logfile:
        follower = subprocess.Popen(["docker", "logs", "-f", cid], stdout=logfile, stderr=subprocess.STDOUT)
        started, out, tokens = threading.Event(), {}, _stream_tokens(stack)
        client = threading.Thread(target=_stream, args=(stack, tokens, started, out))
        client.start()
        assert started.wait(60), "the stream did not start"
        t0 = time.monotonic()
        r = _script("down", stack.project, *map(str, stack.files), env=stack.env, timeout=stack.grace_s + 60)
        took = time.monotonic() - t0
        client.join(60)
        follower.wait(30)
        logfile.seek(0)
        logs = logfile.read()
    assert r.returncode == 0, r.stderr
    assert took < stack.grace_s, f"down took {took:.1f}s (grace {stack.grace_s}s): SIGTERM was not enough"
    events = [
        json.loads(ln)
        for ln in _docker(
            "events", "--since", f"{since:.3f}", "--until", f"{time.time():.3f}",
            "--filter", f"container={cid}", "--format", "{{json .}}",
        ).splitlines()
    ]
    # one SIGTERM and no SIGKILL; 143 is the router re-raising SIGTERM after its graceful
    # shutdown (uvicorn's convention), 137 would be a kill at the end of the grace period
    (kill,) = [e for e in events if e["Action"] == "kill"]
    (die,) = [e for e in events if e["Action"] == "die"]
    assert kill["Actor"]["Attributes"]["signal"] == "15" and die["Actor"]["Attributes"]["exitCode"] in ("0", "143")
    # the in-flight stream ran to its end after SIGTERM: the router drained it
    stamp, last = out["events"][-1]
    assert "error" not in last and last["details"]["finish_reason"] == "length", last
    assert last["details"]["generated_tokens"] == len(out["events"]) == tokens  # every token arrived
    sigterm = kill["timeNano"] / 1e9
    assert sigterm < stamp, f"{tokens} tokens ended {sigterm - stamp:.2f}s before SIGTERM: the drain went untested"
    # every worker finished before the router did, none had to be killed
    router_done = logs.rindex("Finished server process")
    assert "stopping 3 workers" in logs and "killing it" not in logs, logs[-3000:]
    for wid, _, _ in EXPECTED:
        m = re.search(rf"\[{wid}\] uvicorn\.error: Finished server process", logs)
        assert m is not None and m.start() < router_done, f"{wid} did not finish: {logs[-3000:]}"
    label = f"label=com.docker.compose.project={stack.project}"
    assert _docker("ps", "-aq", "--filter", label).strip() == ""
    assert _docker("network", "ls", "-q", "--filter", label).strip() == ""


# ------------------------------------------------------------------- the GPU image


GPU_RECORD = ROOT / "tests" / "gpu_image_record.json.gz"
# what the GPU image's checks depend on beyond the preflight's sources: its build, pins and script
GPU_DEPENDS = ("deploy/Dockerfile", "deploy/constraints.txt", "pyproject.toml", "scripts/docker_check.sh")


def gpu_image_digest() -> str:
    """sha256 over the preflight's digest (Triton, torch, every source the kernels' compile plan
    reads) and the files the image is built and pinned from."""
    from tests.test_preflight import matrix_digest

    h = hashlib.sha256(matrix_digest().encode())
    for name in GPU_DEPENDS:
        h.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def gpu_image(docker_image) -> dict:
    """The GPU variant (`docker_check.sh gpu-image`) on the CPU image's engine and base, removed
    with them by `docker_image`'s clean: what it printed and what it found inside the image.

    Built when `GPU_RECORD`'s digest is not today's (`gpu_image_digest`), then recorded; else what
    the last build found is read back. Trade-off: the image takes torch's CUDA wheel (gigabytes,
    minutes) and its checks only change with the pins, the build and the kernels' sources, so a
    commit that touches none of them is not built again; a change to any of them is."""
    digest = gpu_image_digest()
    if GPU_RECORD.exists():
        doc = json.loads(gzip.decompress(GPU_RECORD.read_bytes()))
        if doc.get("digest") == digest:
            return doc["image"]
    r = _script("gpu-image", timeout=2100)
    assert r.returncode == 0, r.stderr[-6000:]
    tag, secs, size = r.stdout.split()[-3:]
    built = next(ln for ln in r.stderr.splitlines() if f"built {tag} in {secs} s" in ln)
    image = {"tag": tag, "build_s": int(secs), "bytes": int(size), "log": built,
             "imports": json.loads((STATE / "gpu-imports.json").read_text()),
             "plan": json.loads((STATE / "gpu-plan.json").read_text())}
    text = json.dumps({"digest": digest, "image": image}, separators=(",", ":"), sort_keys=True)
    GPU_RECORD.write_bytes(gzip.compress(text.encode(), mtime=0))
    return image


@pytest.mark.docker
def test_the_gpu_image_holds_torchs_cuda_build_and_what_serves_with_it(gpu_image):
    v = gpu_image["imports"]
    pinned = next(ln.split("=")[1] for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("ARG TORCH_VERSION="))
    assert v["torch"].split("+")[0] == pinned and v["cuda"] and "+cpu" not in v["torch"], v
    assert v["triton"] == v["triton_pinned_by_torch"], v  # torch's own pin, not this environment's triton
    assert v["kernels"] and v["hetserve"]
    # the bind check reads this wheel's real arch list: every CUDA card the matrix claims from Turing
    # on is driven by it, a Volta (sm_70) is refused at bind (workers/device/build.py)
    archs = v["archs"].split()
    for arch in PREFLIGHT_ARCHS:
        if arch.startswith("sm_"):
            cap = (int(arch[3:-1]), int(arch[-1]))
            assert runs_on(archs, "cuda", cap) is (cap >= (7, 5)), (arch, archs)
    assert (1e9 < gpu_image["bytes"] < 12e9
            and f"built {gpu_image['tag']} in {gpu_image['build_s']} s" in gpu_image["log"])


@pytest.mark.docker
def test_the_gpu_image_compiles_every_kernel_for_a_mixed_host(gpu_image):
    """`hetserve plan --simulate sm_80,sm_89,sm_90 --compile` inside the image, with the triton that
    torch's CUDA wheel pins: every selected kernel compiles and fits on each architecture."""
    devices = gpu_image["plan"]["devices"]
    assert [d["preflight"]["arch"] for d in devices] == ["sm_80", "sm_89", "sm_90"]
    for entry in devices:
        arch = entry["preflight"]["arch"]
        assert_every_kernel_compiled_and_fits(entry, arch)
        # the fp8 GEMM on each card's own tensor cores (Ada's mma.sync and Hopper's wgmma on e4m3)
        gemm = entry["kernels"]["Fp8Linear"]["compiled"]["instruction"]
        assert re.search(EXPECTED_GEMM[arch], gemm), (arch, gemm)


# ------------------------------------------------------------------- the script itself


def test_script_without_an_engine_and_not_root_says_why_and_stops():
    """Guards the root check in scripts/docker_check.sh `engine`: without it, a non-root user
    would run into apt-get and dockerd failures instead of one line saying why."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the script as another user")
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(SCRIPT), "engine"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent"},
    )
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("no Docker engine:") and "root" in line
