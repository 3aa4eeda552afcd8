"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure the server answers.

``APIError`` carries the status and the field; the handlers installed by :func:`install_error_handlers` turn
request-validation errors (pydantic), routing errors (404 / 405) and ``APIError`` into that shape. Status codes
follow OpenAI: 400 invalid request, 401 bad key, 404 unknown model or route, 413 body too large, 503 shutting
down or engine failed. Source: the OpenAI API error codes; vLLM ``ErrorResponse``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_error",
          503: "service_unavailable"}


class APIError(Exception):
    """A request the server refuses. ``param`` names the offending field (``messages[0].content``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value",
                 status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.status, exc.param, exc.code), status_code=exc.status)


def _param(loc: tuple[Any, ...]) -> str | None:
    """pydantic ``loc`` -> ``messages[0].content``; stops at union member tags (``str``, ``list[int]``)."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and not part[0].isupper() and part not in _TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}
_CODES = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter",
          "json_invalid": "invalid_json"}


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    """The first pydantic error as an APIError naming its field."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request", code="invalid_request")
    first = errors[0]
    kind = first.get("type", "")
    param = _param(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        return APIError("the request body is not valid JSON: " + str(first.get("ctx", {}).get("error", "")),
                        code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return APIError(f"you must provide '{param}'", param, "missing_required_parameter")
    if param is None:
        return APIError("the request body must be a JSON object with the documented fields: "
                        f"{first.get('msg', 'invalid')}", None, "invalid_type")
    code = _CODES.get(kind, "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
    return APIError(f"{param}: {first.get('msg', 'invalid value')}", param, code)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every refusal in the OpenAI error shape (validation 400, APIError, 404/405)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), exc.status_code, None, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
