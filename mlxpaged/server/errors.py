"""The one error shape every failure of the server answers with, as OpenAI's API does.

`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`; 4xx
answers are `invalid_request_error`, 5xx answers `server_error`.
"""

from __future__ import annotations


class APIError(Exception):
    """A failure with its HTTP status; raised anywhere in a route, rendered by `error_body`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
