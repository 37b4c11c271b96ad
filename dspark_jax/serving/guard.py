"""Pure ASGI middleware in front of the HTTP app: the Host and Origin checks, CORS for the
allowed origins, and counting every answer by path and status.

Pure ASGI, not Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`): that one runs the
handler behind a receive channel of its own which does not pass the client's disconnect on, so a
non-streamed request kept its slot, generating, after its client left.

- Host: a page of evil.example whose name is made to resolve to 127.0.0.1 (DNS rebinding)
  reaches a loopback server with `Host: evil.example`, and can read the answers; a Host outside
  `allowed_hosts` (None: any) gets 400.
- Origin: browsers name the page's origin on cross-origin requests, and the server has no pages
  of its own, so an `Origin` outside `allowed_origins` (default none; "*": any) gets 403 before
  the request runs (a form or `text/plain` POST would otherwise run, unread but paid for). An
  allowed origin gets CORS headers and its preflight answered.
"""

from __future__ import annotations

from typing import Callable, Collection

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from dspark_jax.serving.protocol import ApiError

PREFLIGHT_MAX_AGE_S = 600


def host_name(host: str) -> str:
    """The name of a Host header value, without its port: `[::1]:8000` -> `::1`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """`count(path, status)` is called once per HTTP request, whatever its outcome."""

    def __init__(self, app, *, count: Callable[[str, int], None], allowed_hosts: Collection[str] | None = None,
                 allowed_origins: Collection[str] = ()):
        self.app, self.count = app, count
        self.hosts = None if allowed_hosts is None or "*" in allowed_hosts else {h.lower() for h in allowed_hosts}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def _origin_ok(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/").lower() in self.origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")] \
            if origin is not None and self._origin_ok(origin) else []
        status = 500

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if cors:
                    message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        try:
            if self.hosts is not None and host_name(headers.get("host", "")) not in self.hosts:
                err = ApiError(400, "Host header not allowed (the server's --allowed_hosts)", code="invalid_host")
                await JSONResponse(err.body(), status_code=400)(scope, receive, send_counted)
            elif origin is not None and not cors:
                err = ApiError(403, f"cross-origin requests from {origin!r} are not allowed (the server's "
                               "--allowed_origins)", kind="permission_error", code="origin_not_allowed")
                await JSONResponse(err.body(), status_code=403)(scope, receive, send_counted)
            elif cors and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await Response(status_code=204, headers={
                    "access-control-allow-methods": "GET, POST, OPTIONS",
                    "access-control-allow-headers": headers.get("access-control-request-headers",
                                                                "authorization, content-type"),
                    "access-control-max-age": str(PREFLIGHT_MAX_AGE_S)})(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            self.count(scope["path"], status)
