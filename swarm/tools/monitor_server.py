"""The monitor's web server: the standard library's ``ThreadingHTTPServer`` serving a ``MonitorState``.

``/`` (the page), ``/fragment`` (the page's content, fetched by its own script every ``refresh_s``),
``/api/status`` (the snapshot as JSON), ``/metrics`` (Prometheus text, when ``prometheus`` is on)
and ``/healthz``. Request threads only read the latest snapshot; they never wait on the DHT.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from swarm.errors import ConfigError
from swarm.tools.monitor_metrics import render_prometheus
from swarm.tools.monitor_page import render_fragment, render_page
from swarm.tools.monitor_state import MonitorState

__all__ = ["MonitorServer"]

logger = logging.getLogger(__name__)


def _make_handler(state: MonitorState, *, refresh_s: float, prometheus: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "swarm-monitor"

        def do_GET(self) -> None:  # noqa: N802 (the name http.server dispatches to)
            path = self.path.split("?", 1)[0]
            snap = state.snapshot()
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", render_page(snap, refresh_s=refresh_s))
            elif path == "/fragment":
                self._send(200, "text/html; charset=utf-8", render_fragment(snap))
            elif path == "/api/status":
                self._send(200, "application/json", json.dumps(snap, allow_nan=False, default=_json_default))
            elif path == "/metrics" and prometheus:
                self._send(200, "text/plain; version=0.0.4; charset=utf-8", render_prometheus(snap))
            elif path == "/healthz":
                self._send(200, "text/plain; charset=utf-8", "ok\n")
            else:
                self._send(404, "text/plain; charset=utf-8", f"no page at {path}; try / or /api/status\n")

        def _send(self, code: int, content_type: str, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler


def _json_default(value: object) -> object:
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class MonitorServer:
    """The HTTP side alone: serves ``state`` on (host, port) from a background thread. Close it in ``finally``."""

    def __init__(self, state: MonitorState, *, host: str, port: int, refresh_s: float, prometheus: bool):
        handler = _make_handler(state, refresh_s=refresh_s, prometheus=prometheus)
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise ConfigError(
                f"cannot serve the monitor on {host}:{port}: {e.strerror or e}; pick another --port "
                "(or --port 0 for any free one) or check --host"
            ) from None
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="monitor-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else host
        return f"http://{shown}:{port}/"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
