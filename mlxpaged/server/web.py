"""The web page of `mlxpaged serve` (off with `--no-web`): a chat panel and a live view of the KV cache.

Routes: `GET /` (the page), `/web/app.js` and `/web/app.css` (its static files, shipped in
`static/`, no build step, no CDN), `/web/cache` (server-sent events: the cache picture, at most
`PUSH_INTERVAL` apart) and `/web/cache.json` (one picture). The page and its two files are open
paths: they hold no data, and the page must load to ask for the key. The cache routes and every
API route the page calls stay behind `--api-key` (`Guard`), and the page sends the key it is given.
The picture is `engine.cache_view`'s: shapes and counts, never token ids or text.

Each picture is serialized once and the same bytes go to every viewer (`LiveView`); at most
`max_viewers` viewers (streams and `/web/cache.json` reads) at once, beyond that 503. The page's
files carry a Content-Security-Policy (its own scripts and connections only) and are never framed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response, StreamingResponse

from ..engine.cache_view import CacheFeed
from .engine_loop import EngineLoop
from .errors import APIError

STATIC = Path(__file__).parent / "static"
FILES = {"/": "index.html", "/web/app.js": "app.js", "/web/app.css": "app.css"}
OPEN_PATHS = tuple(FILES)  # for Guard: served without the key
PUSH_INTERVAL = 0.1  # seconds between two pictures sent to one viewer
WAIT_FIRST = 5.0  # seconds /web/cache.json waits for a first picture
PAGE_HEADERS = {
    "cache-control": "no-cache",
    # the page runs its own script and talks to its own server only, and no other page may frame it
    "content-security-policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


class LiveView:
    """The feed's pictures as the viewers are sent them, and the viewers' count.

    Invariant: `feed.viewers` counts the routes between their `enter` and `leave`, never more than
    `max_viewers`; `encoded` serializes each picture once (by identity: `feed.latest` is replaced
    whole, never changed), however many viewers are sent it.
    """

    def __init__(self, feed: CacheFeed, engine_loop: EngineLoop, max_viewers: int):
        self.feed, self.engine_loop, self.max_viewers = feed, engine_loop, max_viewers
        self._of: dict | None = None
        self._bytes = b""

    def enter(self) -> None:
        """Count one more viewer, or 503 when `max_viewers` already watch (on the event loop only:
        the check and the count cannot interleave with another route's)."""
        if self.feed.viewers >= self.max_viewers:
            raise APIError(
                503,
                f"{self.max_viewers} viewers already watch the cache view (--max-web-viewers); try again later",
                code="too_many_viewers",
                headers={"retry-after": "5"},
            )
        self.feed.attach()
        if self.feed.latest is None:  # the engine went idle before the hook was set: one iteration publishes
            self.engine_loop.abort("")  # no request has this id: the abort itself does nothing

    def leave(self) -> None:
        self.feed.detach()

    def encoded(self) -> tuple[dict | None, bytes]:
        """(the newest picture, its JSON bytes), serialized only the first time it is asked for."""
        latest = self.feed.latest
        if latest is not None and latest is not self._of:
            self._of, self._bytes = latest, json.dumps(latest, separators=(",", ":")).encode()
        return latest, self._bytes


def register_web(app: FastAPI, engine_loop: EngineLoop, max_viewers: int = 8) -> CacheFeed:
    """Add the page's routes and hook a `CacheFeed` into the engine loop; returns the feed."""
    feed = CacheFeed(min_interval=PUSH_INTERVAL)  # no picture is built that no viewer would be sent
    engine_loop.on_step = feed.publish
    live = LiveView(feed, engine_loop, max_viewers)

    for path, name in FILES.items():
        # HEAD too: clients probe the root before their first request (Claude Code sends `HEAD /`)
        app.add_api_route(path, _file_route(STATIC / name), methods=["GET", "HEAD"], include_in_schema=False)

    @app.get("/web/cache.json", include_in_schema=False)
    async def cache_json():
        live.enter()  # the engine builds a picture at its next step; an idle engine's last one is current
        seen = feed.version
        try:
            for _ in range(int(WAIT_FIRST / PUSH_INTERVAL)):
                if feed.latest is not None and (feed.version != seen or not engine_loop.busy):
                    break
                await asyncio.sleep(PUSH_INTERVAL)
        finally:
            live.leave()
        latest, body = live.encoded()
        return Response(body if latest is not None else b"{}", media_type="application/json")

    @app.get("/web/cache", include_in_schema=False)
    async def cache_events():
        live.enter()  # here, not in the stream: a refused viewer gets its 503 before any event

        async def events():
            sent = None
            while not engine_loop.draining:  # an open stream must not hold up a shutdown
                latest, body = live.encoded()
                if latest is not None and latest is not sent:
                    sent = latest
                    yield b"data: " + body + b"\n\n"
                await asyncio.sleep(PUSH_INTERVAL)

        return _Counted(live, events(), media_type="text/event-stream", headers={"cache-control": "no-store"})

    return feed


class _Counted(StreamingResponse):
    """A viewer's stream that leaves the count however it ends (a generator that never started
    would never run its own `finally`)."""

    def __init__(self, live: LiveView, *args, **kw):
        super().__init__(*args, **kw)
        self.live = live

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.live.leave()


def _file_route(path: Path):
    async def serve_file():
        return FileResponse(path, headers=PAGE_HEADERS)

    return serve_file
