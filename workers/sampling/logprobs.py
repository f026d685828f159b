"""Log-probabilities: the top alternatives of each token, prompt tokens, and each token's bytes.

Design: a generated token's logprob and alternatives are the log-softmax of the logits the sampler
drew from (vLLM's `processed_logprobs`: after bias, grammar mask, penalties, temperature and
truncation; a removed token's -inf is reported as -9999.0, as vLLM does); a prompt token's is the
model's raw distribution at the previous position, the first prompt token having none. Prompt
logprobs come from a small hook in the engine step: for a chunk that asks, the runner also returns
its earlier rows' logits (`prompt_chunks`, `record_prompt`). Trade-off: scoring works per chunk,
so a prompt split across steps is scored piece by piece, and a prompt that asks computes every row
it has not scored instead of taking it from the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.contract.events import MIN_LOGPROB, TopList, finite  # noqa: E402,F401 (defined with the events)


def top_alternatives(logprobs: torch.Tensor, counts: Sequence[int | None]) -> list[TopList | None]:
    """The `counts[i]` best (id, logprob) of each row of `logprobs` [N, V] (None where not asked)."""
    want = [i for i, k in enumerate(counts) if k]
    out: list[TopList | None] = [None if k is None else () for k in counts]
    if not want:
        return out
    k_max = min(max(counts[i] for i in want), logprobs.shape[-1])
    values, ids = logprobs[torch.tensor(want, device=logprobs.device)].topk(k_max, dim=-1)  # [W, k]
    values, ids = values.tolist(), ids.tolist()
    for j, i in enumerate(want):
        k = counts[i]
        out[i] = tuple(zip(ids[j][:k], values[j][:k], strict=True))
    return out


def prompt_chunks(chunks: Sequence) -> list[int]:
    """Indices of the step's chunks whose rows score prompt tokens not scored yet."""
    picked = []
    for i, c in enumerate(chunks):
        seq = c.seq
        done = 1 if seq.prompt_logprobs is None else len(seq.prompt_logprobs)
        if seq.params.decoder_input_details and c.start_pos + 1 < len(seq.prompt_ids) and done < len(seq.prompt_ids):
            picked.append(i)
    return picked


def record_prompt(chunk, logits: torch.Tensor) -> None:
    """Append the logprobs of the prompt tokens that `chunk`'s rows predict (`logits` [n, V]:
    row j at position start_pos + j predicts the token at start_pos + j + 1)."""
    seq = chunk.seq
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [(seq.prompt_ids[0], None, None)]
    first = len(seq.prompt_logprobs)  # next prompt position without an entry
    end = min(chunk.start_pos + len(chunk.token_ids) + 1, len(seq.prompt_ids))
    if end <= first or first - 1 < chunk.start_pos:  # nothing new, or a gap before this chunk
        return
    rows = logits[first - 1 - chunk.start_pos : end - 1 - chunk.start_pos].float()  # [m, V]
    logprobs = torch.log_softmax(rows, dim=-1)
    targets = seq.prompt_ids[first:end]
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])[:, 0].tolist()
    top = seq.params.prompt_top_n_tokens if seq.params.prompt_top_n_tokens is not None else seq.params.top_n_tokens
    tops = top_alternatives(logprobs, [top] * len(targets))
    seq.prompt_logprobs.extend(zip(targets, chosen, tops, strict=True))


