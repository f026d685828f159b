"""OpenAI's `/v1/completions` and `/v1/chat/completions`: request shapes (`requests`), response
objects (`responses`), one worker answer as one choice, whole or streamed (`choices`), and
tools and response formats as grammars (`tools`)."""
