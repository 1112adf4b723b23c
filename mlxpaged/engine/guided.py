"""Grammar-constrained decoding: what a request asks for (`GuidedDecoding`) and the engine's
grammar backend behind a small interface (`compile_grammar` -> `Grammar`, `Grammar.matcher()`
-> `Matcher`), so another backend (xgrammar) could replace llguidance here alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuidedDecoding:
    """Exactly one of: a JSON schema, any JSON object, or a Lark grammar (llguidance's syntax,
    which may embed `%json{...}`). A spec the engine cannot enforce raises `ValueError` naming
    the unsupported part when it is compiled (at request time)."""

    json_schema: dict | None = None
    json_object: bool = False
    grammar: str | None = None

    def __post_init__(self):
        given = [self.json_schema is not None, bool(self.json_object), self.grammar is not None]
        if sum(given) != 1:
            raise ValueError("guided decoding takes exactly one of json_schema, json_object, grammar")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a dict, got {type(self.json_schema).__name__}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("grammar must be a non-empty string")

    def __hash__(self):  # a dict field: hash the canonical JSON (compiled grammars are cached by spec)
        return hash(self.key())

    def key(self) -> str:
        import json

        return json.dumps([self.json_schema, self.json_object, self.grammar], sort_keys=True)


class Matcher:
    """One sample's position in a compiled grammar (backend-neutral interface).

    consume(token) advances it (False: the token is not allowed); fill_mask(row) writes the
    allowed next tokens as a bitmask (int32 words, bit t of word t // 32) into a numpy row;
    rollback(k) undoes the last k consumed tokens, reset() all of them; is_stopped: the
    grammar is complete and admits no further token (only EOS).
    """

    def consume(self, token: int) -> bool:
        raise NotImplementedError

    def fill_mask(self, row) -> None:
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    @property
    def is_stopped(self) -> bool:
        raise NotImplementedError
