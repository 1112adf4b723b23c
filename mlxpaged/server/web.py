"""The web page of `mlxpaged serve` (off with `--no-web`): a chat panel and a live view of the KV cache.

Routes: `GET /` (the page), `/web/app.js` and `/web/app.css` (its static files, shipped in
`static/`, no build step, no CDN), `/web/cache` (server-sent events: the cache picture, at most
`PUSH_INTERVAL` apart) and `/web/cache.json` (one picture). The page and its two files are open
paths: they hold no data, and the page must load to ask for the key. The cache routes and every
API route the page calls stay behind `--api-key` (`Guard`), and the page sends the key it is given.
The picture is `engine.cache_view`'s: shapes and counts, never token ids or text.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from ..engine.cache_view import CacheFeed
from .engine_loop import EngineLoop

STATIC = Path(__file__).parent / "static"
FILES = {"/": "index.html", "/web/app.js": "app.js", "/web/app.css": "app.css"}
OPEN_PATHS = tuple(FILES)  # for Guard: served without the key
PUSH_INTERVAL = 0.1  # seconds between two pictures sent to one viewer
WAIT_FIRST = 5.0  # seconds /web/cache.json waits for a first picture


def register_web(app: FastAPI, engine_loop: EngineLoop) -> CacheFeed:
    """Add the page's routes and hook a `CacheFeed` into the engine loop; returns the feed."""
    feed = CacheFeed(min_interval=PUSH_INTERVAL)  # no picture is built that no viewer would be sent
    engine_loop.on_step = feed.publish

    def watch() -> None:
        feed.attach()
        if feed.latest is None:  # the engine went idle before the hook was set: one iteration publishes
            engine_loop.abort("")  # no request has this id: the abort itself does nothing

    for path, name in FILES.items():
        # HEAD too: clients probe the root before their first request (Claude Code sends `HEAD /`)
        app.add_api_route(path, _file_route(STATIC / name), methods=["GET", "HEAD"], include_in_schema=False)

    @app.get("/web/cache.json", include_in_schema=False)
    async def cache_json():
        watch()  # the engine builds a picture at its next step; an idle engine's last one is current
        seen = feed.version
        try:
            for _ in range(int(WAIT_FIRST / PUSH_INTERVAL)):
                if feed.latest is not None and (feed.version != seen or not engine_loop.busy):
                    break
                await asyncio.sleep(PUSH_INTERVAL)
        finally:
            feed.detach()
        return JSONResponse(feed.latest or {})

    @app.get("/web/cache", include_in_schema=False)
    async def cache_events():
        async def events():
            watch()
            try:
                sent = -1
                while not engine_loop.draining:  # an open stream must not hold up a shutdown
                    if feed.version != sent and feed.latest is not None:
                        sent = feed.version
                        yield f"data: {json.dumps(feed.latest, separators=(',', ':'))}\n\n"
                    await asyncio.sleep(PUSH_INTERVAL)
            finally:
                feed.detach()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-store"})

    return feed


def _file_route(path: Path):
    async def serve_file():
        return FileResponse(path, headers={"cache-control": "no-cache"})

    return serve_file
