"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeout",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# A request's images must be sent again: the encoder outputs its processed prompt named are
# in no store and the pod never got the pixels (the core's 503). The header tells the router
# (router/processed.py, RESEND_HEADER) to send that leg once more with the images; any other
# client sees a 503 with Retry-After.
RESEND_HEADERS = {"Retry-After": "1", "X-Epdserve-Resend": "images"}


def failed_headers(status: int) -> dict[str, str] | None:
    """The headers of a request the engine failed with ``status``."""
    return RESEND_HEADERS if status == 503 else None


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers  # e.g. Retry-After on a 503 "busy"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def from_value_error(exc: ValueError) -> APIError:
    """``SamplingParams``/engine messages start with the field name: ``"top_p: must be ..."``."""
    message = str(exc)
    field, sep, _ = message.partition(":")
    param = field if sep and re.fullmatch(r"[A-Za-z_][\w.]*(\[\d+\][\w.]*)*", field) else None
    return APIError(400, message, param)


# pydantic names the union member it tried ("str", "list[int]", "function-after[...]")
_UNION_TAG = re.compile(r"(str|int|float|bool|none|[\w-]+\[.*\])")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message naming the first invalid field of a pydantic error list."""
    first = errors[0] if errors else {}
    param = ""
    for part in first.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and not _UNION_TAG.fullmatch(str(part)):
            param += f".{part}" if param else str(part)
    param = param or None
    where = f"'{param}'" if param else "request body"
    return f"{where}: {first.get('msg', 'invalid value')}", param
