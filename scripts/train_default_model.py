"""Train hetserve's embedded default model from scratch on two CPU cores.

Design: one reproducible pipeline, seeded end to end. (1) Fetch and split the corpus
(scripts/prepare_corpus.py: BSD fortune files from Debian's package archive, 5% held out).
(2) Train a byte-level BPE tokenizer (4,096 tokens) on the training split only.
(3) Train a small Llama (hidden 256, 4 layers, GQA 4/2 heads, tied embeddings, ~4.0M
parameters) with the server's own `workers.model.Transformer`, on packed 512-token
windows, AdamW + cosine schedule, bf16 autocast. (4) Export a Hugging Face checkpoint
(scripts/export_default_model.py), load it back through `workers.model.loader.load_model` --
the path every user's model takes -- and measure held-out loss and greedy samples on it.
(5) Write the model card with those figures, a word list of the training text and a small
held-out sample that tests/test_default_model.py checks against.

Trade-off: a model this small on a corpus this small writes English-looking quips, not
sense; it exists so that `hetserve serve` serves something real with no network and
decodes a batch of 32 in milliseconds. Rebuild (about 15 minutes on 2 cores):
    python scripts/train_default_model.py
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import default_model_card as model_card  # noqa: E402
import export_default_model as export  # noqa: E402
import prepare_corpus as corpus_lib  # noqa: E402

from workers.model.config import ModelConfig  # noqa: E402
from workers.model.transformer import Transformer  # noqa: E402

logger = logging.getLogger("train_default_model")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "workers" / "default_model")
    p.add_argument("--workdir", type=Path, default=ROOT / "runs" / "default_model")
    p.add_argument("--fortunes-dir", type=Path, default=None, help="unpacked fortune files (skip apt-get)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--heldout-sample", type=int, default=160, help="held-out fortunes committed for tests")
    return p.parse_args(argv)


# -- tokenizer -------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with our special tokens first; encode() prepends <|bos|>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(export.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id(export.BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{export.BOS} $A", pair=f"{export.BOS} $A {export.BOS} $B", special_tokens=[(export.BOS, bos)]
    )
    return tok


def encode_views(tok: Tokenizer, views: list, rng: random.Random) -> list[list[int]]:
    """Token ids per training document: <|bos|> text <|eos|>, chat views through the template.

    One document in ten goes without <|bos|>, so a prompt that arrives without it (a client
    that tokenizes the rendered chat template with add_special_tokens=False) still works.
    """
    bos, eos = tok.token_to_id(export.BOS), tok.token_to_id(export.EOS)
    out = []
    for view in views:
        if isinstance(view, str):
            ids = tok.encode(view, add_special_tokens=False).ids + [eos]
        else:  # chat messages; the rendered template already ends each turn with <|eos|>
            ids = tok.encode(export.render_chat(view), add_special_tokens=False).ids
        out.append(ids if rng.random() < 0.1 else [bos, *ids])
    return out


def packed_epoch(docs: list[list[int]], seq_len: int, rng: random.Random) -> torch.Tensor:
    """Shuffle documents, concatenate, cut into [N, seq_len + 1] windows (inputs + next token)."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    stream = [t for i in order for t in docs[i]]
    n = (len(stream) - 1) // seq_len
    ids = torch.tensor(stream[: n * seq_len + 1], dtype=torch.long)
    return torch.stack([ids[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])  # [N, S+1]


# -- evaluation -------------------------------------------------------------------------------


@torch.no_grad()
def document_nll(model: torch.nn.Module, docs: list[list[int]], pad: int, batch: int = 16) -> tuple[float, int]:
    """Mean next-token NLL over documents (each scored from its first token on) and token count."""
    model.eval()
    total, count = 0.0, 0
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    for start in range(0, len(order), batch):
        group = [docs[i] for i in order[start : start + batch]]
        width = max(len(d) for d in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)  # [B, W] right-padded
        for row, d in enumerate(group):
            ids[row, : len(d)] = torch.tensor(d)
        logits = model(ids[:, :-1]).float()  # [B, W-1, V]; causal, so padding never leaks left
        targets = ids[:, 1:].clone()
        for row, d in enumerate(group):
            targets[row, len(d) - 1 :] = -100
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        total += nll.item()
        count += int((targets != -100).sum())
    model.train()
    return total / max(count, 1), count


@torch.no_grad()
def greedy(model: torch.nn.Module, tok: Tokenizer, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy continuation with the full causal forward (no cache), stopping at <|eos|>."""
    eos = tok.token_to_id(export.EOS)
    ids = tok.encode(prompt).ids
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids + new]))[0, -1]  # [V]
        nxt = int(logits.argmax())
        if nxt == eos:
            break
        new.append(nxt)
    return tok.decode(new)


# -- training -------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, tok: Tokenizer) -> tuple[Transformer, ModelConfig]:
    config = ModelConfig(
        architecture="llama",
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(export.BOS),
        eos_token_id=(tok.token_to_id(export.EOS),),
    )
    model = Transformer.random(config, torch.float32, "cpu", seed=args.seed, std=0.02)
    with torch.no_grad():  # residual-branch outputs scaled down by depth (GPT-2)
        for name, p in model.named_parameters():
            if name.endswith(("attention.wo.weight", "feed_forward.w_down.weight")):
                p.mul_(1.0 / math.sqrt(2 * config.num_hidden_layers))
    return model, config


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, total - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: Transformer, train_docs, heldout_docs, pad: int, args: argparse.Namespace) -> dict:
    """The training loop; logs step, loss, tokens/s and ETA. Returns figures for the model card."""
    rng = random.Random(args.seed + 2)
    tokens_per_epoch = sum(len(d) for d in train_docs)
    steps_per_epoch = tokens_per_epoch // (args.seq_len * args.batch_size)
    total = max(1, int(steps_per_epoch * args.epochs))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    logger.info("training: %d steps (%.1f epochs of %d tokens), batch %dx%d",
                total, args.epochs, tokens_per_epoch, args.batch_size, args.seq_len)
    eval_docs = heldout_docs[:200]  # periodic check on a subset; the full set is scored at the end
    windows = torch.empty(0, args.seq_len + 1, dtype=torch.long)
    cursor, seen, t0, t_log, ema = 0, 0, time.time(), time.time(), None
    history = []
    model.train()
    for step in range(total):
        # 1. Next batch of packed windows (a fresh shuffle every epoch).
        if cursor + args.batch_size > windows.shape[0]:
            windows, cursor = packed_epoch(train_docs, args.seq_len, rng), 0
        batch = windows[cursor : cursor + args.batch_size]  # [B, S+1]
        cursor += args.batch_size
        # 2. Forward under bf16 autocast, loss in fp32.
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1])  # [B, S, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        # 3. Backward, clip, step.
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += batch[:, :-1].numel()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        # 4. Progress and periodic held-out check.
        if (step + 1) % args.log_every == 0 or step + 1 == total:
            now = time.time()
            rate = args.log_every * batch[:, :-1].numel() / max(now - t_log, 1e-9)
            eta = (now - t0) / (step + 1) * (total - step - 1)
            logger.info("step %d/%d  loss %.3f  lr %.2e  %.0f tok/s  elapsed %s  ETA %s", step + 1, total,
                        ema, opt.param_groups[0]["lr"], rate, _mmss(now - t0), _mmss(eta))
            t_log = now
        if (step + 1) % args.eval_every == 0 or step + 1 == total:
            nll, _ = document_nll(model, eval_docs, pad)
            history.append((step + 1, ema, nll))
            logger.info("eval step %d  held-out loss %.3f  ppl %.1f", step + 1, nll, math.exp(nll))
    return {"steps": total, "tokens_seen": seen, "train_seconds": time.time() - t0,
            "final_train_loss": ema, "history": history}


def _mmss(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    # 1. Corpus.
    corpus = corpus_lib.build_corpus(args.workdir, args.seed, args.fortunes_dir)
    views = corpus_lib.training_views(corpus.train, args.seed)
    texts = [v if isinstance(v, str) else export.render_chat(v) for v in views]
    # 2. Tokenizer (training split only).
    tok = train_tokenizer(texts, args.vocab_size)
    pad = tok.token_to_id(export.PAD)
    train_docs = encode_views(tok, views, random.Random(args.seed + 3))
    heldout_docs = [tok.encode(d.text).ids + [tok.token_to_id(export.EOS)] for d in corpus.heldout]
    logger.info("tokenizer: %d tokens; train %d tokens, held out %d tokens", tok.get_vocab_size(),
                sum(map(len, train_docs)), sum(map(len, heldout_docs)))
    # 3. Model and training.
    model, config = build_model(args, tok)
    logger.info("model: %d parameters", sum(p.numel() for p in model.parameters()))
    stats = train(model, train_docs, heldout_docs, pad, args)
    fp32_nll, _ = document_nll(model, heldout_docs, pad)
    # 4. Export, then measure what users get: the checkpoint loaded by the server's loader.
    weight_bytes = export.write_checkpoint(args.out, model, config, tok, torch.bfloat16)
    from workers.model.loader import load_model

    loaded = load_model(args.out)
    nll, n_tokens = document_nll(loaded.model, heldout_docs, pad)
    sample = corpus.heldout[: args.heldout_sample]
    sample_docs = heldout_docs[: args.heldout_sample]
    sample_nll, _ = document_nll(loaded.model, sample_docs, pad)
    samples = {p: greedy(loaded.model, tok, p) for p in model_card.PROMPTS}
    chat_prompt = export.render_chat([{"role": "user", "content": model_card.CHAT_PROMPT}], True)
    samples[f"chat: {model_card.CHAT_PROMPT}"] = greedy(loaded.model, tok, chat_prompt)
    for prompt, text in samples.items():
        logger.info("greedy %r -> %r", prompt, text)
    # 5. Word list, held-out sample and model card.
    vocab = sorted({w for t in texts for w in corpus_lib.words(t)})
    (args.out / model_card.WORDS_FILE).write_text("\n".join(vocab) + "\n")
    (args.out / model_card.HELDOUT_FILE).write_text("\n%\n".join(d.text for d in sample) + "\n")
    figures = {
        **stats, "args": vars(args), "config": config, "parameters": config.num_parameters,
        "weight_bytes": weight_bytes, "heldout_nll": nll, "heldout_tokens": n_tokens,
        "heldout_fortunes": len(corpus.heldout), "heldout_nll_fp32": fp32_nll,
        "sample_nll": sample_nll, "sample_fortunes": len(sample), "samples": samples,
        "train_fortunes": len(corpus.train), "train_tokens": sum(map(len, train_docs)),
        "corpus_chars": sum(len(d.text) for d in corpus.train), "vocab_words": len(vocab),
        "deb_name": corpus.deb_name, "deb_sha256": corpus.deb_sha256, "copyright": corpus.copyright_text,
        "total_seconds": time.time() - t_start, "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    (args.out / "README.md").write_text(model_card.render(figures))
    logger.info("held-out loss %.3f (ppl %.2f) over %d tokens; sample ppl %.2f; wrote %s (%d bytes of weights)",
                nll, math.exp(nll), n_tokens, math.exp(sample_nll), args.out, weight_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
