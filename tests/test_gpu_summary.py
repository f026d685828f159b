"""scripts/gpu_summary.py: the one table that ends scripts/gpu_check.sh, read from what its steps wrote.

The kernel benchmark's lines come from benchmarks/triton_kernels.py's own `_report`, so a change of its
format without one in the parser fails here; the `--kernels` lines of the fp8 and 4-bit benchmarks need
a GPU to print, so they are written with those benchmarks' f-strings. Each test builds a step directory
as gpu_check.sh leaves it: `steps.tsv`, each step's `NAME.txt`, each worker's `NAME.probe.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_summary  # noqa: E402  (scripts/ is no package)

STEPS = ["env", "gpu-tests", "preflight", "serve-embedded", "start-compile-off", "start-compile-on", "checkpoints",
         "serve-int4", "serve-fp8", "serve-mxfp4", "throughput-off", "throughput-on", "kernels-rmsnorm",
         "kernels-silu", "kernels-fp8", "kernels-paged", "kernels-moe", "kernels-lora", "fp8-kernels",
         "int4-kernels", "gguf-kernels"]  # fmt: skip


def _kernel_lines(capsys, title: str, times: dict, baseline: str = "torch") -> str:
    from benchmarks.triton_kernels import _report

    _report(title, times, baseline, 1 << 20)
    return capsys.readouterr().out


def _fp8_line(name, m, n, k, err, t, t_bf16):  # benchmarks/fp8_checkpoint.py kernels()
    return (f"{name:11} M={m:<4} N={n} K={k}: rel err {err:.1e}  {t * 1e3:.3f} ms vs bf16 {t_bf16 * 1e3:.3f} ms "
            f"({t_bf16 / t:.2f}x)")  # fmt: skip


def _fp8_moe_line(execution, err, t):
    return f"fp8 MoE {execution:11} T={32} E={128} top-8 H={2048} I={768}: rel err {err:.1e}  {t * 1e3:.3f} ms"


def _int4_line(name, err, t, t_16):  # benchmarks/int4_checkpoint.py kernels()
    m, n, k, group, act_order, act, scale_dtype = 1, 4096, 4096, 128, False, "bfloat16", "float16"
    return (f"w4a16 {name:5} {act:8} M={m:<4} N={n:<5} K={k:<4} group={group:<3} "
            f"act_order={act_order!s:5} scales={scale_dtype:8}: "
            f"rel err {err:.1e}  {t * 1e3:.3f} ms vs 16-bit {t_16 * 1e3:.3f} ms "
            f"({t_16 / t:.2f}x)")  # fmt: skip


def _gguf_line(type_name, err, t, t_16):  # benchmarks/gguf_kernels.py kernels()
    m, n, k = 1, 4096, 4096
    return (f"gguf sm90 {type_name:6} M={m:<4} N={n:<5} K={k:<5}: rel err {err:.1e}  bytes 0.281x bf16  "
            f"{t * 1e3:.3f} ms vs 16-bit {t_16 * 1e3:.3f} ms ({t_16 / t:.2f}x)")  # fmt: skip


def _gguf_experts_line(types, err, t, t_loop):  # benchmarks/gguf_kernels.py experts()
    return (f"gguf experts sm90 {types:20} T=1    E=64 top-8 H=2048 I=768: rel err {err:.1e}  grouped "
            f"{t * 1e3:.3f} ms vs per-expert launches {t_loop * 1e3:.3f} ms ({t_loop / t:.2f}x)")  # fmt: skip


def _probe(state="ready", text=" to be happy.", cap=None, reason=""):
    status = {"state": state, "worker_id": "worker-0", "pid": 1, "time": 0.0}
    if state != "ready":
        status |= {"step": "kernelize", "reason": reason}
        return {"status_file": status}
    return {"status_file": status, "capability": {"status": 200, "body": cap or {}},
            "generate": {"status": 200, "body": {"generated_text": text}}}  # fmt: skip


CAPS = {
    "embedded": {"fp8": {"label": "not used (bfloat16)"},
                 "kernels": {"RMSNorm": {"variant": "triton-sm90"}, "PagedAttention": {"variant": "triton-sm90"}}},
    "int4": {"fp8": {"checkpoint": {"quantization": {"execution": "w4a16"}}},
             "kernels": {"Int4CheckpointLinear": {"variant": "triton-w4a16"}}},
    "fp8": {"fp8": {"checkpoint": {"execution": "native", "fmt": "e4m3fn", "kernel": {"variant": "triton-native"}}}},
    "mxfp4": {"fp8": {"checkpoint": {"quantization": {"execution": "w4a16"}}},
              "kernels": {"Mxfp4FusedMoE": {"variant": "triton-mxfp4"}}},
}  # fmt: skip


@pytest.fixture
def work(tmp_path, capsys):
    """A step directory as a GPU run where everything passed leaves it."""
    w = tmp_path
    (w / "steps.tsv").write_text("".join(f"{s}\t0\t12\t60\n" for s in STEPS))
    (w / "env.txt").write_text("torch 2.11.0+cu130 cuda 13.0 triton 3.6.0\ndevice NVIDIA H100 80GB HBM3 (9, 0)\n")
    header = "NVIDIA H100 80GB HBM3 (cuda 9.0); chosen: RMSNorm=triton-sm90, SiluAndMul=triton-sm90\n"
    (w / "kernels-rmsnorm.txt").write_text(
        header + _kernel_lines(capsys, "RMSNorm [1, 4096] bf16", {"torch": 30.0, "sm70": 12.0, "sm90*": 10.0})
        + _kernel_lines(capsys, "RMSNorm [32, 4096] bf16", {"torch": 30.0, "sm70": 12.0, "sm90*": 20.0}))
    (w / "kernels-silu.txt").write_text(
        header + _kernel_lines(capsys, "SiluAndMul [1, 2x14336] bf16", {"torch": 8.0, "sm70": 4.0, "sm90": 2.0}))
    (w / "kernels-fp8.txt").write_text(header + "  native-sm80: not run on this GPU (OutOfResources: shared)\n"
        + _kernel_lines(capsys, "Fp8Linear M=1 N=4096 K=4096", {"bf16 F.linear": 20.0, "torch dequant": 80.0,
                                                                "native-sm90*": 10.0}, "bf16 F.linear"))  # fmt: skip
    (w / "kernels-paged.txt").write_text(header + _kernel_lines(
        capsys, "PagedAttention Gemma 2 local 32 rows x 8192 tokens, 16/8 heads D 256 window 4096 softcap 50.0 bf16",
        {"torch": 500.0, "sm90*": 100.0}))  # fmt: skip
    (w / "kernels-lora.txt").write_text(header + _kernel_lines(
        capsys, "LoraDelta 0 prefill + 32 decode rows, 4 adapters r 8..64, q/k/v 4096->6144 bf16",
        {"torch": 60.0, "sm70": 30.0, "sm90*": 20.0, "rocm": 30.0}))
    (w / "kernels-moe.txt").write_text(header + _kernel_lines(
        capsys, "FusedMoE gpt-oss-20b 32 tokens, E 32 top-4, H 2880 I 2880 (30 experts touched) bf16",
        {"torch": 900.0, "sm90*": 300.0}))  # fmt: skip
    (w / "fp8-kernels.txt").write_text("\n".join([
        _fp8_line("w8a16", 1, 4096, 4096, 3e-3, 2e-5, 3e-5), _fp8_line("w8a8 block", 32, 4096, 4096, 5e-3, 2e-5, 2e-5),
        _fp8_moe_line("weight_only", 1e-2, 4e-4), _fp8_moe_line("native", 2e-2, 3e-4),
        "fp8 checkpoint kernels: ok"]) + "\n")  # fmt: skip
    (w / "int4-kernels.txt").write_text("\n".join([
        _int4_line("sm80", 1e-3, 1e-5, 2e-5), _int4_line("sm80", 2e-3, 4e-5, 2e-5),
        _int4_line("sm90", 1e-3, 1e-5, 3e-5),
        "int4 checkpoint kernels: ok"]) + "\n")  # fmt: skip
    (w / "gguf-kernels.txt").write_text("\n".join([
        _gguf_line("Q4_K", 1e-3, 1e-5, 2e-5), _gguf_line("Q4_K", 3e-3, 4e-5, 2e-5),
        _gguf_line("IQ4_XS", 2e-3, 1e-5, 1e-5),
        "gguf kernels: ok",
        _gguf_experts_line("Q4_K/Q4_K/Q6_K", 4e-3, 1e-4, 1.2e-3),
        _gguf_experts_line("Q4_K/Q4_K/Q6_K", 5e-3, 1e-4, 8e-4),
        "gguf experts: ok"]) + "\n")  # fmt: skip
    for mode, speeds in (("off", (400, 3000)), ("on", (1200, 9000))):
        (w / f"throughput-{mode}.txt").write_text(
            f"compile {mode}: batch 1: {speeds[0]} tokens/s\ncompile {mode}: batch 32: {speeds[1]} tokens/s\n")
        tokens = {"1": {"0": [5, 6, 7]}, "32": {str(i): [i, i + 1] for i in range(32)}}
        (w / f"compile-{mode}.tokens.json").write_text(json.dumps(tokens))
    (w / "gpu-tests.txt").write_text(
        "SKIPPED [1] tests/x.py:3: rocm only\n39 passed, 1 skipped, 467 deselected in 81.20s\n")
    (w / "preflight.txt").write_text("arch sm_90\nagree: 10 layers on sm_90a\n")
    (w / "checkpoints.txt").write_text(
        "int4 checkpoint /w/int4-awq\nfp8 checkpoint /w/fp8-block\nmxfp4 checkpoint /w/mx\n")
    for name, cap in CAPS.items():
        (w / f"{name}.probe.json").write_text(json.dumps(_probe(cap=cap)))
    (w / "compile-on.probe.json").write_text(json.dumps(_probe(cap={"compile": GRAPHS})))
    return w


GRAPHS = {"mode": "on", "enabled": True, "backend": "cudagraphs", "reason": "on: CUDA graphs per batch bucket",
          "buckets": [1, 2, 4, 8, 16, 32], "seconds": 2.5, "state": "ready", "done": 6}  # fmt: skip


def _row(text: str, name: str) -> str:
    rows = [ln for ln in text.splitlines() if ln.startswith(f"  {name} ")]
    assert len(rows) == 1, (name, text)
    return " ".join(rows[0].split())


def test_a_run_where_everything_passed_reads_all_fine(work):
    text, fine = gpu_summary.summarize(work)
    assert fine, text
    assert text.splitlines()[-1] == "all fine"
    assert "device NVIDIA H100 80GB HBM3 (9, 0)" in text
    # the chosen tuning (`*`) against torch, per shape: 30/10 and 30/20
    assert _row(text, "RMSNorm") == "RMSNorm ok (2 shapes) 1.50x..3.00x torch speed"
    assert _row(text, "SiluAndMul") == "SiluAndMul ok (1 shapes) 4.00x torch speed"  # none marked: the fastest
    assert _row(text, "Fp8Linear") == "Fp8Linear ok (1 shapes) 2.00x torch speed"  # vs F.linear, not the dequant
    assert _row(text, "PagedAttention") == "PagedAttention ok (1 shapes) 5.00x torch speed"
    assert _row(text, "FusedMoE") == "FusedMoE ok (1 shapes) 3.00x torch speed"
    assert _row(text, "LoraDelta") == "LoraDelta ok (1 shapes) 3.00x torch speed"
    assert _row(text, "fp8 w8a16") == "fp8 w8a16 ok (1 cases, worst rel err 3.0e-03) 1.50x torch speed"
    assert _row(text, "fp8 MoE native").startswith("fp8 MoE native ok (1 cases, worst rel err 2.0e-02) 0.300 ms")
    assert _row(text, "int4 W4A16 sm80") == (
        "int4 W4A16 sm80 ok (2 cases, worst rel err 2.0e-03) 0.50x..2.00x torch speed")
    assert _row(text, "gguf sm90 Q4_K") == "gguf sm90 Q4_K ok (2 cases, worst rel err 3.0e-03) 0.50x..2.00x torch speed"
    assert _row(text, "gguf experts sm90 Q4_K/Q4_K/Q6_K") == ("gguf experts sm90 Q4_K/Q4_K/Q6_K ok (2 cases, worst "
                                                             "rel err 5.0e-03) 8.00x..12.00x torch speed")
    assert _row(text, "batch 1") == "batch 1 eager 400, graphs 1200 tokens/s (3.00x) greedy tokens equal in 1/1"
    assert _row(text, "batch 32") == "batch 32 eager 3000, graphs 9000 tokens/s (3.00x) greedy tokens equal in 32/32"
    assert _row(text, "graphs worker") == (
        "graphs worker compiled step ready cudagraphs: 6 of 6 buckets, 2.5s; on: CUDA graphs per batch bucket")
    assert _row(text, "embedded model").endswith(
        "ready, answered ' to be happy.' fp8 not used (bfloat16); kernels triton-sm90")
    assert _row(text, "AWQ 4-bit checkpoint").endswith("int4 w4a16 (triton-w4a16)")
    assert _row(text, "block fp8 checkpoint").endswith("fp8 native (triton-native), e4m3fn")
    assert _row(text, "MXFP4 gpt-oss").endswith("mxfp4 w4a16 (triton-mxfp4)")
    assert _row(text, "gpu-marked tests") == "gpu-marked tests 39 passed, 0 failed, 0 error, 1 skipped 467 deselected"
    assert _row(text, "preflight real vs simulated") == "preflight real vs simulated agree 10 layers on sm_90a"
    assert gpu_summary.main([str(work)]) == 0


def _problems(work: Path) -> str:
    text, fine = gpu_summary.summarize(work)
    assert not fine
    assert gpu_summary.main([str(work)]) == 1
    return text.splitlines()[-1]


def test_a_kernel_that_disagrees_with_torch_is_wrong_and_the_others_still_count(work):
    """A failed `assert_close` stops only that kernel's run: its row says WRONG and the shapes before it."""
    text = (work / "kernels-paged.txt").read_text() + (
        "Traceback (most recent call last):\n  File \"benchmarks/triton_kernels.py\", line 160, in bench_paged\n"
        "AssertionError: Tensor-likes are not close!\n")  # fmt: skip
    (work / "kernels-paged.txt").write_text(text)
    (work / "steps.tsv").write_text((work / "steps.tsv").read_text().replace("kernels-paged\t0", "kernels-paged\t1"))
    out, _ = gpu_summary.summarize(work)
    assert _row(out, "PagedAttention").startswith(
        "PagedAttention WRONG after 1 shapes ok: AssertionError: Tensor-likes are not close!")
    assert _row(out, "FusedMoE").startswith("FusedMoE ok")
    assert _problems(work) == (
        "1 problems: PagedAttention: WRONG after 1 shapes ok: AssertionError: Tensor-likes are not close!")


def test_a_checkpoint_kernel_outside_its_tolerance_is_wrong(work):
    (work / "int4-kernels.txt").write_text(
        _int4_line("sm90", 5e-2, 1e-5, 3e-5) + "\nint4 checkpoint kernels: 1 outside tolerance\n")
    (work / "fp8-kernels.txt").write_text(_fp8_moe_line("native", 4e-2, 3e-4) + "\n")  # the MoE's tolerance: 3e-2
    out, _ = gpu_summary.summarize(work)
    assert _row(out, "int4 W4A16 sm90").startswith("int4 W4A16 sm90 WRONG in 1 (1 cases")
    assert _row(out, "fp8 MoE native").startswith("fp8 MoE native WRONG in 1 (1 cases")
    assert _problems(work).startswith("2 problems")


def test_timed_out_skipped_and_failed_steps_each_say_so(work):
    steps = (work / "steps.tsv").read_text()
    steps = steps.replace("kernels-moe\t0", "kernels-moe\t124")
    steps = steps.replace("int4-kernels\t0\t12\t60", "int4-kernels\tskipped\t0\t0")
    steps = steps.replace("gpu-tests\t0", "gpu-tests\t1").replace("throughput-on\t0", "throughput-on\t137")
    (work / "steps.tsv").write_text(steps)
    (work / "int4-kernels.txt").unlink()
    (work / "gpu-tests.txt").write_text(
        "FAILED tests/test_selftest.py::test_x - AssertionError\n1 failed, 38 passed in 9.00s\n")
    (work / "fp8.probe.json").write_text(json.dumps(_probe("failed", reason="StartupError: the torch path failed")))
    (work / "compile-on.tokens.json").write_text(json.dumps({"1": {"0": [5, 6, 8]}, "32": {}}))
    out, _ = gpu_summary.summarize(work)
    assert _row(out, "FusedMoE") == "FusedMoE timed out after 12s (1 shapes ok) 3.00x torch speed"
    assert _row(out, "int4 checkpoint kernels") == "int4 checkpoint kernels skipped: no time left -"
    assert _row(out, "gpu-marked tests").startswith("gpu-marked tests 38 passed, 1 failed, 0 error")
    assert _row(out, "block fp8 checkpoint") == (
        "block fp8 checkpoint NOT READY (failed in kernelize) StartupError: the torch path failed")
    assert _row(out, "batch 1").endswith("greedy tokens equal in 0/1")
    assert _row(out, "batch 32").endswith("greedy tokens not compared")
    assert _row(out, "compile on").startswith("compile on timed out after 12s")
    assert _problems(work).startswith("7 problems")


def test_a_preflight_that_disagrees_names_the_records(work):
    (work / "preflight.txt").write_text("arch sm_90\nRMSNorm _rms_norm sm90: ok True != False\n")
    (work / "steps.tsv").write_text((work / "steps.tsv").read_text().replace("preflight\t0", "preflight\t1"))
    out, _ = gpu_summary.summarize(work)
    assert _row(out, "preflight real vs simulated") == (
        "preflight real vs simulated DISAGREE in 1 records RMSNorm _rms_norm sm90: ok True != False")


def test_nothing_ran_gives_every_row_a_problem_and_no_traceback(tmp_path, capsys):
    """A run that died at once (no CUDA, no wheels) still prints the whole table, every row not fine."""
    text, fine = gpu_summary.summarize(tmp_path)
    assert not fine
    assert "device: unknown" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("  ")]
    assert len(rows) == 6 + 3 + 2 + 2 + 4 + 2  # kernels, fp8/int4/gguf runs, batches, compile modes, workers, tests
    assert gpu_summary.main([str(tmp_path / "missing")]) == 2
    assert "usage" in capsys.readouterr().out


def test_a_benchmark_without_cuda_says_not_run(work):
    (work / "kernels-rmsnorm.txt").write_text(
        "benchmarks/triton_kernels.py: skipped, no CUDA device "
        "(the kernels need a GPU; CPU runs the torch reference)\n")
    (work / "fp8-kernels.txt").write_text("--kernels needs a CUDA or ROCm device\n")
    (work / "gguf-kernels.txt").write_text("gguf kernels need a CUDA or ROCm device\n")
    out, _ = gpu_summary.summarize(work)
    assert _row(out, "gguf kernels") == "gguf kernels not run: no CUDA device -"
    assert _row(out, "RMSNorm") == "RMSNorm not run: no CUDA device -"
    assert _row(out, "fp8 checkpoint kernels") == "fp8 checkpoint kernels not run: no CUDA device -"


def test_graphs_still_compiling_when_measured_is_a_problem(work):
    """The graphs figures count only once the compiled step is in use: a worker still compiling says so."""
    (work / "compile-on.probe.json").write_text(json.dumps(_probe(cap={"compile": GRAPHS | {"state": "compiling",
                                                                                            "done": 2}})))
    out, _ = gpu_summary.summarize(work)
    assert _row(out, "graphs worker").startswith("graphs worker compiled step compiling cudagraphs: 2 of 6 buckets")
    assert _problems(work).startswith("1 problems: graphs worker: compiled step compiling")
