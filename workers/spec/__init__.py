"""Speculative decoding's pure parts: drafts proposed from a sequence's own tokens (`ngram`),
their verification against the target model's distribution (`rejection`), and how many to
propose per step (`policy`). The engine's side (scheduling k+1 tokens for a decode row, rolling
back what is rejected) is workers/engine/speculate.py; this package holds no engine state."""
