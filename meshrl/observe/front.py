"""meshrl's own front for Monarch's dashboard: one address, one token.

Monarch 0.7 serves its dashboard on every interface (`::`) with no
authentication and no way to choose the bind address; the same Flask app also
answers on a loopback port of its own (the telemetry URL). So meshrl asks
Monarch for no public dashboard and puts this front on `run.dashboard_host`
(127.0.0.1 unless asked): every request must carry the run's token (the
`?token=` of the printed URL, which sets a cookie for the browser's later
calls, or `Authorization: Bearer`), and is then passed to Monarch's loopback
server. A bounded pool of threads answers, each connection with a read
timeout, so an idle or slow client holds no thread for long.
"""

from __future__ import annotations

import hmac
import http.client
import secrets
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

COOKIE = "meshrl_dashboard"
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-authorization"}


class BoundedServer(HTTPServer):
    """An HTTP server that answers on at most `workers` threads; each connection
    gets `timeout_s` to send its request (slow clients are cut, not waited on)."""

    daemon_threads = True

    def __init__(self, address, handler, workers: int = 16, timeout_s: float = 10.0):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="http")
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        request.settimeout(self.timeout_s)
        self.pool.submit(self._answer, request, client_address)

    def _answer(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a client that went away: nothing to report
            pass
        finally:
            self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        pass  # a reset connection is the client's business, not a traceback

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class DashboardFront:
    """Serve `upstream` (Monarch's loopback dashboard) on `host`:`port` behind a
    token. `url` is what to open (token included); `close()` stops it."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0):
        self.upstream = urlsplit(upstream)
        self.token = secrets.token_urlsafe(24)
        self.httpd = BoundedServer((host, port), _handler(self))
        self.host, self.port = host, self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="dashboard").start()

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}/?token={self.token}"

    def allowed(self, headers: Any, query_token: str | None) -> bool:
        offered = [query_token or ""]
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            offered.append(auth[len("Bearer ") :])
        cookie = SimpleCookie(headers.get("Cookie", ""))
        if COOKIE in cookie:
            offered.append(cookie[COOKIE].value)
        return any(hmac.compare_digest(o, self.token) for o in offered if o)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(front: DashboardFront) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive

        def log_message(self, *args: Any) -> None:
            pass

        def _refuse(self, status: int, text: str) -> None:
            body = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _forward(self) -> None:
            parts = urlsplit(self.path)
            query = parse_qsl(parts.query, keep_blank_values=True)
            token = next((v for k, v in query if k == "token"), None)
            if not front.allowed(self.headers, token):
                self._refuse(401, "this dashboard needs the token printed when the run started\n")
                return
            if (
                token is not None
            ):  # the printed URL: keep the token in a cookie, drop it from the URL
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                self.send_response(303)
                self.send_header("Location", parts.path + (f"?{rest}" if rest else ""))
                self.send_header(
                    "Set-Cookie", f"{COOKIE}={front.token}; HttpOnly; SameSite=Strict; Path=/"
                )
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > 1 << 20:
                self._refuse(413, "request body over 1 MB\n")
                return
            body = self.rfile.read(length) if length else None
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in HOP | {"host", "cookie", "authorization", "content-length"}
            }
            upstream = http.client.HTTPConnection(
                front.upstream.hostname, front.upstream.port, timeout=60
            )
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
            except OSError as error:
                self._refuse(502, f"Monarch's dashboard did not answer: {error}\n")
                return
            finally:
                upstream.close()
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in HOP | {"content-length", "server", "date"}:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

    return Handler
