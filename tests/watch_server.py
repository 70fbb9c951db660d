"""A decode replica's session and viewers' routes without Ray: the replica's own DecodeService,
session conversation (serving/wire/session_socket.py) and WatchRoutes (serving/wire/watch_routes.py)
served by uvicorn on loopback in a thread, as the Serve deployment routes them
(serving/deployment.py). Unit tests drive it with real WebSocket, HTTP and WebRTC clients."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route, WebSocketRoute

from tests.ports import free_port
from vae_service.config import ServiceConfig
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.scheduling.admission import Admission
from vae_service.serving.wire.session_socket import serve_session
from vae_service.serving.wire.watch_routes import WatchRoutes, watch_page


@dataclass
class WatchServer:
    url: str
    service: DecodeService
    routes: WatchRoutes
    loop: asyncio.AbstractEventLoop

    def call(self, work, timeout_s: float = 30):
        """Run a coroutine on the server's loop (where the service's state lives)."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)


def app_of(service: DecodeService, admission: Admission, routes: WatchRoutes) -> Starlette:
    async def sessions(ws):
        await serve_session(service, admission, ws)

    async def page(request):
        return watch_page()

    async def stream(ws):
        await routes.stream(ws, ws.path_params["watch_id"])

    async def whep(request):
        if request.method == "OPTIONS":
            return routes.preflight(request)
        return await routes.whep_offer(request, request.path_params["watch_id"])

    async def whep_resource(request):
        if request.method == "OPTIONS":
            return routes.preflight(request)
        params = request.path_params
        return await routes.whep_delete(request, params["watch_id"], params["resource"])

    return Starlette(
        routes=[
            WebSocketRoute("/sessions", sessions),
            Route("/watch/{watch_id}", page),
            WebSocketRoute("/watch/{watch_id}/stream", stream),
            Route("/watch/{watch_id}/whep", whep, methods=["POST", "OPTIONS"]),
            Route("/watch/{watch_id}/whep/{resource}", whep_resource, methods=["DELETE", "OPTIONS"]),
        ]
    )


@contextlib.contextmanager
def watch_server(config: ServiceConfig) -> Iterator[WatchServer]:
    service, admission = DecodeService(config), Admission.from_config(config)
    routes = WatchRoutes(service, admission)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app_of(service, admission, routes), "127.0.0.1", port, log_level="warning"))
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        await server.serve()
        pending = asyncio.all_tasks() - {asyncio.current_task()}  # the service's own (scheduler, sweeper)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the watch test server did not start")
        time.sleep(0.02)
    try:
        yield WatchServer(f"http://127.0.0.1:{port}", service, routes, loop)
    finally:
        asyncio.run_coroutine_threadsafe(routes.close_all(), loop).result(30)
        server.should_exit = True
        thread.join(30)
