"""Drafts from the checkpoint's MTP head (workers/model/mtp.py `MtpHead`) for `--speculative mtp`.

Design: the head needs the main model's last hidden state at every position it attends to, so the
drafter taps the model's step just before its logits (`_step_logits` gets every row's hidden state;
the drafter wraps it on this model instance) and, after each step (`capture`, from the speculator's
`observe`), keeps each sequence's normed hidden states by position. A decode row whose last token
sits at position t then drafts by running the head over positions `t - window .. t - 1` (hidden
state at p and the token at p + 1) for the token at t + 1, and again with its own output standing in
for the next hidden state, k times; the drafts are greedy. Positions are valid only once computed
with their final tokens: positions past a rejection are recomputed, and a step that ran without the
tap (a compiled decode step) invalidates what it computed, so such a row drafts nothing until it has
them again (an MTP worker decodes eager: workers/engine/build.py). Trade-off: the head's layer is
recomputed over up to `WINDOW` positions per draft token instead of keeping a KV cache of its own
(drafts past `WINDOW` tokens back see less context than the published recursion; verification keeps
the output exact either way), and one copy of the hidden states per running sequence.
"""

from __future__ import annotations

import torch

from workers.model.mtp import load_mtp

WINDOW = 128  # positions the head attends to when it drafts


class MtpDrafter:
    """Hidden states per running sequence and the head's greedy drafts; engine thread only."""

    def __init__(self, model, head, window: int = WINDOW) -> None:
        self.model, self.head, self.window = model, head, window
        self._hidden: dict[int, torch.Tensor] = {}  # uid -> [capacity, H] normed hidden state by position
        self._valid: dict[int, int] = {}  # uid -> leading positions whose hidden state is current
        self._last: torch.Tensor | None = None
        step_logits = model._step_logits

        def tap(x, batch):  # every row's last hidden state, before the rows for logits are picked
            self._last = x
            return step_logits(x, batch)

        model._step_logits = tap

    @torch.inference_mode()
    def capture(self, chunks) -> None:
        """After a step over `chunks` (rows packed in chunk order): keep each chunk's hidden states."""
        x, self._last = self._last, None
        if x is None or x.shape[0] != sum(len(c.token_ids) for c in chunks):  # not this step's forward through the tap
            for c in chunks:
                uid = c.seq.uid
                self._valid[uid] = min(self._valid.get(uid, 0), c.start_pos)
            return
        h = self.model.norm(x)  # [T, H]
        row = 0
        for c in chunks:
            n, uid, start = len(c.token_ids), c.seq.uid, c.start_pos
            buf = self._hidden.get(uid)
            if buf is None or buf.shape[0] < start + n:
                grown = h.new_empty((max(2 * (start + n), 64), h.shape[-1]))
                if buf is not None:
                    grown[: buf.shape[0]] = buf
                buf = self._hidden[uid] = grown
            buf[start : start + n] = h[row : row + n]
            row += n
            if start <= self._valid.get(uid, 0):
                self._valid[uid] = start + n

    def retire(self, running: set[int]) -> None:
        """Forget the sequences no longer running."""
        for uid in [u for u in self._hidden if u not in running]:
            del self._hidden[uid]
            self._valid.pop(uid, None)

    @torch.inference_mode()
    def propose(self, seq, k: int) -> list[int]:
        """Up to `k` greedy drafts for a decode row (none while its hidden states are not current)."""
        t = seq.num_computed  # its last token's position
        if k < 1 or t < 1 or self._valid.get(seq.uid, 0) < t:
            return []
        start = max(0, t - self.window)
        device = self.head.fc.weight.device
        tokens = seq.token_ids()
        hidden = self._hidden[seq.uid][start:t]
        ids = torch.tensor(tokens[start + 1 : t + 1], dtype=torch.int64, device=device)
        drafts: list[int] = []
        for j in range(k):
            positions = torch.arange(start, t + j, device=device)
            logits, out = self.head(hidden, ids, positions)
            drafts.append(int(logits.argmax()))
            hidden = torch.cat((hidden, out[-1:]))
            ids = torch.cat((ids, ids.new_tensor(drafts[-1:])))
        return drafts


def mtp_drafter(loaded) -> MtpDrafter | None:
    """The drafter over a loaded model's checkpoint MTP head (None: the checkpoint ships none)."""
    head = load_mtp(loaded.model, loaded.model_dir)
    return None if head is None else MtpDrafter(loaded.model, head)
