"""The Fleet gateway: the one address SuperNodes dial, serving the Fleet API and nothing else.

Flower 1.42's SuperLink serves its Fleet API (SuperNodes), Control API (``flwr run``, ``flwr
ls``, ``flwr supernode register``) and Runtime API (the SuperExec that runs the ServerApp) on
ONE HTTP(S) ``--host``/``--port`` (``flwr/superlink/main.py`` mounts the three routers on one
FastAPI app; ``--fleet-api-address`` and ``--control-api-address`` are deprecated no-ops). The
open-source SuperLink authenticates none of the Control API (its only account-auth plugin,
OIDC, ships with the enterprise ``flwr.ee``) and, in ``subprocess`` isolation, none of the
Runtime API. Whoever reaches the port SuperNodes dial could therefore list and register nodes,
submit an app that every node runs, or act as the ServerApp.

So the SuperLink binds 127.0.0.1 (or an operator-only network) and this gateway faces the
nodes: it terminates TLS with the server certificate and forwards to the SuperLink (over TLS,
checked against the CA) exactly the routes of Flower's own Fleet router
(``flwr.superlink.routers.fleet.router``: ``POST /v1/fleet/register-node``, ``activate-node``,
``pull-messages``, ...) plus ``GET``/``HEAD /health``. Every other request is answered ``404``
here and never reaches the SuperLink. Requests are forwarded unchanged (headers, body streamed
both ways), so SuperNode authentication (the signed ``flwr-public-key`` / ``flwr-signature`` /
``flwr-timestamp`` headers) is checked by the SuperLink itself.

    python -m fedcybgd.deploy.gateway --host 0.0.0.0 --port 8000 \\
        --upstream superlink-internal:8000 --ssl-ca-certfile /certs/ca.crt \\
        --ssl-certfile /certs/server.pem --ssl-keyfile /certs/server.key
"""

from __future__ import annotations

import argparse
import json
import logging
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from functools import lru_cache
from typing import Any

import httpx

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

FLEET_PREFIX = "/v1/fleet/"
HEALTH_PATH = "/health"
# Hop-by-hop headers (RFC 9110 7.6.1) and Host are the connection's, not the request's.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade", "host",
})
UPSTREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=300.0, pool=30.0)

log = logging.getLogger("fedcybgd.gateway")


@lru_cache(maxsize=1)
def fleet_routes() -> frozenset[tuple[str, str]]:
    """``(method, path)`` of every route of Flower's Fleet router, the routes nodes call.

    Read from the installed Flower, so the gateway forwards what this Flower's SuperNodes use.
    """
    from fastapi.routing import APIRoute
    from flwr.superlink.routers.fleet.router import router

    routes = frozenset(
        (method, route.path)
        for route in router.routes if isinstance(route, APIRoute)
        for method in (route.methods or ())
    )
    if not routes or any(not path.startswith(FLEET_PREFIX) for _, path in routes):
        raise RuntimeError(f"unexpected Fleet routes in the installed Flower: {sorted(routes)}")
    return routes


def allowed(method: str, path: str) -> bool:
    """True for the requests the gateway forwards: Fleet routes and the health check."""
    if path == HEALTH_PATH:
        return method in ("GET", "HEAD")
    return (method, path) in fleet_routes()


def client_tls(ca_file: str) -> ssl.SSLContext:
    """A TLS client context that trusts only ``ca_file`` and checks the host name."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class FleetGateway:
    """ASGI app forwarding the Fleet API to ``upstream`` (``https://host:port``) and nothing else.

    ``verify``: what httpx checks the upstream's certificate with (an SSL context from the CA).
    """

    def __init__(self, upstream: str, verify: ssl.SSLContext | bool) -> None:
        self.upstream = upstream.rstrip("/")
        self.verify = verify
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        # anything else (a websocket) is not an HTTP request: no answer, the server closes it

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(verify=self.verify, timeout=UPSTREAM_TIMEOUT,
                                                follow_redirects=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if not allowed(method, path):
            client = scope.get("client") or ("?", 0)
            log.warning("refused %s %s from %s:%s: not a Fleet API route", method, path[:200],
                        client[0], client[1])
            await _reply(send, 404, f"{method} {path[:200]} is not served at the Fleet address:"
                                    " only the Fleet API (/v1/fleet/) and /health are")
            return
        assert self.client is not None, "the lifespan did not start"
        headers = [(k, v) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        content = _body(receive) if method == "POST" else None
        request = self.client.build_request(method, f"{self.upstream}{path}", headers=headers,
                                            content=content)
        try:
            response = await self.client.send(request, stream=True)
        except (httpx.HTTPError, ConnectionError) as err:
            log.error("upstream %s unreachable for %s %s: %r", self.upstream, method, path, err)
            await _reply(send, 502, f"the SuperLink behind this gateway did not answer: "
                                    f"{type(err).__name__}")
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw
                                    if k.decode("latin-1").lower() not in _HOP_BY_HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    """The request body as it arrives (never buffered whole)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("the client disconnected mid-request")
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def serve(*, host: str, port: int, upstream: str, ca: str, cert: str, key: str) -> None:
    """Serve the gateway over HTTPS on ``host:port`` until stopped (SIGTERM / SIGINT)."""
    import uvicorn

    fleet_routes()  # fail at start, not at the first node, if Flower's router moved
    app = FleetGateway(f"https://{upstream}", client_tls(ca))
    uvicorn.run(app, host=host, port=port, ssl_certfile=cert, ssl_keyfile=key,
                ssl_version=ssl.PROTOCOL_TLS_SERVER, ws="none", lifespan="on",
                proxy_headers=False, server_header=False, access_log=False,
                log_level="info")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and serve."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", required=True, help="address the SuperNodes dial")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True,
                        help="the SuperLink's host:port (its --host/--port; TLS)")
    parser.add_argument("--ssl-ca-certfile", required=True,
                        help="CA that signed the SuperLink's certificate")
    parser.add_argument("--ssl-certfile", required=True, help="this gateway's certificate")
    parser.add_argument("--ssl-keyfile", required=True, help="its private key")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per forwarded call
    serve(host=args.host, port=args.port, upstream=args.upstream, ca=args.ssl_ca_certfile,
          cert=args.ssl_certfile, key=args.ssl_keyfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
