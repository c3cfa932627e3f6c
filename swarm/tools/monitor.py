"""``swarm monitor``: a small web page (and JSON / Prometheus endpoints) showing a run as it trains.

Run it::

    swarm monitor --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEERID --run tiny --port 8080
    # then open http://127.0.0.1:8080/   (JSON: /api/status, Prometheus: /metrics)

Three parts, each with one owner:

- The **poller** (:class:`_Poller`, one background thread, here) is the only code that touches the
  DHT: every ``poll_interval_s`` it reads each watched run through one
  :class:`~swarm.dht.membership.Membership` (``gather_run_status``) and hands the result to
  :meth:`MonitorState.update`. Why one thread: concurrent DHT calls corrupt hivemind's pipe
  (docs/HIVEMIND.md, "DHT"), and request threads must never wait on the DHT.
- :class:`MonitorState` (``swarm.tools.monitor_state``) keeps what the DHT does not (progress
  history, first sightings) and builds one immutable JSON-ready *snapshot* per poll.
- The **web server** (``swarm.tools.monitor_server``) serves the latest snapshot: the page is
  rendered on the server from it by pure functions (``monitor_page``, ``monitor_chart``,
  ``monitor_metrics``; markup, style and script are files in ``monitor_assets/``), so it is complete
  without JavaScript and testable without a browser.

This module holds the configuration, the poller and :class:`Monitor`, which ties the three
together; it re-exports the parts' public names.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from swarm.dht.keys import check_run_id
from swarm.dht.network import DHTConfig
from swarm.errors import ConfigError, SwarmError
from swarm.tools.monitor_chart import PALETTE, line_chart_svg
from swarm.tools.monitor_metrics import render_prometheus
from swarm.tools.monitor_page import render_fragment, render_page
from swarm.tools.monitor_server import MonitorServer
from swarm.tools.monitor_state import MonitorState, build_run_view

if TYPE_CHECKING:
    import hivemind

    from swarm.dht.membership import Membership

__all__ = [
    "MonitorConfig",
    "MonitorState",
    "Monitor",
    "MonitorServer",
    "build_run_view",
    "render_page",
    "render_fragment",
    "render_prometheus",
    "line_chart_svg",
    "PALETTE",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """Options of ``swarm monitor`` (checked once here; the CLI maps its flags 1:1)."""

    dht: DHTConfig = field(default_factory=lambda: DHTConfig(client_mode=True))
    """How the monitor joins the swarm; a client (``client_mode``) is enough: it only reads."""
    run_id: str | None = None
    """Run to watch; None = every run listed in the swarm's registry (re-read at every poll)."""
    host: str = "127.0.0.1"
    """Address the web server binds to. The default serves this machine only; 0.0.0.0 exposes the
    page (read-only, but it names every peer) to the network."""
    port: int = 8080
    """TCP port of the web server; 0 = any free port (see ``Monitor.url``)."""
    poll_interval_s: float = 2.0
    """Seconds between two DHT reads. Lower is fresher but costs DHT traffic; peer records refresh every 15 s or on a change."""
    refresh_s: float = 3.0
    """Seconds between two refreshes of an open page (its script fetches ``/fragment``)."""
    history: int = 2000
    """Progress samples kept per run (memory is bounded by this: ~100 bytes per sample)."""
    spec_timeout_s: float = 3.0
    """Seconds a poll waits for a run's spec to appear before showing the run without it."""
    prometheus: bool = True
    """Serve Prometheus text metrics at ``/metrics``."""
    secret: bytes | None = field(default=None, repr=False)
    """Join secret of the private run ``run_id``: its peer records are then checked (``swarm.tools.status.
    apply_access``); without it a private run's records are shown unchecked, with a note."""

    def __post_init__(self) -> None:
        if not isinstance(self.dht, DHTConfig):
            raise ConfigError(f"dht={self.dht!r} must be a DHTConfig")
        if self.run_id is not None:
            check_run_id(self.run_id)
        if self.secret is not None and self.run_id is None:
            raise ConfigError("a join secret needs run_id (--run RUN): it belongs to one private run")
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"host={self.host!r} must be an address to bind, e.g. 127.0.0.1 or 0.0.0.0")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port!r} must be a TCP port in 0..65535 (0 = any free port)")
        for name in ("poll_interval_s", "refresh_s", "spec_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or not 0 < value <= 3600
            ):
                raise ConfigError(f"{name}={value!r} must be a number of seconds in (0, 3600]")
        if (
            isinstance(self.history, bool)
            or not isinstance(self.history, int)
            or not 2 <= self.history <= 10**6
        ):
            raise ConfigError(
                f"history={self.history!r} must be an integer in 2..1000000 (progress samples kept per run)"
            )


class _Poller(threading.Thread):
    """The one thread that reads the DHT (see the module docstring)."""

    def __init__(self, registry: Membership, state: MonitorState, cfg: MonitorConfig):
        super().__init__(name="monitor-poller", daemon=True)
        self.registry = registry
        self.state = state
        self.cfg = cfg
        self.stop = threading.Event()
        self._views: dict[str, Membership] = {}
        self.first_poll = threading.Event()

    def poll_once(self) -> None:
        from swarm.tools.status import gather_run_status

        if self.cfg.run_id is not None:
            run_ids = [self.cfg.run_id]
        else:
            run_ids = sorted({e.run_id for e in self.registry.list_runs()})
        results, errors = [], {}
        for run_id in run_ids:
            view = self._views.get(run_id)
            if view is None:
                view = self._views[run_id] = self.registry.for_run(run_id)
            timeout = self.cfg.spec_timeout_s if view.spec is None else 0.5
            try:
                status = gather_run_status(view, spec_timeout_s=timeout, secret=self.cfg.secret)
            except ConfigError as e:  # the run is unknown (yet): say so on the page, keep polling
                errors[run_id] = str(e)
                continue
            results.append((status, view.spec))
        self.state.update(results, errors)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.poll_once()
            except SwarmError as e:  # PeerFailure (DHT did not answer) and friends: show it, keep going
                logger.warning("monitor: DHT read failed: %s", e)
                self.state.error(str(e))
            self.first_poll.set()
            self.stop.wait(self.cfg.poll_interval_s)


class Monitor:
    """DHT client + poller thread + web server. Use as a context manager, or ``start``/``close``."""

    def __init__(self, cfg: MonitorConfig, *, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.state = MonitorState(history=cfg.history, poll_interval_s=cfg.poll_interval_s, clock=clock)
        self.dht: hivemind.DHT | None = None
        self._poller: _Poller | None = None
        self._server: MonitorServer | None = None

    def start(self) -> Monitor:
        """Join the DHT, start polling and serving. Safe to ``close`` after a failure."""
        from swarm.dht.membership import Membership
        from swarm.dht.network import start_dht

        # The server first: a busy port fails before the DHT (which takes a second) is started.
        self._server = MonitorServer(
            self.state,
            host=self.cfg.host,
            port=self.cfg.port,
            refresh_s=self.cfg.refresh_s,
            prometheus=self.cfg.prometheus,
        )
        self.dht = start_dht(self.cfg.dht)
        self._poller = _Poller(Membership(self.dht, None), self.state, self.cfg)
        self._poller.start()
        return self

    @property
    def url(self) -> str:
        if self._server is None:
            raise ConfigError("the monitor is not started; call start() first")
        return self._server.url

    def wait_first_poll(self, timeout_s: float = 30.0) -> bool:
        """Block until the first DHT read finished (or failed); False on timeout."""
        return self._poller is not None and self._poller.first_poll.wait(timeout_s)

    def close(self) -> None:
        """Stop the poller, the web server and the DHT client (idempotent)."""
        if self._poller is not None:
            self._poller.stop.set()
            self._poller.join(timeout=self.cfg.spec_timeout_s + 30.0)
            self._poller = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None

    def __enter__(self) -> Monitor:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
