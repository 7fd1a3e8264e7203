"""A squatter that takes a starting server's port (the engine tests' ``squatter`` fixture)."""

from __future__ import annotations

import http.server
import socket
import threading


class Squatter:
    """Binds ports as another process would: an HTTP server answering /health 200 (the worst case: a server that
    looks ready) in a thread of the test process, which is not the server's process group."""

    def __init__(self) -> None:
        self.servers: list[http.server.HTTPServer] = []
        self.raw: list[socket.socket] = []

    def take(self, port: int) -> None:
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"not yours")

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.HTTPServer(("127.0.0.1", port), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers.append(server)

    def take_raw(self, port: int) -> None:
        """Take ``port`` with a server that is no HTTP server: it answers every connection with bytes that are no
        HTTP status line (as a gloo or TCPStore socket would not answer HTTP either)."""
        sock = socket.create_server(("127.0.0.1", port))

        def serve() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return  # closed
                with conn:
                    conn.sendall(b"\x00\x01 not http\r\n\r\n")

        threading.Thread(target=serve, daemon=True).start()
        self.raw.append(sock)

    @property
    def ports(self) -> list[int]:
        return [s.server_address[1] for s in self.servers] + [s.getsockname()[1] for s in self.raw]

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()
        for r in self.raw:
            r.close()
