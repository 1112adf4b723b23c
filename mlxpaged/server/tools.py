"""Tool calls in the Qwen2.5 (Hermes) format: rendering, parsing, streaming and the forcing grammar.

The checkpoint's chat template renders the offered tools (Qwen2.5 puts them in the system turn)
and the history: assistant turns with `tool_calls` and `role: "tool"` results. The model answers
with spans

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and `ToolCallStream`, the one parser of every route, streamed or not, turns them into calls. A
span counts as a call when its body is a JSON object with a string `name` and an object
`arguments`; anything else (a span that is not JSON, or not closed when the sample ends) stays in
the text, unchanged, so nothing the model wrote is lost. Whitespace between a call and its
neighbours is dropped; other text is the message's content.

Small Qwen2.5 checkpoints (the 0.5B) often answer a tool request with the bare JSON object and
no tags, or with that object in a ```json fenced block. So a completion that is, as a whole, one
such object (fenced or not) naming an offered function is a call too. While a streamed
completion may still be one (it starts with `{` or a fence whose first line is empty or `json`,
then `{"` or `{}`), its text is held back until it ends; a ```python block streams at once.

One rule for every API: the OpenAI chat route, Anthropic's Messages and OpenAI's Responses all
convert their own shapes to these chat messages and tool definitions.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .bodies import loads_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_FENCES = ("", "json")  # a fenced bare call's first line: ```json or a bare ```
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}  # llguidance's options


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def input(self) -> dict:
        return json.loads(self.arguments)


def _call_of(body: str) -> ToolCall | None:
    """The call a span's body holds, or None when it is not one (then the span stays text)."""
    try:
        obj = loads_json(body)
    except ValueError:  # not JSON, or nested deeper than any arguments we take
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = loads_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass(frozen=True)
class ToolFormat:
    """How a checkpoint writes tool calls: a span from `open` to `close` ("": to the sample's end)
    whose body `parse` turns into calls ([]: not a call, the span stays text). Hermes spans
    (Qwen2.5's) are parsed here, and only they can be forced by a grammar (`forcible`); other
    families use the parser mlx-lm picks for the checkpoint (`mlx_lm/tool_parsers/`)."""

    name: str
    open: str
    close: str
    parse: object  # body -> list[ToolCall]
    forcible: bool = False  # tool_call_grammar writes this format
    bare_json: bool = False  # a whole completion that is one call object counts (small Qwen models)

    @classmethod
    def of(cls, tokenizer) -> ToolFormat | None:
        """The checkpoint's format, or None when mlx-lm knows no parser for it (tools are then text)."""
        parser = getattr(tokenizer, "tool_parser", None)
        start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
        module = getattr(parser, "__module__", "").rsplit(".", 1)[-1]
        if parser is None:  # mlx-lm found none; a template that writes Hermes spans gets ours
            return HERMES if OPEN in (getattr(tokenizer, "chat_template", None) or "") else None
        if module == "json_tools" or not start:
            return HERMES
        return cls(module, start, end or "", _mlx_parse(parser))


def check_forcible(fmt: ToolFormat | None, plan) -> None:
    """A plan that forces a call needs a format the forcing grammar writes (Hermes spans)."""
    if plan.guided is not None and plan.param == "tools" and not (fmt and fmt.forcible):
        from .errors import APIError

        what = f"'{fmt.name}' tool-call format" if fmt else "checkpoint (no tool-call format known)"
        raise APIError(
            400, f"tool_choice: forcing a call is not supported for this {what}; use 'auto'", param="tool_choice"
        )


def _hermes(body: str) -> list[ToolCall]:
    call = _call_of(body)
    return [call] if call is not None else []


HERMES = ToolFormat("hermes", OPEN, CLOSE, _hermes, forcible=True, bare_json=True)


def _mlx_parse(parser):
    """mlx-lm's `parse_tool_call(text, tools)` (a dict or a list of dicts with `name` and
    `arguments`) as a body -> calls function; any failure leaves the span as text."""

    def parse(body: str) -> list[ToolCall]:
        try:
            got = parser(body, None)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError):
            return []
        out = []
        for c in got if isinstance(got, list) else [got]:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                return []
            args = c.get("arguments", {})
            call = _call_of(json.dumps({"name": c["name"], "arguments": args}, ensure_ascii=False))
            if call is None:
                return []
            out.append(call)
        return out

    return parse


def _unfenced(text: str) -> str:
    """The body of a completion that is one fenced block (```json ... ```), else the text."""
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        body = text[3:-3]
        first, _, rest = body.partition("\n")
        return rest if first.strip() in CALL_FENCES else text
    return text


def _may_be_call_object(head: str) -> bool:
    """Whether a completion that starts with `head` (no leading whitespace; it starts with `{` or a
    fence) may still be, as a whole, one call object, as `finish` reads it: a fence's first line
    must be empty or `json` (`_unfenced`), and the object's first character after `{` a key's
    quote or `}` (JSON). Deciding this early lets a code block or other text stream at once
    instead of being held to its end."""
    if head.startswith("```"):
        info, newline, body = head[3:].partition("\n")
        label = info.strip()
        if not newline:  # the first line so far: a prefix of "json" that may still grow
            return label in CALL_FENCES or (info == info.rstrip() and any(f.startswith(label) for f in CALL_FENCES))
        if label not in CALL_FENCES:
            return False
        head = body.lstrip()
        if not head:
            return True
        if head[0] != "{":
            return False
    rest = head[1:].lstrip()
    return not rest or rest[0] in '"}'


def partial_prefix(buf: str, opener: str = OPEN) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of `opener`."""
    for k in range(min(len(opener) - 1, len(buf)), 0, -1):
        if buf.endswith(opener[:k]):
            return k
    return 0


class ToolCallStream:
    """Text deltas in, events out: `str` (content to show) and `ToolCall` (a complete call).

    Holds back what could still become a call: a tail that may grow into the format's opening
    marker, whitespace that would be dropped if a call follows, and an open span until it closes.
    The events of any split of a text equal those of the whole text fed at once.
    """

    def __init__(self, names=None, fmt: ToolFormat | None = None):
        self.fmt = fmt or HERMES
        self.names = frozenset(names or ())  # functions a bare JSON completion may call
        bare = self.names and self.fmt.bare_json
        self.lead: str | None = "" if bare else None  # held while the completion may be a bare call
        self.bare = False  # the completion may be one call object: hold it all until it ends
        self.buf = ""  # text not yet decided (while `in_call`: the open span so far)
        self.in_call = False
        self.ws = ""  # trailing whitespace held back: dropped if a call follows, else text
        self.after_call = False  # whitespace right after a call is dropped
        self.num_calls = 0

    def feed(self, delta: str) -> list:
        if self.lead is not None:
            self.lead += delta
            head = self.lead.lstrip()
            if not head or (len(head) < 3 and "```".startswith(head)):  # undecided
                return []
            self.bare = head[0] == "{" or head.startswith("```")
            if self.bare and _may_be_call_object(head):
                return []
            # not a bare call (now that its start is known): parse as usual from the start
            delta, self.lead, self.bare = self.lead, None, False
        return self._feed(delta)

    def _feed(self, delta: str) -> list:
        self.buf += delta
        events: list = []
        opener, closer = self.fmt.open, self.fmt.close
        while True:
            if self.in_call:
                j = self.buf.find(closer) if closer else -1  # no closing marker: the span runs to the end
                if j < 0:
                    return events
                span, self.buf = self.buf[: j + len(closer)], self.buf[j + len(closer) :]
                self.in_call = False
                self._span(events, span, span[len(opener) : j])
                continue
            if self.after_call:
                stripped = self.buf.lstrip()
                if not stripped:
                    self.buf = ""
                    return events
                self.buf, self.after_call = stripped, False
            i = self.buf.find(opener)
            end = i if i >= 0 else len(self.buf) - partial_prefix(self.buf, opener)
            text = self.ws + self.buf[:end]
            body = text.rstrip()
            if body:
                events.append(body)
            self.ws, self.buf = text[len(body) :], self.buf[end:]
            if i < 0:
                return events
            self.in_call = True

    def _span(self, events: list, span: str, body: str) -> None:
        calls = self.fmt.parse(body)
        if not calls:  # malformed: the span, and the whitespace held before it, are text
            events.append(self.ws + span)
        else:
            events.extend(calls)
            self.num_calls += len(calls)
        self.ws, self.after_call = "", bool(calls)

    def finish(self) -> list:
        """The sample ended: whatever is held back is text (an unclosed span included, unless the
        format's spans run to the end of the sample)."""
        if self.lead is not None:
            lead, self.lead = self.lead, None
            call = _call_of(_unfenced(lead.strip())) if self.bare else None
            if call is not None and call.name in self.names:
                self.num_calls += 1
                return [call]
            return self._feed(lead) + self.finish()
        if self.in_call and not self.fmt.close:
            events: list = []
            self._span(events, self.buf, self.buf[len(self.fmt.open) :])
            self.buf, self.in_call = "", False
            return events + self.finish()
        rest = self.ws + self.buf
        self.buf, self.ws, self.in_call = "", "", False
        return [rest] if rest else []


# -- chat messages and tool definitions for the template ------------------------------------------
def template_tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI `tool_calls` for a chat template: arguments as an object (Qwen's template writes
    them with `tojson`, so a JSON string would be rendered quoted)."""
    out = []
    for c in calls:
        fn = c["function"]
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = loads_json(args) if args.strip() else {}
            except ValueError as e:
                raise ValueError(f"tool call {c.get('id', '')!r}: arguments are not valid JSON ({e})") from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args or {}}})
    return out


def openai_tools(tools: list[dict]) -> list[dict]:
    """Function definitions as chat templates expect them: `{"type": "function", "function": {...}}`."""
    return [{"type": "function", "function": {k: v for k, v in t.items() if v is not None}} for t in tools]


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Prompt ids through the checkpoint's own template, with the tools when there are any."""
    kw = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    return tokenizer.encode(text, add_special_tokens=False)


# -- the grammar that forces a call (llguidance's Lark syntax) ------------------------------------
def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


@dataclass(frozen=True)
class CallMarkers:
    """A call span's markers as the forcing grammar writes them: a quoted string each, or, when the
    checkpoint's tokenizer has the marker as one added token (Qwen2.5's real tokenizer: `<tool_call>`
    is id 151657), that token by id (`<[151657]>`): llguidance never matches such a token to text,
    and the model writes the marker as that token."""

    open: str = json.dumps(OPEN)
    close: str = json.dumps(CLOSE)

    @classmethod
    def of(cls, tokenizer) -> CallMarkers:
        return cls(_marker(tokenizer, OPEN), _marker(tokenizer, CLOSE))


def _marker(tokenizer, text: str) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    added = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "added_tokens_decoder", None) or {}
    return f"<[{ids[0]}]>" if len(ids) == 1 and ids[0] in added else _lark_str(text)


def tool_call_grammar(functions: list[dict], *, parallel: bool = True, markers: CallMarkers | None = None) -> str:
    """A Lark grammar whose sentences are one (or, `parallel`, several) Qwen2.5 tool-call spans,
    each a call to one of `functions` (`{"name", "parameters"}`) with arguments valid for its
    schema. Qwen writes them exactly so (see its template's tool instructions)."""
    if not functions:
        raise ValueError("no function to call")
    m = markers or CallMarkers()
    rules = []
    for i, f in enumerate(functions):
        # Compact JSON with the separators Qwen's template writes (tojson's ", " and ": "): no free
        # whitespace a weak model could pad the arguments with until max_tokens.
        schema = {**(f.get("parameters") or {"type": "object"}), "x-guidance": JSON_STYLE}
        head = f'\n{{"name": {json.dumps(f["name"], ensure_ascii=False)}, "arguments": '
        rules.append(f"call_{i}: {m.open} {_lark_str(head)} args_{i} {_lark_str('}' + chr(10))} {m.close}")
        rules.append(f"args_{i}: %json{json.dumps(schema, ensure_ascii=False)}")
    alts = " | ".join(f"call_{i}" for i in range(len(functions)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, f"call: {alts}", *rules]) + "\n"


def template_messages(messages) -> list[dict]:
    """OpenAI chat messages (protocol.ChatMessage) as the dicts a chat template reads."""
    out = []
    for i, m in enumerate(messages):
        d = {"role": m.role, "content": m.template_content(f"messages.{i}.content")}
        if m.tool_calls:
            try:
                d["tool_calls"] = template_tool_calls([c.model_dump() for c in m.tool_calls])
            except ValueError as e:
                raise ValueError(f"messages.{i}: {e}") from None
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
