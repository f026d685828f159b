"""Which tokens a request may draw: its parameters (`params`), the batched sampler (`sampler`)
with its logits processors (`logits_processors`) and structured-output grammars (`grammar`,
each compiled first under a budget in a sandboxed child: `grammar_source`, `grammar_sandbox`,
`grammar_child`), and the log-probabilities it reports (`logprobs`)."""
