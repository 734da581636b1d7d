"""Cross-origin requests (CORS): a page served from another origin may call the API when its
origin is allowed (``--allowed-origins``, vLLM's flag). Off by default, unlike vLLM (whose
default is every origin): the server listens on this machine, and any page a user opens could
otherwise read what it answers. Every response to an allowed origin carries the headers, a
stream's included (added as the response is prepared, before its head goes out); a preflight
(``OPTIONS`` with ``Access-Control-Request-Method``) is answered before the API key is asked
for, as browsers send it without one."""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

PREFLIGHT_MAX_AGE_S = 600


@dataclass(frozen=True, slots=True)
class Cors:
    origins: tuple[str, ...] = ()             # "*": any
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def origin_for(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for a request from ``origin`` (None: not allowed)."""
        if origin is None or not self.origins:
            return None
        if "*" in self.origins:
            return origin if self.credentials else "*"     # a credentialed answer names the origin
        return origin if origin in self.origins else None

    def install(self, app: web.Application) -> None:
        if self.origins:
            app.on_response_prepare.append(self._headers)

    async def _headers(self, request: web.Request, response: web.StreamResponse) -> None:
        allowed = self.origin_for(request.headers.get("Origin"))
        if allowed is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        if allowed != "*":
            response.headers.add("Vary", "Origin")
        if self.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"


def preflight(cors: Cors):
    """The middleware answering preflights from allowed origins (outside the API key's check)."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        asked = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or asked is None or cors.origin_for(request.headers.get("Origin")) is None:
            return await handler(request)
        methods = asked if "*" in cors.methods else ", ".join(cors.methods)
        wanted = request.headers.get("Access-Control-Request-Headers", "")
        headers = wanted if "*" in cors.headers else ", ".join(cors.headers)
        return web.Response(status=204, headers={"Access-Control-Allow-Methods": methods,
                                                 "Access-Control-Allow-Headers": headers,
                                                 "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
    return middleware
