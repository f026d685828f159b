"""The public shapes and their translation to and from the workers' TGI-shaped answers: TGI's
(`tgi`), OpenAI's (`openai/`), what they share (`base`) and the chat template that turns
messages into a prompt (`chat`). Pydantic lives here, at the HTTP edge; nothing below sees it,
and nothing here knows a worker."""
