"""A real local webhook receiver: an HTTP server in a thread that records every request,
answers with a chosen status (or a redirect), and can go down and come back on its port."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from testkit.wait import wait_until


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the default 5 resets a sender's parallel connects


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    path: str

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]

    def json(self) -> Any:
        import json

        return json.loads(self.body)


@dataclass
class Receiver:
    port: int = 0
    status: int = 200
    location: str | None = None  # sent with a 3xx status
    received: list[Received] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver._lock:
                    receiver.received.append(Received(
                        {k.lower(): v for k, v in self.headers.items()}, body, self.path))
                self.send_response(receiver.status)
                if receiver.location:
                    self.send_header("location", receiver.location)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = _Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Down: the port refuses connections until start() again."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def ids(self) -> list[str]:
        with self._lock:
            return [r.id for r in self.received]

    def wait_for(self, done: Callable[[Receiver], bool], timeout: float = 10.0) -> None:
        try:
            wait_until(lambda: done(self), timeout, "the receiver's condition", every=0.02)
        except AssertionError as e:
            raise AssertionError(f"{e}; got {[r.json().get('type') for r in self.received]}") \
                from None
