"""Tool calls in the model's own format: the text a model writes -> content and tool calls.

Every family was trained to write its calls its own way (vLLM's `--tool-call-parser`):
hermes-style `<tool_call>{...}</tool_call>` blocks (Qwen), a bare `{"name", "parameters"}`
object (Llama 3.x), `[TOOL_CALLS][...]` (Mistral), a Python-like `[f(a=1)]` list (pythonic),
and gpt-oss's harmony messages (read by `server/protocol/harmony.py`, which this package
reuses). `syntax` describes each format, `choose` picks one from `--tool-call-parser` or the
chat template, and `splitter` reads any of them from output that arrives piece by piece, so
chat completions, Responses and Messages stream the same incremental deltas and parse whole
answers with the same code (`jsonscan` finds where a JSON value ends in a prefix).
"""
