"""A real HTTP server on 127.0.0.1 whose answers a test scripts: status, body, delay, truncation."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; version=0.0.4; charset=utf-8"
    delay_seconds: float = 0.0
    truncate_to: int | None = None  # send Content-Length of the full body, then only this much
    hits: int = 0
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        """End every delay now (a hanging receiver answers at once)."""
        self.released.set()


@dataclass
class Script:
    routes: dict[str, Route] = field(default_factory=dict)

    def set(self, path: str, **kw: object) -> Route:
        r = Route(**kw)  # type: ignore[arg-type]
        self.routes[path] = r
        return r


class _Handler(BaseHTTPRequestHandler):
    script: Script

    def _serve(self) -> None:
        route = self.script.routes.get(self.path.split("?")[0])
        if route is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        route.hits += 1
        if route.delay_seconds:
            route.released.wait(route.delay_seconds)
        self.send_response(route.status)
        self.send_header("Content-Type", route.content_type)
        self.send_header("Content-Length", str(len(route.body)))
        self.end_headers()
        body = route.body if route.truncate_to is None else route.body[: route.truncate_to]
        try:
            self.wfile.write(body)
            if route.truncate_to is not None:
                self.wfile.flush()
                self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = _serve
    do_POST = _serve

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serve(script: Script) -> Iterator[str]:
    handler = type("H", (_Handler,), {"script": script})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=5)
