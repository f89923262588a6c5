"""Typed API errors and the one place that turns any failure into OpenAI's error body.

Every error response is `{"error": {"message", "type", "param", "code"}}` with the matching status;
nothing else (no stack trace, no framework default body) reaches a client.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyserve.server.openai_api.responses import ErrorBody, ErrorDetail

class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.headers = message, param, code, headers

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorBody(error=detail).dump()


class BadRequest(APIError):
    status, type = 400, "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value"):
        super().__init__(message, param, code)


class Unauthorized(APIError):
    status, type = 401, "authentication_error"


class NotFound(APIError):
    status, type = 404, "invalid_request_error"


class PayloadTooLarge(APIError):
    status, type = 413, "invalid_request_error"


class HeadersTooLarge(APIError):
    status, type = 431, "invalid_request_error"


class RequestBodyTimeout(APIError):
    """The client did not send its whole body in time (slowloris): answered, then the connection closes."""

    status, type = 408, "invalid_request_error"

    def __init__(self, message: str):
        super().__init__(message, code="body_timeout", headers={"Connection": "close"})


class ServiceUnavailable(APIError):
    status, type = 503, "service_unavailable_error"

    def __init__(self, message: str, code: str, retry_after: int | None = 1):
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after)} if retry_after else None)


class Timeout(APIError):
    status, type = 504, "timeout_error"


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'. Union branch tags (type names such as 'str',
    'list[int]', 'TextPart') are not fields and are dropped."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part[:1].islower() and part not in ("str", "int", "float", "bool", "list", "dict"):
            param += f".{part}" if param else part
    return param or None


def bad_request_from_validation(exc: ValidationError | RequestValidationError) -> BadRequest:
    """The first error, named by its field: 'temperature: Input should be a valid number'."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "value_error", "loc": (), "msg": str(exc)}
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first["msg"]
        return BadRequest(f"malformed JSON body: {detail}", code="invalid_json")
    loc = tuple(x for x in first["loc"] if x != "body")
    param = _loc_to_param(loc)
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        msg = "field required"
    elif first["type"] == "model_type" and not loc:
        msg = "the request body must be a JSON object"
    code = "unknown_parameter" if first["type"] == "unknown_parameter" else "invalid_value"  # protocol's own type
    return BadRequest(f"{param}: {msg}" if param else msg, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(bad_request_from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: NotFound, 400: BadRequest, 401: Unauthorized, 413: PayloadTooLarge}.get(exc.status_code)
        error = kind(str(exc.detail)) if kind else APIError(str(exc.detail))
        error.status = exc.status_code
        if exc.status_code == 405:
            error.type = "invalid_request_error"
        return error_response(error)


def internal_error(request_id: str) -> JSONResponse:
    error = APIError(f"internal server error (request id {request_id})", code="internal_error")
    return JSONResponse(error.body(), status_code=500)
