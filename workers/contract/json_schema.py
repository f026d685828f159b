"""A JSON schema as requests carry it: an object, or the same as JSON text (TGI clients send
both). One reading for the router, which checks well-formedness at its edge, and the worker,
which compiles it (and says what it cannot enforce). No torch, no grammar engine here.
"""

from __future__ import annotations

import json


def load_json_schema(value, what: str) -> dict | bool:
    """The schema as a JSON value; `ValueError` naming `what` when it is not JSON or not a schema."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from e
    if not isinstance(value, dict | bool):
        raise ValueError(f"{what} must be a JSON schema (an object), got `{type(value).__name__}`")
    return value
