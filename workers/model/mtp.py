"""The multi-token prediction (MTP) head some checkpoints ship beside the model (Qwen3.5, Qwen3-Next:
`mtp.*` tensors), loaded as a draft model for speculative decoding.

The head predicts the token after next. At position p it takes the main model's last hidden state
there (after the final norm) and the embedding of the token at p+1, RMS-normalizes each
(`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), projects their concatenation `[embedding |
hidden]` (2H) back to H (`fc`), runs one full-attention decoder layer of the family's own kind
(causal over the positions given) and its norm (`mtp.norm`), and projects with the main model's
`lm_head`; it shares the main model's embeddings too. Its normed output stands in for the main
model's hidden state at the next position when it drafts further (the published implementations'
recursion). Design: the layer is that of a one-layer `Transformer` of the same family, loaded
through the family's own name map (`mtp.layers.0.*` read as `model.layers.0.*`), so attention
kinds, norms and experts need no code of their own; `load_mtp` returns None for a checkpoint without
`mtp.*` tensors. Trade-off: `forward` is the full causal pass (no KV cache of its own): the
drafter (workers/engine/mtp.py) recomputes the layer over a bounded window of recent positions.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from workers.contract.speculative import MTP_PREFIX as PREFIX
from workers.contract.speculative import mtp_tensor_files
from workers.model.attention import make_norm
from workers.model.families.base import FULL
from workers.model.transformer import Transformer
from workers.model.weights import map_name, to_ours


class MtpHead(nn.Module):
    """`forward(hidden [S, H], next_ids [S], positions [S]) -> (logits [V] fp32 of the last row, normed
    output [S, H])`: the head over positions `positions` (consecutive), `hidden` the main model's
    normed last hidden states there and `next_ids` the token after each."""

    def __init__(self, main: Transformer) -> None:
        super().__init__()
        c = main.config
        one = replace(c, num_hidden_layers=1, layer_types=(FULL,) if c.layer_types else (),
                      sparse_layers=(0,) if c.sparse_layers else (), nope_layers=())
        self.block = Transformer(one)  # its embeddings and head are the main model's (`load_mtp`)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.pre_fc_norm_embedding = make_norm(c, c.hidden_size)
        self.pre_fc_norm_hidden = make_norm(c, c.hidden_size)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        block = self.block
        x = torch.cat((self.pre_fc_norm_embedding(block._embed(next_ids)), self.pre_fc_norm_hidden(hidden)), dim=-1)
        x = self.fc(x)[None]  # [1, S, H]
        last = int(positions[-1])
        lengths = torch.full_like(positions, last + 1)
        rope = {spec: block.rope.lookup(spec, positions, last, block.dtype, lengths) for spec in block.rope_specs}
        x = block.layers[0](x, rope, {None: None}, None, {} if block.config.kv_shared_layers else None)
        out = block.norm(x[0])  # [S, H]
        return block.output(out[-1]).float(), out


def load_mtp(main: Transformer, model_dir: Path) -> MtpHead | None:
    """The checkpoint's MTP head beside `main` (its device and dtype), or None when it ships none."""
    names = mtp_tensor_files(model_dir)
    if not names:
        return None
    from safetensors import safe_open

    dtype, device = main.dtype, main.device
    with torch.device("meta"):
        head = MtpHead(main)
    stored: dict[str, torch.Tensor] = {}
    for path in sorted(set(names.values())):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for n in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if n.startswith(PREFIX):
                    stored[n[len(PREFIX):]] = f.get_tensor(n).to(device=device, dtype=dtype)
    own = {k: stored.pop(k) for k in [k for k in stored if k.split(".")[0] in ("fc", "pre_fc_norm_embedding",
                                                                               "pre_fc_norm_hidden")]}
    hf = {("model." + k): t for k, t in stored.items()}  # layers.0.*, norm.weight: as a one-layer model names them
    config = head.block.config
    unknown = [k for k in hf if map_name(k, config) is None]
    if unknown:
        raise ValueError(f"MTP tensors {', '.join(f'`mtp.{k[6:]}`' for k in unknown[:4])} in `{model_dir}` are not "
                         f"those of the model's decoder layer")
    state = to_ours(hf, config)
    state["tok_embeddings.weight"] = main.tok_embeddings.weight  # shared, not copied
    state["output.weight"] = main.output.weight
    state.update({f"{k}": t for k, t in own.items()})
    block_state = {k: v for k, v in state.items() if k not in own}
    missing = set(head.block.state_dict()) - set(block_state)
    if missing or set(own) != {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"}:
        raise ValueError(f"The MTP head in `{model_dir}` lacks {sorted(missing)[:4] or sorted(own)}")
    head.block.load_state_dict(block_state, assign=True, strict=False)
    head.fc.weight = nn.Parameter(own["fc.weight"], requires_grad=False)
    head.pre_fc_norm_embedding.weight = nn.Parameter(own["pre_fc_norm_embedding.weight"], requires_grad=False)
    head.pre_fc_norm_hidden.weight = nn.Parameter(own["pre_fc_norm_hidden.weight"], requires_grad=False)
    head.block.rope = type(main.rope)()
    return head.eval().requires_grad_(False)
