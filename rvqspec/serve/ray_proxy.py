"""Ray Serve's HTTP proxy answers some requests itself, in plain text: 429 once every replica is full (and its other
errors). `ProxyErrors` gives those OpenAI's error shape, as the app's own. (Not a request whose replica died before
answering: uvicorn answers that one, a plain "Internal Server Error" 500, outside the middlewares.)

Ray runs it in each proxy when RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names `middlewares` (PROXY_CALLBACK) in the
environment the proxy starts in: `rvqspec serve --ray` sets it for a local instance; on a cluster, set it on each
node before `ray start`. Kept apart from rvqspec/serve/ray.py so that the proxies do not import torch.
"""

import json

PROXY_CALLBACK = "rvqspec.serve.ray_proxy.middlewares"
FIXES = {429: ("rate_limit_error", "every replica is full: retry after Retry-After seconds")}


def middlewares() -> list:
    """What Ray's proxy calls through RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyErrors)]


class ProxyErrors:
    """ASGI middleware: a plain-text error answer of the proxy (429, 5xx) becomes {"error": {...}} JSON."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: dict = {}

        async def reshape(message):
            if message["type"] == "http.response.start" and is_plain_error(message):
                held.update(start=message, body=b"")
                return
            if not held:
                return await send(message)
            held["body"] += message.get("body", b"")
            if not message.get("more_body"):
                status = held["start"]["status"]
                body = error_json(status, held["body"].decode(errors="replace").strip())
                headers = [(k, v) for k, v in held["start"].get("headers", [])
                           if k.lower() not in (b"content-type", b"content-length")]
                headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({**held["start"], "headers": headers})
                await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshape)


def is_plain_error(start: dict) -> bool:
    content_type = dict(start.get("headers", [])).get(b"content-type", b"")
    return (start["status"] == 429 or start["status"] >= 500) and content_type.startswith(b"text/plain")


def error_json(status: int, text: str) -> bytes:
    kind, fix = FIXES.get(status, ("server_error", "retry, or see the Ray Serve logs"))
    error = {"message": f"{text[:300]} (Ray Serve's proxy): {fix}", "type": kind, "param": None, "code": None}
    return json.dumps({"error": error}).encode()
