"""Two ASGI middlewares that act before FastAPI sees a request: the API key and the body
size limit. Both answer in OpenAI's error shape."""

from __future__ import annotations

import base64
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.server.errors import error_response


class ApiKeyAuth:
    """Every path but `open_paths` needs `Authorization: Bearer KEY` (compared in constant
    time). A browser may give the key as the password of HTTP Basic auth instead: the web
    view at / asks for it that way, and the browser then sends it with the page's requests."""

    def __init__(self, app: ASGIApp, key: str, open_paths: set[str]) -> None:
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    def _authorized(self, header: str) -> bool:
        scheme, _, value = header.partition(" ")
        value = value.strip()
        if scheme.lower() == "basic":
            try:
                value = base64.b64decode(value, validate=True).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.encode("utf-8", "replace"), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        if self._authorized(header):
            return await self.app(scope, receive, send)
        message = "a valid API key is required: send 'Authorization: Bearer KEY'" if not header else \
            "the API key is not valid"
        challenge = 'Basic realm="specdec", charset="UTF-8"' if scope["path"] == "/" else "Bearer"
        response = error_response(401, message, None, "invalid_api_key", {"WWW-Authenticate": challenge})
        await response(scope, receive, send)


class BodyLimit:
    """Bodies over `limit` bytes get a 413. The body is read here, whole (it is small by
    then), and handed on; an oversized one is drained first, up to a point, so the client
    reads the 413 on a connection that stays usable."""

    def __init__(self, app: ASGIApp, limit: int, drain_limit: int = 64_000_000) -> None:
        self.app, self.limit, self.drain_limit = app, limit, drain_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        chunks, size, more = [], 0, True
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            if int(declared) <= self.drain_limit:
                await self._drain(receive)
            return await self._too_large(scope, receive, send)
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            more = bool(message.get("more_body", False))
            if size > self.limit:
                if more and size <= self.drain_limit:
                    await self._drain(receive)
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive: Receive) -> bool:
        size = 0
        while size <= self.drain_limit:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return True
            size += len(message.get("body", b""))
        return False

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"the request body is over the limit of {self.limit} bytes", None,
                                  "request_too_large")
        await response(scope, receive, send)
