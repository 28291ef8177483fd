"""A stand-in for a server's HTTP face in tests: a threaded HTTP server on a free loopback port whose POSTs go
to a callback with the path and the body; ``url(kind)`` answers as a worker's does."""

from __future__ import annotations

import http.server
import threading
from typing import Callable


class StandInHTTP:
    """Serves ``on_post(path, body)`` for every POST (it answers 200), until :meth:`close`."""

    def __init__(self, on_post: Callable[[str, bytes], None]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                on_post(self.path, self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
