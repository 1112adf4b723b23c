"""What every route's body shares: the strict pydantic base and the checks of raw JSON values.

JSON allows what the rest of the server cannot take: lone UTF-16 surrogates (`"\\ud800"`: no UTF-8
encoding, so neither the tokenizer nor a response echoing the text can encode them) and nesting
deeper than Python's recursion limit (`json.loads` and `json.dumps` recurse). `check_json` refuses
both anywhere in a value, iteratively, before a field of the value is used; `loads_json` parses
client or model text and raises ValueError, never RecursionError.

A whole body's top-level fields are the ones its class declares, plus its `IGNORED`: fields real
clients send that change nothing here (Codex's `prompt_cache_key`, Claude Code's
`context_management`). Any other is refused by name (`refuse_unknown`), so a client never
believes a field it sent was honoured (vLLM's `chat_template_kwargs`). The parts of a body ignore
unknown fields (`cache_control` on a block).
"""

from __future__ import annotations

import json
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

MAX_DEPTH = 64  # JSON nesting a body (and a tool call's arguments) may have


class Body(BaseModel):
    """A part of a request body: strict types (`"5"` is not 5), unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class CheckedBody(Body):
    """A whole request body: refused when any string in it has a lone surrogate or it nests too
    deeply, or when it has a top-level field that is neither declared nor in `IGNORED`."""

    IGNORED: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data):
        check_json(data)
        return refuse_unknown(cls, data, cls.IGNORED)


def refuse_unknown(cls: type[BaseModel], data, accepted=frozenset()):
    """`data`, or a validation error of type "unimplemented" naming its first top-level field that
    `cls` does not declare and `accepted` does not list (the routes answer it as a 400 naming it)."""
    if isinstance(data, dict):
        known = {f.alias or name for name, f in cls.model_fields.items()}
        for name in data:
            if name not in known and name not in accepted:
                shown = name if len(name) <= 64 else name[:64] + "..."
                raise PydanticCustomError("unimplemented", "{field} is not supported by this server", {"field": shown})
    return data


def check_json(value, where: str = "body") -> None:
    """Raise ValueError naming the first place where `value` nests deeper than MAX_DEPTH or has a
    string (value or key) with a lone surrogate."""
    stack = [(value, where, 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _no_surrogate(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise ValueError(f"{path}: nested more than {MAX_DEPTH} levels deep")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    _no_surrogate(k, f"{path} key {k.encode('utf-8', 'backslashreplace').decode()[:40]!r}")
                stack.append((x, f"{path}.{k}", depth + 1))


def _no_surrogate(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{path}: contains a lone UTF-16 surrogate at character {e.start}; send valid Unicode"
        ) from None


def loads_json(text: str):
    """`json.loads`, with nesting past MAX_DEPTH (or past the recursion limit) a ValueError."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep") from None
    check_json(value, "JSON")
    return value


async def json_object(request) -> dict:
    """A request's JSON object body; `ValueError` naming what is wrong with it."""
    try:
        raw = await request.json()
    except ValueError as e:
        raise ValueError(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ValueError("malformed JSON body: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError("the request needs a JSON object body")
    return raw


async def read_body(request, model: type[BaseModel], error, refused=None, check=None) -> BaseModel:
    """A route's body as `model`, or `error(message)` raised, one line naming the problem: a body
    that is no JSON object, that `check(raw)` refuses (`ValueError`), or that does not validate
    (the error of a union's branches that got furthest; `refused(err, loc)` may word it: a field
    the route does not implement)."""
    try:
        raw = await json_object(request)
        if check is not None:
            check(raw)
    except ValueError as e:
        raise error(str(e)) from None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        loc = ".".join(str(x) for x in err["loc"])
        raise error((refused(err, loc) if refused else None) or f"{loc or 'body'}: {err['msg']}") from None
