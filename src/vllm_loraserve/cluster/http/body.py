"""Request bodies as the router reads and forwards them.

The engine is the judge of an OpenAI request: the router reads only what it
routes by (`model`) and what it adds (`stream_options.include_usage`), and
forwards everything else for the engine to accept or refuse (its 400 comes
back as it is). What the router must read itself, it refuses where the
engine would (a `vllm serve` answers each of these with 400): a body that
is not JSON in UTF-8 (also nested past Python's recursion limit, or an
integer of more than 4300 digits), a media type other than JSON
(vLLM's `validate_json_request`), a `model` that is no string.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter, ValidationError

# How vLLM's request models read `include_usage` (`bool | None`, lax mode).
_FLAG = TypeAdapter(bool | None)


class BadBody(ValueError):
    """A body the router refuses with 400; `param` names the field, if one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BadBody(f"the request body is not a JSON object: it is not valid JSON in "
                      f"UTF-8 ({e})") from None


def parse_openai(raw: bytes, content_type: str) -> dict:
    """The body of a completion or chat request, with `model` a string."""
    if content_type.lower().split(";", 1)[0].strip() != "application/json":
        raise BadBody("Unsupported Media Type: Only 'application/json' is allowed")
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadBody("the request body is not a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise BadBody("give the model (base model or adapter name) as `model`", "model")
    try:
        model.encode()
    except UnicodeEncodeError:  # a lone surrogate, written as a \ud800 escape
        raise BadBody("`model` is not valid Unicode text", "model") from None
    return body


def ask_for_usage(body: dict) -> bool | None:
    """Make a streamed request's last chunk carry token usage, which feeds the
    demand estimate; returns whether the client asked for that chunk itself
    (the router drops it otherwise). None, and `body` untouched, where the
    engine does not stream (falsy `stream`) or will refuse the options."""
    options = body.get("stream_options")
    if not body.get("stream") or not (options is None or isinstance(options, dict)):
        return None
    try:
        asked = bool(_FLAG.validate_python((options or {}).get("include_usage")))
    except ValidationError:
        return None
    body["stream_options"] = {**(options or {}), "include_usage": True}
    return asked


def encode(body: dict) -> bytes:
    """JSON as the engine parses it (Python's json): NaN and Infinity stay
    (the engine refuses them where they are wrong), a lone surrogate stays an
    escape (the engine says what it makes of it)."""
    try:
        return json.dumps(body).encode()
    except RecursionError:
        raise BadBody("the request body is nested too deeply") from None
