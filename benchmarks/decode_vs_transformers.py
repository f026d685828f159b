"""Decode-step time: our `Transformer.step` with its paged KV cache vs transformers with its own
KV cache (DynamicCache), on the same checkpoint and dtype, measured side by side.

Each round times one decode step of ours and one of theirs, alternately, at every batch
size, so machine noise hits both alike; the median over rounds is reported with the ratio
(transformers / ours: above 1 means ours is faster).

    python benchmarks/decode_vs_transformers.py [--dtype float32 bfloat16] [--batch 1 32] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.checkpoints import make_checkpoint  # noqa: E402
from workers.kv.batch import ForwardBatch, SeqChunk  # noqa: E402
from workers.kv.mirror import DecodeMirror  # noqa: E402
from workers.model.loader import load_model  # noqa: E402

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


class Ours:
    """The engine's decode path on the CPU: a paged pool whose blocks the sequences took as they
    grew together (interleaved, so every read goes through the block tables), read through the
    decode mirror."""

    def __init__(self, lm, batch: int, prompt_len: int, max_len: int, block_size: int = 16) -> None:
        self.model, self.batch, self.pos, self.bs = lm.model, batch, prompt_len, block_size
        per_seq = -(-max_len // block_size)
        self.kv = self.model.new_kv_pool(batch * per_seq, block_size)
        self.tables = [[s + batch * j for j in range(per_seq)] for s in range(batch)]
        self.mirror = DecodeMirror(self.kv)
        prompt = list(range(3, 3 + prompt_len))
        for s in range(batch):
            self.model.step(ForwardBatch.build([(SeqChunk(0, prompt_len, self.tables[s]), prompt)], block_size), self.kv)

    def step(self) -> None:
        items = [(SeqChunk(self.pos, 1, self.tables[s], key=s), [7]) for s in range(self.batch)]
        self.model.step(ForwardBatch.build(items, self.bs, mirror=self.mirror), self.kv)
        self.pos += 1


class Theirs:
    def __init__(self, model, batch: int, prompt_len: int) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        ids = torch.arange(3, 3 + prompt_len).expand(batch, -1)
        with torch.inference_mode():
            model(ids, past_key_values=self.cache, use_cache=True)
        self.next = torch.full((batch, 1), 7)
        self.pos = prompt_len

    def step(self) -> None:
        with torch.inference_mode():
            out = self.model(self.next, past_key_values=self.cache, use_cache=True,
                             cache_position=torch.tensor([self.pos]))
        out.logits[:, -1].float()
        self.pos += 1


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per implementation")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "bench", **MODEL)
        rows = []
        for dtype in args.dtype:
            lm = load_model(ckpt, dtype=dtype)
            hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
            if dtype == args.dtype[0]:
                print(f"model: {lm.config.num_parameters / 1e6:.2f}M params, {MODEL}")
            for batch in args.batch:
                ours = Ours(lm, batch, args.prompt_len, args.prompt_len + args.steps + 8)
                theirs = Theirs(hf, batch, args.prompt_len)
                for _ in range(5):  # warm-up
                    ours.step()
                    theirs.step()
                t_ours, t_theirs = [], []
                for _ in range(args.steps):
                    t_ours.append(timed(ours.step))
                    t_theirs.append(timed(theirs.step))
                rows.append((dtype, batch, statistics.median(t_ours) * 1e3, statistics.median(t_theirs) * 1e3))
    print(f"{'dtype':<10}{'batch':>6}{'ours ms':>10}{'transformers ms':>17}{'ratio':>8}")
    for dtype, batch, ours_ms, theirs_ms in rows:
        print(f"{dtype:<10}{batch:>6}{ours_ms:>10.2f}{theirs_ms:>17.2f}{theirs_ms / ours_ms:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
