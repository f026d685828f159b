"""The one table that ends scripts/gpu_check.sh, from the files its steps wrote in one directory.

Design: the GPU check runs each step under a time budget and keeps its raw output (`NAME.txt`, a
line per step in `steps.tsv`, each worker's `NAME.probe.json`); this module only reads them, so a
step that crashed, timed out or never ran still gets its row, saying which. It imports nothing
beyond the standard library: it runs on the GPU machine before anything is installed, and its tests
run anywhere. The parsers follow the exact print formats of benchmarks/triton_kernels.py,
benchmarks/fp8_checkpoint.py --kernels and benchmarks/int4_checkpoint.py --kernels; a format
change there without one here shows up as a kernel row with no measurements.

    python scripts/gpu_summary.py WORK_DIR      # the table; exit 1 when a row shows a problem
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import NamedTuple

TIMED_OUT = {"124", "137"}  # coreutils `timeout`: the budget ran out (137: killed after the grace period)
KERNEL_RUNS = {"rmsnorm": "RMSNorm", "silu": "SiluAndMul", "fp8": "Fp8Linear", "paged": "PagedAttention",
               "moe": "FusedMoE", "lora": "LoraDelta"}  # fmt: skip
_ENTRY = re.compile(r"^(?P<name>.+?) (?P<us>[\d.]+) us(?:, \d+ GB/s)?(?:, x(?P<ratio>[\d.]+))?$")
_FP8_LINEAR = re.compile(r"^(?P<name>w8a16|w8a8 block)\s+M=.*: rel err (?P<err>\S+)\s+[\d.]+ ms vs bf16 [\d.]+ ms "
                         r"\((?P<ratio>[\d.]+)x\)$")  # fmt: skip
_FP8_MOE = re.compile(r"^fp8 MoE (?P<name>\S+)\s+T=.*: rel err (?P<err>\S+)\s+(?P<ms>[\d.]+) ms$")
_INT4 = re.compile(r"^w4a16 (?P<name>\S+)\s+\S+\s+M=.*: rel err (?P<err>\S+)\s+[\d.]+ ms vs 16-bit [\d.]+ ms "
                   r"\((?P<ratio>[\d.]+)x\)$")  # fmt: skip
_GGUF = re.compile(r"^gguf (?P<name>\S+\s+\S+)\s+M=.*: rel err (?P<err>\S+)\s+bytes [\d.]+x bf16\s+[\d.]+ ms vs "
                   r"16-bit [\d.]+ ms \((?P<ratio>[\d.]+)x\)$")  # fmt: skip
_GGUF_EXPERTS = re.compile(r"^gguf experts (?P<name>\S+\s+\S+)\s+T=.*: rel err (?P<err>\S+)\s+grouped [\d.]+ ms vs "
                           r"per-expert launches [\d.]+ ms \((?P<ratio>[\d.]+)x\)$")  # fmt: skip
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b")
_TOKENS_PER_S = re.compile(r"^compile (on|off): batch (\d+): (\d+) tokens/s$")


class Row(NamedTuple):
    """One line of the table: what, its result, a detail, and whether it is fine."""

    name: str
    result: str
    detail: str
    ok: bool


def read(work: Path, name: str) -> str:
    try:
        return (work / name).read_text(errors="replace")
    except OSError:
        return ""


def steps(work: Path) -> dict[str, dict]:
    """Each step's `rc` (a number, `skipped` or `not ready`), seconds and budget, from steps.tsv."""
    out = {}
    for line in read(work, "steps.tsv").splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            out[parts[0]] = {"rc": parts[1], "seconds": parts[2], "budget": parts[3]}
    return out


def step_problem(step: dict | None) -> str | None:
    """Why a step gave no complete result, or None when it ran to its end."""
    if step is None:
        return "not run"
    rc = step["rc"]
    if rc in TIMED_OUT:
        return f"timed out after {step['seconds']}s"
    if rc == "skipped":
        return "skipped: no time left"
    if rc == "not ready":
        return "skipped: its worker was not ready"
    return None


def error_line(text: str) -> str:
    """The exception a Python traceback ended with (its last `Name: message` line), else ''."""
    if "Traceback" not in text:
        return ""
    lines = [ln for ln in text.splitlines() if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)]
    return lines[-1][:160] if lines else "a traceback"


def _range(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.2f}x torch speed" if lo == hi else f"{lo:.2f}x..{hi:.2f}x torch speed"


def triton_kernel_row(text: str, step: dict | None) -> tuple[str, str, bool]:
    """(correct, time, fine) for one kernel's run of benchmarks/triton_kernels.py. A shape's line is printed
    only after every tuning passed `assert_close` against torch; the time is the tuning `select()` picks
    (`*`), or the fastest where none is marked, as torch time / kernel time."""
    shapes, ratios = 0, []
    for line in text.splitlines():
        _, sep, rest = line.partition(": ")
        entries = [_ENTRY.match(e) for e in rest.split("; ")] if sep else []
        if not entries or not all(entries) or entries[0]["ratio"] is not None:
            continue  # the header (device and choices), a "not run on this GPU" line, noise
        shapes += 1
        timed = [(m["name"], float(m["ratio"])) for m in entries[1:] if m["ratio"] and m["name"] != "torch dequant"]
        chosen = [r for n, r in timed if n.endswith("*")]
        if chosen or timed:
            ratios.append(chosen[0] if chosen else max(r for _, r in timed))
    error, problem = error_line(text), step_problem(step)
    if "skipped, no CUDA device" in text:
        return "not run: no CUDA device", "-", False
    if error:
        what = "WRONG" if "AssertionError" in error or "not close" in error else "ERROR"
        return f"{what} after {shapes} shapes ok: {error}", _range(ratios), False
    if problem:
        return f"{problem} ({shapes} shapes ok)" if shapes else problem, _range(ratios), False
    if shapes == 0:
        rc = step and step["rc"]
        return ("not run on this GPU", "-", True) if rc == "0" else (f"no result (rc {rc})", "-", False)
    return f"ok ({shapes} shapes)", _range(ratios), True


def _checked_rows(text: str, step: dict | None, patterns: list[tuple[re.Pattern, str, float]],
                  label: str) -> list[Row]:  # fmt: skip
    """(kernel, correct, time) per kernel of a `--kernels` run: each case's rel error against its tolerance."""
    rows: dict[str, dict] = {}
    for line in text.splitlines():
        for pattern, prefix, tolerance in patterns:
            m = pattern.match(line.strip())
            if not m:
                continue
            row = rows.setdefault(f"{prefix} {m['name']}", {"n": 0, "bad": 0, "worst": 0.0, "ratios": [], "ms": []})
            err = float(m["err"])
            row["n"] += 1
            row["bad"] += err > tolerance
            row["worst"] = max(row["worst"], err)
            if "ratio" in m.groupdict():
                row["ratios"].append(float(m["ratio"]))
            else:
                row["ms"].append(float(m["ms"]))
    out = []
    for name, r in rows.items():
        ok = "ok" if not r["bad"] else f"WRONG in {r['bad']}"
        time = _range(r["ratios"]) if r["ratios"] else f"{max(r['ms']):.3f} ms (not timed against torch)"
        out.append(Row(name, f"{ok} ({r['n']} cases, worst rel err {r['worst']:.1e})", time, not r["bad"]))
    if "--kernels needs" in text or "kernels need a CUDA" in text:
        return out + [Row(label, "not run: no CUDA device", "-", False)]
    problem = step_problem(step) or error_line(text)
    if problem or not out or (step and step["rc"] not in ("0", "1")):
        out.append(Row(label, problem or f"no result (rc {step and step['rc']})", "-", False))
    return out


def kernel_rows(work: Path, done: dict) -> list[Row]:
    rows = [Row(layer, *triton_kernel_row(read(work, f"kernels-{run}.txt"), done.get(f"kernels-{run}")))
            for run, layer in KERNEL_RUNS.items()]  # fmt: skip
    rows += _checked_rows(read(work, "fp8-kernels.txt"), done.get("fp8-kernels"),
                          [(_FP8_LINEAR, "fp8", 2e-2), (_FP8_MOE, "fp8 MoE", 3e-2)], "fp8 checkpoint kernels")
    rows += _checked_rows(read(work, "int4-kernels.txt"), done.get("int4-kernels"),
                          [(_INT4, "int4 W4A16", 1e-2)], "int4 checkpoint kernels")
    rows += _checked_rows(read(work, "gguf-kernels.txt"), done.get("gguf-kernels"),
                          [(_GGUF, "gguf", 2e-2), (_GGUF_EXPERTS, "gguf experts", 2e-2)], "gguf kernels")
    return rows


def throughput_rows(work: Path, done: dict) -> list[Row]:
    """Eager against CUDA graphs tokens/s at each batch, and whether their greedy tokens agree."""
    speed: dict[tuple[str, str], int] = {}
    for mode in ("off", "on"):
        for line in read(work, f"throughput-{mode}.txt").splitlines():
            m = _TOKENS_PER_S.match(line.strip())
            if m:
                speed[m[1], m[2]] = int(m[3])
    tokens = {}
    for mode in ("off", "on"):
        try:
            tokens[mode] = json.loads(read(work, f"compile-{mode}.tokens.json"))
        except ValueError:
            tokens[mode] = {}
    rows = []
    for batch in ("1", "32"):
        eager, graphs = speed.get(("off", batch)), speed.get(("on", batch))
        off, on = tokens["off"].get(batch, {}), tokens["on"].get(batch, {})
        equal = sum(off[i] == on.get(i) for i in off)
        same = f"greedy tokens equal in {equal}/{len(off)}" if off and on else "greedy tokens not compared"
        figures = f"eager {eager or '-'}, graphs {graphs or '-'} tokens/s"
        if eager and graphs:
            figures += f" ({graphs / eager:.2f}x)"
        rows.append(Row(f"batch {batch}", figures, same, bool(eager and graphs and off and equal == len(off))))
    try:
        compiled = json.loads(read(work, "compile-on.probe.json"))["capability"]["body"]["compile"] or {}
    except (ValueError, KeyError, TypeError):
        compiled = None
    if compiled is not None:  # what the graphs worker ran: its compiled step in use, or why not
        state = compiled.get("state", "in use" if compiled.get("enabled") else "off")
        rows.append(Row("graphs worker", f"compiled step {state}", f"{compiled.get('backend')}: "
                        f"{compiled.get('done', '?')} of {len(compiled.get('buckets') or [])} buckets, "
                        f"{compiled.get('seconds', '?')}s; {compiled.get('reason', '')}"[:160],
                        bool(compiled.get("enabled")) and state in ("ready", "in use")))  # fmt: skip
    for mode in ("off", "on"):
        step = done.get(f"throughput-{mode}")
        if step is None or step["rc"] != "0":
            start = step_problem(done.get(f"start-compile-{mode}")) or status_reason(work, f"compile-{mode}")
            rows.append(Row(f"compile {mode}", step_problem(step) or f"failed (rc {step['rc']})", start, False))
    return rows


def status_reason(work: Path, name: str) -> str:
    try:
        status = json.loads(read(work, f"{name}.json"))
    except ValueError:
        return "no status file"
    return f"{status.get('state')} {status.get('step', '')}: {str(status.get('reason', ''))[:120]}".strip()


def execution(kind: str, cap: dict) -> str:
    """How the worker runs its model, as its /capability says."""
    try:
        fp8, kernels = cap.get("fp8") or {}, cap.get("kernels") or {}
        if kind == "fp8":
            ck = fp8["checkpoint"]
            return f"fp8 {ck['execution']} ({ck['kernel']['variant']}), {ck.get('fmt', '?')}"
        if kind in ("int4", "mxfp4"):
            q = fp8["checkpoint"]["quantization"]
            layer = "Int4CheckpointLinear" if kind == "int4" else "Mxfp4FusedMoE"
            return f"{kind} {q['execution']} ({kernels.get(layer, {}).get('variant', '?')})"
        variants = sorted({k.get("variant", "?") for k in kernels.values()})
        return f"fp8 {fp8.get('label', '?')}; kernels {', '.join(variants)}"
    except (KeyError, TypeError, AttributeError) as e:
        return f"not said by /capability ({type(e).__name__}: {e})"


WORKERS = {"embedded": "embedded model", "int4": "AWQ 4-bit checkpoint", "fp8": "block fp8 checkpoint",
           "mxfp4": "MXFP4 gpt-oss"}  # fmt: skip


def worker_rows(work: Path, done: dict) -> list[Row]:
    rows = []
    for name, label in WORKERS.items():
        step = done.get(f"serve-{name}")
        try:
            probe = json.loads(read(work, f"{name}.probe.json"))
        except ValueError:
            probe = None
        if probe is None:
            if name == "mxfp4" and "mxfp4 checkpoint skipped" in read(work, "checkpoints.txt"):
                rows.append(Row(label, "not run: this python cannot write the tiny gpt-oss", "-", True))
            else:
                why = step_problem(step) or step_problem(done.get("checkpoints")) or "no probe"
                rows.append(Row(label, why, error_line(read(work, "checkpoints.txt")), False))
            continue
        status = probe.get("status_file") or {}
        if status.get("state") != "ready":
            rows.append(Row(label, f"NOT READY ({status.get('state')} in {status.get('step', '?')})",
                            str(status.get("reason", ""))[:160], False))  # fmt: skip
            continue
        gen = probe.get("generate") or {}
        body = gen.get("body") if isinstance(gen.get("body"), dict) else {}
        text = body.get("generated_text")
        answer = f"answered {text[:40]!r}" if text else f"NO ANSWER ({gen.get('error') or gen.get('status')})"
        cap = (probe.get("capability") or {}).get("body") or {}
        rows.append(Row(label, f"ready, {answer}", execution(name, cap), bool(text)))
    return rows


def gpu_tests_row(work: Path, done: dict) -> Row:
    text, step = read(work, "gpu-tests.txt"), done.get("gpu-tests")
    final = [ln for ln in text.splitlines() if re.search(r"\bin [\d.]+s\b", ln) and _PYTEST_COUNT.search(ln)]
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in _PYTEST_COUNT.findall(final[-1])} \
        if final else {}  # fmt: skip
    shown = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    problem = step_problem(step)
    if not final:
        why = problem or f"no pytest summary (rc {step and step['rc']})"
        return Row("gpu-marked tests", why, error_line(text), False)
    fine = not problem and counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error")
    return Row("gpu-marked tests", shown + (f" ({problem})" if problem else ""),
               f"{counts.get('deselected', 0)} deselected", fine)  # fmt: skip


def preflight_row(work: Path, done: dict) -> Row:
    text, step = read(work, "preflight.txt"), done.get("preflight")
    agree = [ln for ln in text.splitlines() if ln.startswith("agree: ")]
    if agree:
        return Row("preflight real vs simulated", "agree", agree[-1].removeprefix("agree: "), True)
    problem = step_problem(step)
    diffs = [ln for ln in text.splitlines() if ":" in ln and not ln.startswith("arch ")]
    if problem or not step or step["rc"] != "1" or error_line(text) or not diffs:
        why = problem or f"failed (rc {step and step['rc']})"
        return Row("preflight real vs simulated", why, error_line(text) or text.strip()[-160:], False)
    return Row("preflight real vs simulated", f"DISAGREE in {len(diffs)} records", "; ".join(diffs[:3])[:160], False)


def table(title: str, rows: list[Row]) -> list[str]:
    w0 = max(len(r.name) for r in rows)
    w1 = min(max(len(r.result) for r in rows), 60)
    return [title] + [f"  {r.name:<{w0}}  {r.result:<{w1}}  {r.detail}".rstrip() for r in rows]


def summarize(work: Path) -> tuple[str, bool]:
    """The summary table and whether every row is fine."""
    done = steps(work)
    env = read(work, "env.txt").strip().splitlines()
    sections = [
        ("kernels against torch (correct; time: torch time / kernel time)", kernel_rows(work, done)),
        ("decode step, eager (--compile off) against CUDA graphs (--compile on)", throughput_rows(work, done)),
        ("workers on the GPU (ready, the answer, the execution /capability reports)", worker_rows(work, done)),
        ("tests and preflight", [gpu_tests_row(work, done), preflight_row(work, done)]),
    ]
    problems = [f"{r.name}: {r.result}" for _, rows in sections for r in rows if not r.ok]
    lines = ["GPU check summary", *(env or ["device: unknown (no env step output)"]), ""]
    for title, rows in sections:
        lines += table(title, rows) + [""]
    lines.append("steps (rc seconds/budget): " + "; ".join(
        f"{k} {v['rc']} {v['seconds']}/{v['budget']}s" for k, v in done.items()))  # fmt: skip
    lines.append("all fine" if not problems else f"{len(problems)} problems: " + "; ".join(problems))
    return "\n".join(lines), not problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python scripts/gpu_summary.py WORK_DIR (the directory scripts/gpu_check.sh's steps wrote)")
        return 2
    text, fine = summarize(Path(args[0]))
    print(text)
    return 0 if fine else 1


if __name__ == "__main__":
    sys.exit(main())
