"""An HTTP proxy in front of an S3 API server that adds a latency and counts the requests in flight.

`LatencyProxy(upstream, latency)` listens on localhost; each request it gets waits `latency` seconds, then goes
to `upstream` (moto's server, say) on a connection of its own, and the answer comes back whole. It counts the
range reads (GETs with a `Range` header) that are in flight at once, the most it saw (`most_in_flight`) and in
all (`ranges`): what a server sees of a client's concurrency, which a test of "all at once" needs, since a local
server answers too fast for sequential requests to overlap by chance or concurrent ones to be told apart by
time. It also counts every request by kind (`requests`: "GET", "GET range", "PUT", "POST", ...). Point s3fs at
`proxy.endpoint` (AWS_ENDPOINT_URL) for the requests to be counted. A request body is passed on as read (no chunked
uploads)."""

from __future__ import annotations

import collections
import http.client
import http.server
import threading
import time
import urllib.parse
from typing import Any

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "server", "date"}


class LatencyProxy:
    def __init__(self, upstream: str, latency: float) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.latency = latency
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0
        self.requests: collections.Counter[str] = collections.Counter()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "LatencyProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        with self.lock:
            self.most_in_flight = 0
            self.requests.clear()

    @property
    def ranges(self) -> int:
        """The range reads in all."""
        return self.requests["GET range"]

    def forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, list, bytes]:
        """Wait the latency, then send the request upstream; (status, reason, headers, body) of its answer."""
        ranged = method == "GET" and any(k.lower() == "range" for k in headers)
        with self.lock:
            self.requests["GET range" if ranged else method] += 1
            if ranged:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.latency)
            conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
            try:
                conn.request(method, path, body=body or None, headers=headers)
                answer = conn.getresponse()
                return answer.status, answer.reason, answer.getheaders(), answer.read()
            finally:
                conn.close()
        finally:
            if ranged:
                with self.lock:
                    self.in_flight -= 1


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a client opens a connection per request in flight: none may wait for a SYN retry


def _handler(proxy: LatencyProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the S3 client expects

        def log_message(self, *args: Any) -> None:
            pass

        def relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, reason, headers, data = proxy.forward(self.command, self.path, dict(self.headers), body)
            self.send_response(status, reason)
            for key, value in headers:
                if key.lower() not in _HOP_HEADERS:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

    return Handler
