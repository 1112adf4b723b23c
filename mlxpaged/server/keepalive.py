"""Keep a silent stream alive: while a request waits in the queue or prefills a long prompt, no
event is due, and agent CLIs (Claude Code, Codex) give up near 300 s of silence.

`keepalive(events, beat)` passes a stream's events through and, whenever none came for
`INTERVAL` seconds, sends `beat`: an SSE comment (`: keep-alive`, which every SSE client skips)
on the OpenAI routes, Anthropic's own `ping` event on /v1/messages. A route applies it where it
builds its StreamingResponse, so the events themselves are unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

INTERVAL = 15.0  # seconds of silence before a beat (module constant: tests lower it)
COMMENT = ": keep-alive\n\n"
PING = f"event: ping\ndata: {json.dumps({'type': 'ping'})}\n\n"


async def keepalive(events, beat: str = COMMENT):
    """`events`, with `beat` between two of them that are more than `INTERVAL` seconds apart.
    Closing this generator closes `events` (its `finally` aborts the engine request)."""
    it = events.__aiter__()
    nxt = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=INTERVAL)
            if not done:
                yield beat
                continue
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            finally:
                nxt = None
            yield item
    finally:
        if nxt is not None:  # closed while the next event was pending: stop it before closing `events`
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        if hasattr(it, "aclose"):
            await it.aclose()
