"""Pure ASGI middleware around every request: the request id, the body size limit and the body deadline.

Pure ASGI rather than BaseHTTPMiddleware, which would buffer streaming responses and hide the client's
disconnect from the endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyserve.server.errors import PayloadTooLarge, RequestBodyTimeout, error_response, internal_error

logger = logging.getLogger(__name__)
_VALID_ID = re.compile(r"^[\w.:@/+=-]{1,128}$")  # echoed into a header and logs: no spaces or control chars


class RequestContextMiddleware:
    """Echoes a sane `X-Request-Id` (or makes one), stores it in scope state, answers 413 for a body over
    `max_body_bytes` (at once from Content-Length, or as soon as a chunked body crosses the limit), 408 for
    a body not all received within `body_read_timeout` seconds of the request's start (a slowloris peer
    holds a connection and its buffer otherwise), and turns any exception that escaped the app into a 500
    naming the request id. Both limits are raised from the app's receive, so the app's error handler
    answers them; a body the app never reads is the launcher's to cut off (it closes the connection)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_read_timeout: float = 30.0):
        self.app, self.max_body_bytes, self.body_read_timeout = app, max_body_bytes, body_read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _VALID_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        raw_id = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", raw_id)]
            await send(message)

        too_large = PayloadTooLarge(f"request body exceeds the limit of {self.max_body_bytes} bytes",
                                    code="request_too_large")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await error_response(too_large)(scope, receive, send_with_id)
            return
        too_slow = RequestBodyTimeout(f"the request body was not received within {self.body_read_timeout:g}s")
        received, is_body_done = 0, False
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + self.body_read_timeout

        async def limited_receive() -> Message:
            nonlocal received, is_body_done
            if is_body_done:  # only http.disconnect is left to wait for, for as long as the response lasts
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, body_deadline - loop.time()))
            except asyncio.TimeoutError:
                logger.info("request %s: body not received within %gs", request_id, self.body_read_timeout)
                raise too_slow from None  # answered by the app's error handler, with Connection: close
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise too_large  # the app's error handler turns it into the 413 response
                is_body_done = not message.get("more_body", False)
            else:
                is_body_done = True  # http.disconnect: nothing more will come
            return message

        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_with_id(message)

        try:
            await self.app(scope, limited_receive, send_tracked)
        except ClientDisconnect:  # gone while its body was read: nobody to answer, nothing went wrong
            logger.debug("client of request %s left before sending its body", request_id)
        except Exception:  # noqa: BLE001 - the one place a bug becomes a 500, logged once with its traceback
            logger.exception("unexpected error in request %s", request_id)
            if not started:
                await internal_error(request_id)(scope, receive, send_with_id)
