"""The CPU's int8 GGUF GEMV (cpu_gguf.cpp `gguf_gemv_int8`) and `--gguf-activations`, end to end in a worker's pieces.

What must hold, for each type the CPU kernel decodes:
- the int8 GEMV equals the float32 matmul of gguf-py's dequantized weight with the rows rounded as
  `round_rows_reference` rounds them (8 bits per 256 inputs, a shorter group at the tail), within
  fp32 rounding, for 1..15 rows with and without a bias; and it is not the exact GEMV;
- a row's output depends neither on its batch mates nor on the thread count; a zero row is exact;
- codes at their extremes (every activation at +-127, every weight code at its largest) sum in int32
  without overflow or saturation;
- from `GEMV_MAX_M` rows (a prompt's) nothing is rounded;
- the worker's flag reaches every GGUF layer, its kernel layer, the description and the prefix cache's root.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from kernels_local.gguf_linear import cpu  # noqa: E402
from kernels_local.gguf_linear.reference import BLOCKS  # noqa: E402
from tests.test_kernels_gguf_linear import _weight  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu.KERNEL.load().available or not cpu.int8_runs(),
                                reason="the C++ kernel's int8 GEMV does not run here (no AVX2)")


def _dense(raw: torch.Tensor, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw.numpy(), T[name])))


def _int8(x: torch.Tensor, raw: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    return cpu.KERNEL.module.gguf_gemv_int8(x, raw, cpu.TYPES[name], bias)


def _inputs(name: str) -> int:
    """K: several 256-groups and, for the 32-blocks, a tail group of 64."""
    qk, _ = BLOCKS[name]
    return 2 * qk if qk == 256 else 10 * qk


@pytest.mark.parametrize("name", list(cpu.TYPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, cpu.GEMV_MAX_M - 1])
def test_the_int8_gemv_is_the_matmul_of_the_rounded_rows(name, m):
    k, n = _inputs(name), 37
    raw = _weight(name, n, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k + 5, generator=gen)[:, :k]  # rows apart in memory
    bias = torch.randn(n, generator=gen) if m % 2 else None
    got = _int8(x, raw, name, bias)
    dense = _dense(raw, name)
    want = torch.nn.functional.linear(cpu.round_rows_reference(x), dense, bias)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    exact = torch.nn.functional.linear(x, dense, bias)  # the rounding is there: far more than fp32's apart
    assert float((got - exact).abs().max()) > 1e-4 * scale


def test_the_rounding_is_per_256_inputs_with_a_short_tail():
    """Guards `round_rows`' group bounds: a row whose first 256 inputs are tiny and whose 64-input tail
    is large keeps the tiny ones (one step for the whole row would round them all to zero)."""
    k = 320
    raw = _weight("Q8_0", 8, k, seed=1)
    x = torch.cat([torch.full((1, 256), 1e-3), torch.full((1, 64), 50.0)], dim=1)
    rounded = cpu.round_rows_reference(x)
    assert torch.equal(rounded[0, :256], torch.full((256,), 1e-3)) and torch.equal(rounded[0, 256:], x[0, 256:])
    got = _int8(x, raw, "Q8_0")
    torch.testing.assert_close(got, torch.nn.functional.linear(rounded, _dense(raw, "Q8_0")), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", list(cpu.TYPES))
def test_extreme_codes_sum_without_overflow(name):
    """Every activation code at +127 or -127 (alternating signs per 32) and the weight's blocks of all-ones
    bytes (Q6_K's codes 63 - 32, Q4_K's 15, Q8_0's 1, ...) with their scales as written: the int32 sums are
    exact, the output the float32 matmul's."""
    k, n = _inputs(name), 16
    raw = _weight(name, n, k, seed=2).clone()
    qk, size = BLOCKS[name]
    blocks = raw.view(n, k // qk, size)
    code_bytes = {"Q8_0": slice(2, 34), "Q4_0": slice(2, 18), "Q4_K": slice(16, 144), "Q5_K": slice(16, 176),
                  "Q6_K": slice(0, 192)}[name]
    blocks[:, :, code_bytes] = 0x7F if name == "Q8_0" else 0xFF  # the largest code every element holds
    signs = torch.tensor([1.0, -1.0]).repeat_interleave(32).repeat(k // 64)
    x = (signs * 3.0).unsqueeze(0)  # every code +-127
    got = _int8(x, raw, name)
    want = torch.nn.functional.linear(x, _dense(raw, name))
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_rows_output_depends_neither_on_its_batch_mates_nor_on_the_threads(name):
    k = _inputs(name)
    raw = _weight(name, 197, k, seed=9)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(9))
    x[3] = 0  # a zero row: its step is zero, its output exactly zero
    together = _int8(x, raw, name)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([_int8(x[i : i + 1], raw, name) for i in range(7)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together[3], torch.zeros(197))


def test_a_prompts_rows_are_never_rounded():
    """`gguf_linear_int8` from `GEMV_MAX_M` rows takes the exact panels; below, the int8 GEMV."""
    raw = _weight("Q4_K", 40, 256, seed=3)
    x = torch.randn(cpu.GEMV_MAX_M, 256, generator=torch.Generator().manual_seed(3))
    assert torch.equal(cpu.gguf_linear_cpu(x, raw, "Q4_K", None, int8=True), cpu.gguf_linear_cpu(x, raw, "Q4_K", None))
    few = x[:3]
    assert torch.equal(cpu.gguf_linear_cpu(few, raw, "Q4_K", None, int8=True), _int8(few, raw, "Q4_K"))


def test_a_compiled_graph_calls_the_int8_operator_itself():
    """Guards the `gguf_linear_int8` entry of cpu.py's `fakes`: Dynamo traces it into one call."""
    from torch._dynamo.testing import CompileCounterWithBackend

    raw = _weight("Q4_K", 40, 256, seed=4)
    x = torch.randn(2, 1, 256, generator=torch.Generator().manual_seed(4))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: cpu.gguf_linear_cpu(t, raw, "Q4_K", None, int8=True), backend=counter,
                             fullgraph=True)  # fmt: skip
    assert torch.equal(compiled(x), cpu.gguf_linear_cpu(x, raw, "Q4_K", None, int8=True))
    assert "hetserve_cpu.gguf_linear_int8" in str(counter.graphs[0].code)


def test_the_flag_reaches_the_layers_the_kernel_layer_and_the_cache_root():
    """`set_activations` sets every GGUF layer (a fused module's parts too); the CPU kernel layer then
    runs the int8 GEMV; the prefix cache's root differs from the exact worker's (their blocks differ)."""
    from kernels_local.gguf_linear.layers import GGUFLinearCpu
    from workers.contract import WorkerConfig
    from workers.contract.config import WorkerConfigError
    from workers.engine.build import numerics
    from workers.gguf.linear import GGUFFusedLinear, GGUFLinear, set_activations

    fused = GGUFFusedLinear(256, [("Q4_K", 8), ("Q6_K", 4)], device="cpu")
    model = torch.nn.Sequential(GGUFLinear(256, 8, "Q4_K", device="cpu"), fused)
    for layer, seed in zip((model[0], *fused.parts), range(3), strict=True):
        layer.qweight.copy_(_weight(layer.gguf_type, layer.out_features, 256, seed=seed))
    assert set_activations(model, "int8") == 3
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    part = fused.parts[1]
    assert GGUFLinearCpu.forward(part, x).equal(_int8(x, part.qweight, "Q6_K"))
    with pytest.raises(ValueError, match="Accepted: exact, int8"):
        set_activations(model, "int4")
    with pytest.raises(WorkerConfigError, match="`--gguf-activations int4` is not accepted. Accepted: exact, int8"):
        WorkerConfig(socket="/tmp/s", gguf_activations="int4")
    exact, int8 = WorkerConfig(socket="/tmp/s"), WorkerConfig(socket="/tmp/s", gguf_activations="int8")
    assert numerics(exact) == ("none",) and numerics(int8) != numerics(exact)


def test_the_router_flag_reaches_the_workers_config():
    from server.cli import build_parser
    from server.config.settings import RouterSettings
    from server.fleet.spec import worker_config
    from workers.contract.device import DeviceInfo

    args = build_parser().parse_args(["serve", "--simulate", "cpu", "--gguf-activations", "int8"])
    settings = RouterSettings.from_args(args)
    device = DeviceInfo(index=0, uuid="cpu-0", name="cpu", type="cpu", capability=None, memory_total_bytes=2**34,
                        simulated=True, arch="cpu")
    config = worker_config("w0", device, settings, "/tmp/w0.sock", "/tmp/w0.json", 1, 1, environ={})
    assert settings.gguf_activations == "int8" and config.gguf_activations == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--gguf-activations", "int4"])


def test_a_worker_started_with_int8_says_so_and_answers(tmp_path):
    """Guards `set_activations` in workers/main.py: the worker's own layers take the flag (their
    description reads them), and it generates with them."""
    from tests.test_worker_process import client, start_worker, wait_state
    from workers.gguf.prepare import prepare

    model = prepare(Path(__file__).parent / "llama_cpp" / "llama-Q4_K_M.gguf", tmp_path / "prepared")
    proc, sock, status = start_worker(tmp_path, model, "--dtype", "float32", "--max-batch", "2", "--compile", "off",
                                      "--gguf-activations", "int8")  # fmt: skip
    try:
        wait_state(proc, status, {"ready"}, timeout=120)
        with client(sock) as c:
            described = c.get("/capability").json()["model"]["gguf"]
            tokens = c.post("/generate", json={"inputs": "Once upon a time", "parameters": {
                "max_new_tokens": 4, "details": True}}).json()["details"]["tokens"]
    finally:
        proc.kill()
        proc.wait()
    assert described["activations"] == "int8" and "--gguf-activations int8" in described["reason"], described
    assert described["execution"].startswith("packed") and len(tokens) == 4
