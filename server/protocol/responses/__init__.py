"""OpenAI's Responses API (`POST /v1/responses`): what the Agents SDK and Codex speak.

A Responses request is translated into a chat request (`requests`: input items -> messages,
function tools, `text.format` -> `response_format`), served by the same chat pipeline, and its
answer shaped back: output items whole (`output`) or as typed `response.*` events (`events`);
`store` keeps responses a bounded while for `previous_response_id`.
"""
