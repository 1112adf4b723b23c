"""An image URL's bytes, fetched for a request only when the server runs with `--fetch-image-urls`.

Each fetch runs on a thread of this module's small pool, never on the event loop or the tokenizer
thread, and is bounded: in bytes (`--max-image-bytes`: a larger `Content-Length` is refused before
the body, a body is read no further than one byte past it) and in time (`--image-fetch-timeout`,
the whole fetch: the route stops waiting then, and the thread stops reading at that deadline, each
read also bounded by the socket's timeout). Only http and https are opened, and a redirect is
followed only to http(s) (at most `MAX_REDIRECTS`): no file, ftp or data URL is reached that way.
"""

from __future__ import annotations

import asyncio
import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ..version import __version__
from .errors import APIError

SCHEMES = ("http", "https")
MAX_REDIRECTS = 5
FETCHERS = 4  # fetches at once, all requests together; more wait their turn (within their timeout)
READ = 64 << 10  # bytes asked of the socket at a time

_pool = ThreadPoolExecutor(FETCHERS, thread_name_prefix="image-fetch")


def is_url(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme.lower() in SCHEMES


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects (relative ones resolved), to http(s) only and at most MAX_REDIRECTS."""

    max_redirections = MAX_REDIRECTS

    def http_error_302(self, req, fp, code, msg, headers):
        target = urllib.parse.urljoin(req.full_url, headers.get("location") or headers.get("uri") or "")
        if not is_url(target):
            scheme = urllib.parse.urlsplit(target).scheme or "?"
            raise ValueError(f"redirected to a non-http(s) URL ({scheme}:); only http(s) URLs are fetched")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _opener() -> urllib.request.OpenerDirector:
    """http(s) and their redirects only (no file:, ftp: or data: handler, no proxy)."""
    opener = urllib.request.OpenerDirector()
    for h in (
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        _Redirects(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(h)
    return opener


def fetch(url: str, max_bytes: int, timeout: float) -> bytes:
    """The body at `url`, at most `max_bytes`, within `timeout` seconds; a ValueError saying why not."""
    deadline = time.monotonic() + timeout
    req = urllib.request.Request(url, headers={"User-Agent": f"mlxpaged/{__version__}", "Accept": "image/*"})
    try:
        with _opener().open(req, timeout=timeout) as r:
            length = r.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise ValueError(f"the image is {length} bytes, more than {max_bytes} (--max-image-bytes)")
            body = bytearray()
            while chunk := r.read1(READ):  # read1: what has arrived, so a trickle meets the deadline
                body += chunk
                if len(body) > max_bytes:
                    raise ValueError(f"the image is more than {max_bytes} bytes (--max-image-bytes)")
                if time.monotonic() > deadline:
                    raise TimeoutError
            return bytes(body)
    except urllib.error.HTTPError as e:
        raise ValueError(f"fetching the image got HTTP {e.code} {e.reason}") from None
    except TimeoutError:
        raise ValueError(f"fetching the image took longer than {timeout:g} s (--image-fetch-timeout)") from None
    except urllib.error.URLError as e:
        raise ValueError(f"fetching the image failed: {e.reason}") from None
    except (http.client.HTTPException, OSError) as e:
        raise ValueError(f"fetching the image failed: {e}") from None


async def fetch_images(limits, images: list[tuple[str, str]]) -> list[tuple[str, str | bytes]]:
    """`images` ((where, url) pairs) with each http(s) URL replaced by its fetched bytes, all
    fetched at once; a 400 naming the part when one is refused or fails."""

    async def one(where: str, url: str):
        if not is_url(url):
            return where, url
        fut = asyncio.get_running_loop().run_in_executor(
            _pool, fetch, url, limits.max_image_bytes, limits.image_fetch_timeout
        )
        try:
            return where, await asyncio.wait_for(fut, limits.image_fetch_timeout)
        except asyncio.TimeoutError:
            msg = f"fetching the image took longer than {limits.image_fetch_timeout:g} s (--image-fetch-timeout)"
            raise APIError(400, f"{where}: {msg}", param=where) from None
        except ValueError as e:
            raise APIError(400, f"{where}: {e}", param=where) from None

    return list(await asyncio.gather(*(one(w, u) for w, u in images)))
