"""Checks that run before any route, whatever the route: every route, present or future, inherits them.

`BrowserGuard` runs first: it keeps web pages from driving or reading the server (see `Browsers`):
1. the Host allowlist: a request whose `Host` names neither an allowed name nor an IP address gets
   403 (a DNS-rebinding page reaches 127.0.0.1 under its own name, so its requests say that name);
2. the Origin check: a request with an `Origin` that is neither the server's own nor an allowed
   one gets 403 (CLIs and SDKs send none); with allowed origins, Starlette's CORS middleware,
   inside it, answers their preflights and adds the CORS headers.

`Guard` is one ASGI middleware, in this order:
1. a catch-all: an exception no handler took becomes one OpenAI error object with status 500,
   and its traceback is logged once (not re-raised to uvicorn, which would log it again);
2. draining: once shutdown began, new requests get 503 (`/health` itself says "draining");
3. the API key, from the headers alone, before a byte of the body is read: `Authorization: Bearer
   KEY` (the scheme in any case) or `x-api-key: KEY`, compared as bytes (the key's UTF-8) in constant time;
4. the body cap: a `Content-Length` above it gets 413 at once, and a body that grows past it
   (chunked) gets 413 as soon as it does; the body read here is replayed to the route;
5. a POST, PUT or PATCH body must be sent as `application/json` (any parameters), else 415: a
   page on another origin can send `text/plain` without a CORS preflight, never JSON.

`AccessLog`, outside it, writes one line per request on the `mlxpaged.server` logger (method,
path, status, prompt and output tokens when a job ran, seconds, and a 4xx/5xx's message) and
adds the headers a route `note`d (`x-mlxpaged-max-tokens-clamped`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from urllib.parse import urlsplit

from .errors import error_body

log = logging.getLogger("mlxpaged.server")
CLOSE = {"connection": "close"}  # refusals close the connection: an unread body is never read


# Anthropic's error types by status, for the routes that speak its protocol (/v1/messages...).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)
OLLAMA_PATHS = ("/api/",)


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_bytes(
    status: int, message: str, *, param: str | None = None, code: str | None = None, path: str = ""
) -> bytes:
    """The route's own error object: Anthropic's on its paths, Ollama's (`{"error": message}`) on
    /api/..., OpenAI's everywhere else."""
    if path.startswith(ANTHROPIC_PATHS):
        body = anthropic_error_body(status, message)
    elif path.startswith(OLLAMA_PATHS):
        body = {"error": message}
    else:
        body = error_body(status, message, param=param, code=code)
    # ASCII-escaped: a message quoting client text with a lone surrogate still encodes.
    return json.dumps(body, ensure_ascii=True).encode("ascii")


async def send_error(
    send, status: int, message: str, *, code: str | None = None, headers: dict | None = None, path: str = ""
) -> None:
    body = error_bytes(status, message, code=code, path=path)
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def key_matches(headers: dict[bytes, bytes], api_key: str) -> bool | None:
    """True/False for a right/wrong key, None when none was sent.

    Compared as bytes: the key's UTF-8 against the header's raw bytes (HTTP headers are bytes;
    decoding them as Latin-1 first made a non-ASCII key match only its Latin-1 spelling)."""
    given = None
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, token = auth.strip().partition(b" ")
        given = token.strip() if scheme.lower() == b"bearer" else b""
    elif b"x-api-key" in headers:  # Anthropic's clients send the key this way
        given = headers[b"x-api-key"].strip()
    if given is None:
        return None
    return hmac.compare_digest(given, api_key.encode("utf-8", "surrogateescape"))


LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")  # always answered, whatever the bound address


def _shown(raw: bytes | str) -> str:
    """A header's value for a message: text, at most 80 characters."""
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    return text if len(text) <= 80 else text[:80] + "..."


def host_name(host: str) -> str:
    """The name in a `Host` header (or a bound address), lower case, without port, brackets or final dot."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        return host[1 : host.find("]")] if "]" in host else host
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        host = name
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _origin(value: str) -> str:
    """An allowed origin as browsers send it: `scheme://host[:port]`, lower case; ValueError otherwise."""
    value = value.strip().lower().rstrip("/")
    try:
        parts = urlsplit(value)
        ok = parts.scheme in ("http", "https") and parts.hostname and not (parts.path or parts.query or parts.fragment)
    except ValueError:  # "http://[::1" and the like
        ok = False
    if not ok:
        raise ValueError(f"--allowed-origins: {value!r} is not an origin such as http://localhost:3000, or '*'")
    return value


@dataclass(frozen=True)
class Browsers:
    """Which `Host` names and `Origin`s the server answers.

    Invariant: `hosts` is None (any Host: the check is off) or the lower-case names allowed beside
    every IP address (an address is never a rebinding: the browser connected to it, not to a name
    it looked up); `origins` holds the other origins allowed beside the server's own (the `Host`
    it was reached at), "*" for any. No `Origin` at all (CLIs, SDKs, same-origin GETs) is allowed.
    """

    hosts: frozenset[str] | None = None
    origins: frozenset[str] = frozenset()

    @classmethod
    def of(cls, bound: str, allowed_hosts=(), allowed_origins=()) -> Browsers:
        """The policy of a server bound to `bound`: that address, localhost and the loopback
        addresses, plus `allowed_hosts` ("*": any); `allowed_origins` checked and normalized."""
        extra = {host_name(h) for h in allowed_hosts if h.strip()}
        hosts = None if "*" in extra else frozenset({host_name(bound), *LOCAL_NAMES, *extra})
        origins = {o.strip() for o in allowed_origins if o.strip()}
        return cls(hosts, frozenset({"*"} if "*" in origins else map(_origin, origins)))

    def host_allowed(self, host: bytes | None) -> bool:
        if self.hosts is None or host is None:  # no Host: HTTP/1.0, never a browser
            return True
        name = host_name(host.decode("latin-1"))
        return name in self.hosts or _is_ip(name)

    def origin_allowed(self, origin: bytes, host: bytes | None) -> bool:
        value = origin.decode("latin-1").strip().lower()
        if "*" in self.origins or value in self.origins:
            return True
        if host is None or value == "null":
            return False
        try:  # the server's own page: the origin's host[:port] is the Host it was reached at
            return urlsplit(value).netloc == host.decode("latin-1").strip().lower()
        except ValueError:  # not a URL ("http://[x")
            return False

    @property
    def cors(self) -> list[str]:
        """The origins that get CORS headers (Starlette's `allow_origins`); empty: CORS off."""
        return sorted(self.origins)


class BrowserGuard:
    def __init__(self, app, *, browsers: Browsers):
        self.app, self.browsers = app, browsers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        host, origin = headers.get(b"host"), headers.get(b"origin")
        if not self.browsers.host_allowed(host):
            return await send_error(
                send,
                403,
                f"Host '{_shown(host)}' is not a name this server answers to (a guard against DNS rebinding): "
                "start it with --allowed-hosts NAME to allow it",
                code="host_not_allowed",
                headers=CLOSE,
                path=path,
            )
        if origin is not None and not self.browsers.origin_allowed(origin, host):
            return await send_error(
                send,
                403,
                f"Origin '{_shown(origin)}' may not call this server (a guard against other web pages): "
                "start it with --allowed-origins ORIGIN to allow it",
                code="origin_not_allowed",
                headers=CLOSE,
                path=path,
            )
        await self.app(scope, receive, send)


def is_json(content_type: bytes | None) -> bool:
    """Whether a `Content-Type` is application/json, whatever its parameters (charset...)."""
    return content_type is not None and content_type.split(b";")[0].strip().lower() == b"application/json"


class Guard:
    def __init__(self, app, *, api_key: str | None, open_paths: frozenset[str], max_body_bytes: int, draining):
        self.app, self.api_key, self.open_paths = app, api_key, open_paths
        self.max_body_bytes, self.draining = max_body_bytes, draining  # draining: () -> bool

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._checked(scope, receive, tracked_send)
        except Exception as e:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(
                    send,
                    500,
                    f"internal server error ({type(e).__name__}); the server log has the details",
                    path=scope.get("path", ""),
                )

    async def _checked(self, scope, receive, send):
        path = scope.get("path", "")
        if self.draining() and path != "/health":
            return await send_error(
                send,
                503,
                "the server is shutting down",
                code="server_shutting_down",
                headers={"connection": "close"},
                path=path,
            )
        headers = dict(scope.get("headers") or [])
        if self.api_key and path not in self.open_paths:
            ok = key_matches(headers, self.api_key)
            if not ok:
                # closed after the answer: an unread body is never read (nor discarded byte by byte)
                return await send_error(
                    send,
                    401,
                    f"{'missing' if ok is None else 'wrong'} API key: send "
                    "'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                    code="invalid_api_key",
                    headers=CLOSE,
                    path=path,
                )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await send_error(send, 413, self._too_large(), code="request_too_large", headers=CLOSE, path=path)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body arrived
                return
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await send_error(
                    send, 413, self._too_large(), code="request_too_large", headers={"connection": "close"}, path=path
                )
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        if not is_json(headers.get(b"content-type")):
            # after the body cap, so an oversized body is a 413 whatever its type
            return await send_error(
                send,
                415,
                "the request body must be JSON sent with 'Content-Type: application/json' "
                f"(got {repr(_shown(headers[b'content-type'])) if b'content-type' in headers else 'none'})",
                code="unsupported_media_type",
                path=path,
            )
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: http.disconnect, as the route expects

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes (--max-body-bytes)"


# What the route learnt about its request (its job, a clamped max_tokens): one dict per request,
# set by AccessLog; a route's task and its stream's tasks share the dict.
_INFO: ContextVar[dict | None] = ContextVar("mlxpaged_request_info", default=None)
ERROR_BODY_KEEP = 8192  # bytes of an error body read for its message
QUIET_PATHS = frozenset({"/health", "/metrics"})


def note(**facts) -> None:
    """Record facts about the current request for its access line and headers (no-op outside one)."""
    info = _INFO.get()
    if info is not None:
        info.update(facts)


def _tokens(job) -> tuple[int | None, int | None]:
    """(prompt tokens, output tokens) of a job's engine requests (its finished ones' outputs)."""
    if job is None:
        return None, None
    outs = [o for o in job.final.values() if o is not None]
    return sum(map(len, job.prompts)), sum(len(c.token_ids) for o in outs for c in o.outputs)


def _reason(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message") if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


class AccessLog:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        info: dict = {}
        token = _INFO.set(info)
        t0, status, err = time.monotonic(), None, bytearray()

        async def logged_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if "max_tokens_clamped" in info:
                    clamp = (b"x-mlxpaged-max-tokens-clamped", str(info["max_tokens_clamped"]).encode())
                    message = {**message, "headers": [*message.get("headers", ()), clamp]}
            elif message["type"] == "http.response.body" and (status or 0) >= 400 and len(err) < ERROR_BODY_KEEP:
                err.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            _INFO.reset(token)
            self._log(scope, status, info, bytes(err), time.monotonic() - t0)

    def _log(self, scope, status, info: dict, err: bytes, seconds: float) -> None:
        prompt, output = _tokens(info.get("job"))
        line = f"{scope.get('method')} {scope.get('path')} {status if status is not None else '-'}"
        if prompt is not None:
            line += f" prompt={prompt} output={output}"
        if "max_tokens_clamped" in info:
            line += f" max_tokens_clamped={info['max_tokens_clamped']}"
        line += f" {seconds:.3f}s"
        if status is None or status >= 400:
            line += f": {_reason(err) if err else 'no response (client gone)'}"
        level = logging.WARNING if status is None or status >= 500 else logging.INFO
        if status == 200 and scope.get("path") in QUIET_PATHS:
            level = logging.DEBUG  # probes and scrapes, every few seconds: not worth a line each
        log.log(level, "%s", line)
