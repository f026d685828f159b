"""Greedy agreement of fp8 (both conventions) with bf16 on the embedded model, side by side.

    .venv/bin/python benchmarks/fp8_agreement.py [--model DIR] [--prompts 32] [--new-tokens 24]

Prompts are the first words of held-out fortunes. The bf16 model generates greedy
continuations; each other variant is teacher-forced along them and scored on how often its
argmax is the same next token. fp32 is the noise floor. Native (sm_90) and emulated (sm_80)
fp8 share the same quantized weights, so their logits must be bit-identical.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.contract import (
    DEFAULT_MODEL_DIR,  # noqa: E402
    simulated_device,  # noqa: E402
)
from workers.device.bind import BoundDevice  # noqa: E402
from workers.kernelize.apply import kernelize_for_device  # noqa: E402
from workers.model.loader import load_model  # noqa: E402
from workers.quant.fp8_convention import choose_fp8  # noqa: E402
from workers.quant.quantize_model import quantize_model  # noqa: E402


def simulated(token: str) -> BoundDevice:
    d = simulated_device(token, 0)
    return BoundDevice(d.type, d.index, d.uuid, d.name, d.capability, d.memory_total_bytes, True, d.arch)


def prompts(model_dir: Path, tokenizer, n: int, words: int = 4) -> list[list[int]]:
    lines = [ln.strip() for ln in (model_dir / "heldout_sample.txt").read_text().splitlines()
             if len(ln.split()) >= words]
    return [tokenizer.encode(" ".join(ln.split()[:words])).ids for ln in lines[:n]]


@torch.no_grad()
def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


@torch.no_grad()
def agreement(model, seqs: list[tuple[int, list[int]]]) -> tuple[int, int, list[torch.Tensor]]:
    agree = total = 0
    logits = []
    for plen, ids in seqs:
        out = model(torch.tensor([ids]))[0].float()  # [S, V]
        pred = out[plen - 1 : -1].argmax(-1)
        agree += int((pred == torch.tensor(ids[plen:])).sum())
        total += pred.numel()
        logits.append(out)
    return agree, total, logits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(1)
    bf16 = load_model(args.model, "bfloat16")
    seqs = [(len(pr), greedy(bf16.model, pr, args.new_tokens))
            for pr in prompts(args.model, bf16.tokenizer, args.prompts)]
    rows = {"fp32 (noise floor)": load_model(args.model, "float32").model}
    for token in ("sm_90", "sm_80"):
        m = copy.deepcopy(bf16.model)
        kernelize_for_device(m, simulated(token))
        conv, _ = choose_fp8("cuda", simulated(token).capability)
        quantize_model(m, conv)
        rows[f"fp8 {conv.name} ({token})"] = m
    print(f"model {args.model}, {len(seqs)} prompts x {args.new_tokens} greedy tokens from bf16")
    logits = {}
    for name, model in rows.items():
        a, t, logits[name] = agreement(model, seqs)
        print(f"  {name:<28} agrees with bf16 on {a}/{t} = {a / t:.3f}")
    native, emulated = (logits[k] for k in rows if k.startswith("fp8"))
    same = all(torch.equal(x, y) for x, y in zip(native, emulated, strict=True))
    print(f"  native and emulated fp8 logits bit-identical: {same}")


if __name__ == "__main__":
    main()
