"""Connection hygiene under idle or hostile clients: uvicorn's h11 protocol with a header deadline,
a higher soft file-descriptor limit, and accept failures logged once per interval.

uvicorn closes a keep-alive connection only after a response; a connection that never sends a
request (or trickles its headers) stays open forever, and about RLIMIT_NOFILE of them stop the
server from accepting anything. asyncio then logs a traceback for each of up to `backlog`
failed accepts per wake-up.
"""

from __future__ import annotations

import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("mlxpaged.server")
ACCEPT_LOG_INTERVAL = 10.0  # seconds between two log lines about failed accepts
FD_SOFT_TARGET = 65536


def header_timeout_protocol(header_timeout: float) -> type:
    """uvicorn's h11 protocol that closes a connection whose next request's headers have not all
    arrived `header_timeout` seconds after the connection opened or the first byte of them came."""

    class Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._disarm()
            elif self._deadline is None and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self._in_request() and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def raise_fd_limit(target: int = FD_SOFT_TARGET) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE toward the hard one; returns the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, hard


class AcceptErrorLog:
    """An event-loop exception handler: failed accepts (EMFILE...) are logged once per interval
    with a count, without a traceback; everything else goes to the default handler."""

    def __init__(self, interval: float = ACCEPT_LOG_INTERVAL):
        self.interval, self.last, self.suppressed = interval, float("-inf"), 0

    def __call__(self, loop, context: dict) -> None:
        if not str(context.get("message", "")).startswith("socket.accept()"):
            return loop.default_exception_handler(context)
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return
        exc = context.get("exception")
        more = f" ({self.suppressed} more since the last report)" if self.suppressed else ""
        log.error("cannot accept connections: %s%s; idle connections close after --header-timeout", exc, more)
        self.last, self.suppressed = now, 0
