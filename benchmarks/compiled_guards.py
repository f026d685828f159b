"""What Dynamo's guards cost the compiled decode step: the worker's step (guards on the model's
submodules and weights dropped, workers/engine/compiled.py `skip_model_state_guards`) against
the same step keeping every guard, side by side in one process.

Design: two compiled decodes of one model, each over its own paged pool and its own copy of the
step's code (`own_code`), stepped alternately, so the machine's noise hits both alike; the median
per step is reported with the ratio (all guards / the worker's: above 1 means the dropped guards
cost that much). The model is prepared as a CPU worker prepares it (kernelized, its projections
packed) and stepped as benchmarks/decode_vs_transformers.py steps it (`Ours`), on the same
checkpoints (`--arch`: llama is tests/checkpoints.py's, the others bench_config's).
Trade-off: the guards' cost is fixed per step, so it shows most where the step is short (batch
1, bfloat16) and least on larger models.

    python benchmarks/compiled_guards.py [--arch llama qwen3_moe] [--dtype float32 bfloat16]
        [--batch 1 32] [--steps 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_vs_transformers as dvt  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["llama", "qwen3_moe"])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    try:
        arches = dvt.arch_names(args.arch)
    except ValueError as e:
        parser.error(str(e))

    from workers.device.bind import BoundDevice
    from workers.engine import compiled
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.cpu_projections import install_cpu_projections
    from workers.model.loader import load_model

    cpu = BoundDevice("cpu", 0, "cpu", "cpu", None, 0, False)
    worker_filter = compiled.skip_model_state_guards
    print(f"{'arch':<11}{'dtype':<10}{'batch':>6}{'worker ms':>11}{'all guards ms':>15}{'ratio':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in arches:
            ckpt, _ = dvt.checkpoint(arch, Path(tmp) / arch)
            for dtype in args.dtype:
                lm = load_model(ckpt, dtype=dtype)
                kernelize_for_device(lm.model, cpu)
                install_cpu_projections(lm.model, "cpu", lm.dtype)
                if not dvt.compiles(lm, "auto"):
                    print(f"{arch:<11}{dtype:<10}  eager: no compiled step to guard")
                    continue
                max_len = 64 + args.steps + 16
                for batch in args.batch:
                    ours = dvt.Ours(lm, batch, 64, max_len, compiled=True)
                    compiled.skip_model_state_guards = lambda entries: [True] * len(entries)
                    try:
                        every = dvt.Ours(lm, batch, 64, max_len, compiled=True)
                    finally:
                        compiled.skip_model_state_guards = worker_filter
                    for _ in range(5):
                        ours.step(), every.step()
                    a, b = [], []
                    for _ in range(args.steps):
                        a.append(dvt.timed(ours.step))
                        b.append(dvt.timed(every.step))
                    ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
                    print(f"{arch:<11}{dtype:<10}{batch:>6}{ma:>11.3f}{mb:>15.3f}{mb / ma:>7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
