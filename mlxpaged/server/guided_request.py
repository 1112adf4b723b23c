"""What a request asks of decoding: the tools to render, whether to parse calls, and the grammar.

Every route maps its own fields here: OpenAI chat (`tools`, `tool_choice`, `response_format`),
Anthropic (`tools`, `tool_choice` auto/any/tool/none) and Responses (`tools`, `tool_choice`,
`text.format`). The grammar engine is the engine's (`engine/guided.py`); a schema it cannot
enforce raises ValueError there, which becomes a 400 naming the field here.

`GrammarGate` compiles a request's grammar before the engine sees it, on a thread of its own:
never on the engine thread (a compile stalls every request's decoding) nor on the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .errors import APIError
from .tools import template_messages, tool_call_grammar


def guided(param: str, *, json_schema: dict | None = None, json_object: bool = False, grammar: str | None = None):
    """A `GuidedDecoding`, or a 400 on `param` when the engine cannot enforce it."""
    try:
        from ..engine.guided import GuidedDecoding
    except ImportError:  # an engine without the grammar engine: refuse rather than ignore
        raise APIError(400, f"{param}: constrained decoding is not available on this server", param=param) from None
    try:
        return GuidedDecoding(json_schema=json_schema, json_object=json_object, grammar=grammar)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer to compile is refused (its compile runs on)


class GrammarGate:
    """Compiles the grammars requests ask for, one at a time on its own thread, within
    `timeout_s`; builds llguidance's tokenizer there at start.

    Invariant: a route's grammar reaches the engine compiled: `compile` returns the `Grammar`,
    and while the caller holds it the engine thread's `GrammarCompiler.compile` finds it
    without compiling (guided.py). Oversized specs never get here (`GuidedDecoding` refuses them).
    """

    def __init__(self, compiler, timeout_s: float = COMPILE_TIMEOUT_S):
        self.compiler, self.timeout_s = compiler, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxpaged-grammar")
        self._pool.submit(compiler.warm)

    async def compile(self, spec, param: str | None):
        """The compiled grammar of `spec`, or a 400 on `param` (unenforceable, or too slow to compile)."""
        g = self.compiler.lookup(spec)
        if g is not None:
            return g
        fut = self._pool.submit(self.compiler.compile, spec)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(
                400, f"{param}: the grammar took longer than {self.timeout_s:g} s to compile; simplify it", param=param
            ) from None
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def format_guided(kind: str, schema: dict | None, param: str):
    """`text` (None), `json_object` or `json_schema` output, as both OpenAI routes name them."""
    if kind == "text":
        return None
    if kind == "json_object":
        return guided(param, json_object=True)
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a json_schema format needs its 'schema' (a JSON schema object)", param=param)
    return guided(param, json_schema=schema)


@dataclass
class ToolPlan:
    """tools: rendered into the prompt (OpenAI's `{"type": "function", "function": ...}` form), or None.
    parse: the offered function names when the output is read for calls (`tools.ToolCallStream`),
    else None. guided: the grammar that forces a call."""

    tools: list[dict] | None = None
    parse: frozenset[str] | None = None
    guided: object | None = None
    param: str | None = None  # the request field that asked for `guided` (named in its errors)


def tool_plan(
    functions: list[dict],
    choice: str,
    named: str | None = None,
    *,
    parallel: bool = True,
    param: str = "tool_choice",
    markers=None,
) -> ToolPlan:
    """functions: `{"name", "description", "parameters"}`; choice: auto, none, required or named.

    `none` leaves the tools out of the prompt (a small model shown tools tends to call them), so
    its output is plain text. `required` and a named function are enforced by the grammar.
    """
    if not functions:
        if choice in ("required", "named"):
            raise APIError(400, f"{param}: '{named or choice}' needs tools, and the request offers none", param=param)
        return ToolPlan()
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: the function name '{dup}' is offered twice", param="tools")
    if choice == "none":
        return ToolPlan()
    rendered = [{"type": "function", "function": {k: v for k, v in f.items() if v is not None}} for f in functions]
    if choice == "auto":
        return ToolPlan(rendered, frozenset(names))
    if choice == "named":
        if named not in names:
            raise APIError(
                400, f"{param}: function '{named}' is not among the offered tools ({', '.join(names)})", param=param
            )
        forced = [f for f in functions if f["name"] == named]
    else:
        forced = functions
    from ..engine.guided import unsatisfiable

    for f in forced:  # a call with no possible arguments: the grammar would write half a call
        why = unsatisfiable(f.get("parameters") or {"type": "object"})
        if why:
            raise APIError(400, f"tools: the parameters of function '{f['name']}': {why}", param="tools")
    try:
        grammar = tool_call_grammar(forced, parallel=parallel and choice != "named", markers=markers)
    except ValueError as e:
        raise APIError(400, f"tools: {e}", param="tools") from None
    return ToolPlan(rendered, frozenset(names), guided("tools", grammar=grammar), "tools")


def chat_plan(body, markers=None) -> tuple[list[dict], ToolPlan]:
    """An OpenAI chat body's template messages and its tool plan, `response_format` included."""
    from .protocol import NamedToolChoice

    try:
        messages = template_messages(body.messages)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    functions = [
        {"name": t.function.name, "description": t.function.description, "parameters": t.function.parameters}
        for t in body.tools or []
    ]
    tc = body.tool_choice
    if isinstance(tc, NamedToolChoice):
        choice, named = "named", tc.function.name
    else:
        choice, named = tc or ("auto" if functions else "none"), None
    plan = tool_plan(functions, choice, named, parallel=body.parallel_tool_calls, markers=markers)
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if plan.guided is not None:
            raise APIError(
                400,
                f"response_format: cannot be combined with tool_choice '{named or choice}' (both constrain the output)",
                param="response_format",
            )
        spec = rf.json_schema
        plan.guided = format_guided(rf.type, spec.schema_ if spec is not None else None, "response_format")
        plan.param = "response_format"
    return messages, plan
