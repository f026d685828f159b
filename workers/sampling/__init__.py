"""Which tokens a request may draw: its parameters (`params`), the batched sampler (`sampler`)
with its logits processors (`logits_processors`) and structured-output grammars (`grammar`),
and the log-probabilities it reports (`logprobs`).
"""
