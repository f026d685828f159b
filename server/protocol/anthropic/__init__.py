"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): what the
`anthropic` SDK and Claude Code speak.

A Messages request is translated into a chat request (`requests`: system, content blocks,
`tool_use` / `tool_result`, `thinking`, tools and `tool_choice`), served by the same chat
pipeline, and its answer shaped back as a message with content blocks, whole or streamed with
Anthropic's event names (`messages`).
"""
