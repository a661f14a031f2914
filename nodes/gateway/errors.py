"""The gateway's HTTP errors: `ApiError`, answered as an OpenAI error object, and its 400s."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An HTTP error answered with an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "") -> ApiError:
    return ApiError(400, f"parameter {param!r} is not supported by specbus{why}", param=param,
                    code="unsupported_parameter")
