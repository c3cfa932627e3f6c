"""``swarm monitor``: a small web page (and JSON / Prometheus endpoints) showing a run as it trains.

Run it::

    swarm monitor --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEERID --run tiny --port 8080
    # then open http://127.0.0.1:8080/   (JSON: /api/status, Prometheus: /metrics)

Three parts, each with one owner:

- The **poller** (:class:`_Poller`, one background thread) is the only code that touches the DHT:
  every ``poll_interval_s`` it reads each watched run through one :class:`~swarm.dht.membership.Membership`
  (``gather_run_status``) and hands the result to :meth:`MonitorState.update`. Why one thread:
  concurrent DHT calls corrupt hivemind's pipe (docs/HIVEMIND.md, "DHT"), and request threads must
  never wait on the DHT.
- :class:`MonitorState` keeps what the DHT does not: a bounded history of progress samples per run
  (the loss and tokens/s curves; ``history`` samples at most, oldest dropped) and when this monitor
  first saw each peer on its stage ("seen for": PeerRecords carry no start time, so a peer that was
  online before the monitor started shows the monitor's uptime). Every update builds one immutable
  JSON-ready *snapshot*; request threads only read the latest one under a lock.
- The **web server** is the standard library's ``ThreadingHTTPServer``: ``/`` (the page),
  ``/fragment`` (the page's content, fetched by its own script every ``refresh_s`` to refresh
  itself without reloading), ``/api/status`` (the snapshot as JSON), ``/metrics`` (Prometheus text,
  when ``prometheus`` is on) and ``/healthz``. The page is rendered on the server from the snapshot
  (pure functions below), so it is complete without JavaScript and testable without a browser.

Bytes per token: the page shows the fp32 reference ``2 * (stages - 1) * d_model * 4`` (see
swarm/train/metrics.py, note "link bytes"), the nominal figure of the run's codecs (the reference divided
by each codec's ``nominal_ratio``), and the measured value when trainers publish one
(``bytes_per_token`` in their progress entries; averaged over trainers that report it).
"""

from __future__ import annotations

import collections
import html
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from swarm.dht.network import DHTConfig
from swarm.dht.records import check_run_id
from swarm.errors import ConfigError, SwarmError
from swarm.tools.status import RunStatus, human

if TYPE_CHECKING:
    import hivemind

    from swarm.dht.membership import Membership
    from swarm.run.spec import RunSpec

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
    """Seconds between two DHT reads. Lower is fresher but costs DHT traffic; records refresh every 5 s."""
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


# ------------------------------------------------------------------------------------ snapshot


def _bytes_per_token(spec: RunSpec | None, progress: Mapping[str, Any]) -> dict[str, float | None]:
    """fp32 reference, nominal (codec ratios) and measured bytes per token on all stage links."""
    out: dict[str, float | None] = {"uncompressed": None, "nominal": None, "measured": None}
    if spec is not None:
        links = spec.num_stages - 1
        per_direction = links * spec.model.d_model * 4.0  # one fp32 vector per token per link
        out["uncompressed"] = 2.0 * per_direction
        try:
            from compression import get_codec

            ratios = [get_codec(c).nominal_ratio for c in (spec.codecs.activations, spec.codecs.gradients)]
            out["nominal"] = per_direction / ratios[0] + per_direction / ratios[1]
        except ValueError:  # CodecError: a codec this software does not know; show the reference only
            pass
    measured = [
        float(t["bytes_per_token"])
        for t in progress.get("trainers", {}).values()
        if isinstance(t.get("bytes_per_token"), int | float) and math.isfinite(t["bytes_per_token"])
    ]
    if measured:
        out["measured"] = math.fsum(measured) / len(measured)
    return out


def build_run_view(
    status: RunStatus,
    spec: RunSpec | None,
    *,
    history: Sequence[Mapping[str, Any]],
    first_seen: Mapping[tuple[int, str], float],
    now: float,
) -> dict[str, Any]:
    """One run's part of the snapshot: ``RunStatus.to_json()`` plus model, bytes, history, seen-for.

    Pure: ``first_seen`` maps (stage, peer id) to the wall time the monitor first saw the peer there.
    """
    view = status.to_json()
    for stage in view["stages"]:
        for peer in stage["peers"]:
            since = first_seen.get((stage["stage"], peer["peer_id"]))
            peer["seen_for_s"] = None if since is None else max(0.0, now - since)
        stage["active_peers"] = sum(1 for p in stage["peers"] if p["state"] in ("joining", "online"))
    covered = [s["throughput"] for s in view["stages"] if s["covered"]]
    view["bottleneck_tokens_per_s"] = min(covered) if len(covered) == len(view["stages"]) and covered else 0.0
    if spec is not None:
        view["model"] = {
            "n_params": spec.n_params(),
            "d_model": spec.model.d_model,
            "n_layers": spec.model.n_layers,
            "n_heads": spec.model.n_heads,
            "vocab_size": spec.model.vocab_size,
            "seq_len": spec.model.seq_len,
        }
        view["codecs"] = {"activations": spec.codecs.activations, "gradients": spec.codecs.gradients}
    else:
        view["model"], view["codecs"] = None, None
    view["bytes_per_token"] = _bytes_per_token(spec, view["progress"])
    view["history"] = [dict(s) for s in history]
    return view


class MonitorState:
    """What the monitor knows between polls: the latest snapshot, progress histories, first sightings.

    Written only by the poller (``update``/``error``), read by any request thread (``snapshot``).
    """

    def __init__(
        self, *, history: int = 2000, poll_interval_s: float = 2.0, clock: Callable[[], float] = time.time
    ):
        self._clock = clock
        self._lock = threading.Lock()
        self._history_len = history
        self._histories: dict[str, collections.deque[dict[str, Any]]] = {}
        self._first_seen: dict[str, dict[tuple[int, str], float]] = {}
        self.started_at = clock()
        self._poll = {
            "poll_interval_s": poll_interval_s,
            "polls": 0,
            "errors": 0,
            "last_poll_at": None,
            "last_error": None,
            "started_at": self.started_at,
        }
        self._snapshot: dict[str, Any] = self._make_snapshot([], {}, self.started_at)

    def _make_snapshot(
        self, runs: list[dict[str, Any]], run_errors: dict[str, str], now: float
    ) -> dict[str, Any]:
        return {
            "generated_at": now,
            "monitor": dict(self._poll),
            "runs": runs,
            "run_errors": dict(run_errors),
        }

    def update(
        self, results: Iterable[tuple[RunStatus, RunSpec | None]], run_errors: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Record one poll's statuses (and per-run errors); return the new snapshot."""
        now = self._clock()
        runs = []
        seen_runs = set()
        for status, spec in results:
            run_id = status.run_id
            seen_runs.add(run_id)
            history = self._histories.setdefault(run_id, collections.deque(maxlen=self._history_len))
            p = status.progress
            sample = {
                "t": now,
                "tokens": int(p.get("tokens", 0)),
                "steps": int(p.get("steps", 0)),
                "loss": p.get("loss"),
                "tokens_per_s": float(p.get("tokens_per_s", 0.0)),
                "trainers": len(p.get("trainers", {})),
                "losses": {tid: t.get("loss") for tid, t in p.get("trainers", {}).items()},
            }
            # A stalled or idle run adds no point: the curve shows progress, not the poll rate.
            last = history[-1] if history else None
            if last is None or any(last[k] != sample[k] for k in ("tokens", "steps", "loss", "losses")):
                history.append(sample)
            # First sightings: peers that disappeared are forgotten, so a returning peer starts anew.
            old = self._first_seen.get(run_id, {})
            current = {
                (s.stage, p.peer_id): old.get((s.stage, p.peer_id), now)
                for s in status.stages
                for p in s.peers
            }
            self._first_seen[run_id] = current
            runs.append(build_run_view(status, spec, history=list(history), first_seen=current, now=now))
        for gone in set(self._first_seen) - seen_runs:
            self._first_seen.pop(gone)  # a run that left the registry; its history stays (bounded)
        with self._lock:
            self._poll["polls"] += 1
            self._poll["last_poll_at"] = now
            self._snapshot = self._make_snapshot(runs, dict(run_errors or {}), now)
            return self._snapshot

    def error(self, message: str) -> None:
        """Record a failed poll (the DHT did not answer, ...); the last good data stays on the page."""
        with self._lock:
            self._poll["errors"] += 1
            self._poll["last_error"] = {"at": self._clock(), "message": message}
            self._snapshot = {**self._snapshot, "monitor": dict(self._poll)}

    def snapshot(self) -> dict[str, Any]:
        """The latest snapshot (treat as read-only: it is shared between request threads)."""
        with self._lock:
            return self._snapshot


# ------------------------------------------------------------------------------------ rendering


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _num(value: float | None, fmt: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:8]}…{peer_id[-6:]}"


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [lo, hi] (1, 2, 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9 and len(ticks) < 3 * count:
        ticks.append(round(t, 12))
        t += step
    return ticks


PALETTE = ("#dc2626", "#2563eb", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777")
MAX_SERIES = len(PALETTE)


def line_chart_svg(
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    title: str,
    x_label: str,
    x_range: tuple[float, float] | None = None,
    palette: Sequence[str] = PALETTE,
    width: int = 520,
    height: int = 220,
) -> str:
    """An inline SVG chart of named lines ``[(label, [(x, y), ...]), ...]`` (x ascending), round ticks,
    a legend when there are several lines; pure and dependency-free. Non-finite points are left out.
    """
    pad_l, pad_r, pad_t, pad_b = 56, 16, 28, 36
    head = (
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{_esc(title)}" xmlns="http://www.w3.org/2000/svg">'
        f'<text x="{pad_l}" y="18" class="chart-title">{_esc(title)}</text>'
    )
    lines = [
        (label, [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)])
        for label, pts in list(series)[:MAX_SERIES]
    ]
    lines = [(label, pts) for label, pts in lines if pts]
    every = [p for _, pts in lines for p in pts]
    if len(every) < 2:
        msg = "waiting for data: trainers publish progress every few seconds"
        return (
            head
            + f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" class="chart-empty">{msg}</text></svg>'
        )
    xs, ys = [p[0] for p in every], [p[1] for p in every]
    x0, x1 = x_range if x_range is not None else (min(xs), max(xs))
    y0, y1 = min(ys), max(ys)
    if x1 <= x0:
        x1 = x0 + 1.0
    if y1 == y0:
        y0, y1 = y0 - max(abs(y0) * 0.05, 1e-3), y1 + max(abs(y1) * 0.05, 1e-3)
    margin = (y1 - y0) * 0.06
    y0, y1 = y0 - margin, y1 + margin
    plot_w, plot_h = width - pad_l - pad_r, height - pad_t - pad_b

    def sx(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return pad_t + (1.0 - (y - y0) / (y1 - y0)) * plot_h

    parts = [head]
    for t in _nice_ticks(y0, y1, 5):
        if y0 <= t <= y1:
            parts.append(
                f'<line x1="{pad_l}" x2="{width - pad_r}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                f'<text x="{pad_l - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" class="tick">{_esc(human(t))}</text>'
            )
    for t in _nice_ticks(x0, x1, 6):
        if x0 <= t <= x1:
            parts.append(
                f'<text x="{sx(t):.1f}" y="{height - pad_b + 16}" text-anchor="middle" class="tick">'
                f"{_esc(human(t))}</text>"
            )
    parts.append(
        f'<text x="{pad_l + plot_w / 2}" y="{height - 4}" text-anchor="middle" class="axis">{_esc(x_label)}</text>'
        f'<rect x="{pad_l}" y="{pad_t}" width="{plot_w}" height="{plot_h}" class="frame"/>'
    )
    for i, (label, pts) in enumerate(lines):
        color = palette[i % len(palette)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(
            f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2" '
            f'stroke-linejoin="round" data-series="{_esc(label)}"/>'
        )
        lx, ly = pts[-1]
        parts.append(f'<circle cx="{sx(lx):.1f}" cy="{sy(ly):.1f}" r="3.5" fill="{color}"/>')
        if len(lines) > 1:  # legend, top right, one row per line
            y = pad_t + 14 + 14 * i
            parts.append(
                f'<rect x="{width - pad_r - 118}" y="{y - 8}" width="10" height="3" fill="{color}"/>'
                f'<text x="{width - pad_r - 104}" y="{y - 3}" class="legend">{_esc(label[:18])}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _card(label: str, value: str, note: str = "") -> str:
    note_html = f'<div class="note">{_esc(note)}</div>' if note else ""
    return f'<div class="card"><div class="label">{_esc(label)}</div><div class="value">{value}</div>{note_html}</div>'


def _render_run(run: Mapping[str, Any]) -> str:
    run_id = run["run_id"]
    uncovered = run["uncovered_stages"]
    p = run["progress"]
    model = run.get("model")
    bpt = run["bytes_per_token"]
    stages_total = run["num_stages"]
    badge = (
        f'<span class="badge bad">{len(uncovered)} of {stages_total} stages uncovered</span>'
        if uncovered
        else f'<span class="badge good">all {stages_total} stages covered</span>'
    )
    meta = f"spec {_esc(run['spec_hash'] or '?')}"
    if model:
        meta += (
            f" · {human(model['n_params'])} params · d_model {model['d_model']} · {model['n_layers']} layers"
            f" · {model['n_heads']} heads · seq {model['seq_len']}"
        )
    if run.get("codecs"):
        meta += f" · codecs {_esc(run['codecs']['activations'])} / {_esc(run['codecs']['gradients'])}"
    out = [f'<section class="run" id="run-{_esc(run_id)}">']
    out.append(f'<h2>run <span class="mono">{_esc(run_id)}</span> {badge}</h2><div class="meta">{meta}</div>')

    # ---- headline numbers
    measured = bpt.get("measured")
    if measured is not None:
        bpt_value, bpt_note = (
            human(measured),
            f"nominal {human(bpt['nominal'] or 0)} · fp32 {human(bpt['uncompressed'] or 0)}",
        )
    elif bpt.get("nominal") is not None:
        bpt_value = human(bpt["nominal"])
        bpt_note = f"nominal for the codecs · fp32 {human(bpt['uncompressed'] or 0)}"
    else:
        bpt_value, bpt_note = "-", "spec not available"
    cards = [
        _card(
            "tokens/s (trainers)",
            human(float(p.get("tokens_per_s", 0.0))),
            _plural(len(p.get("trainers", {})), "trainer"),
        ),
        _card(
            "swarm capacity",
            f"{human(run['bottleneck_tokens_per_s'])} tok/s",
            "a stage has no active peer" if uncovered else "the slowest stage's peers together",
        ),
        _card("loss", _num(p.get("loss"), ".4f"), "mean of the trainers' last losses"),
        _card("tokens", human(int(p.get("tokens", 0))), f"{p.get('steps', 0)} steps"),
        _card("bytes / token", bpt_value, bpt_note),
        _card("peers", str(run["peers"]), f"{run['rejected_records']} invalid records ignored"),
    ]
    out.append('<div class="cards">' + "".join(cards) + "</div>")

    # ---- stages
    out.append(
        '<table class="stages"><thead><tr><th>stage</th><th>layers</th><th>peer</th><th>state</th>'
        '<th class="r">tokens/s</th><th class="r">queue</th><th class="r">version</th>'
        '<th class="r">seen for</th><th>software</th></tr></thead>'
    )
    for s in run["stages"]:
        if not s["layers"]:
            layers = "?"
        else:
            first, last = s["layers"][0], s["layers"][1] - 1
            layers = str(first) if first == last else f"{first}–{last}"
        cls = "stage" if s["covered"] else "stage uncovered"
        peers = s["peers"]
        rows = max(1, len(peers)) + 1
        stage_cell = f'<td rowspan="{rows}" class="stage-id"><b>{s["stage"]}</b></td><td rowspan="{rows}">{layers}</td>'
        out.append(f'<tbody class="{cls}" data-stage="{s["stage"]}">')
        if not peers:
            out.append(
                f'<tr>{stage_cell}<td colspan="7" class="warn">UNCOVERED: no peers serve this stage; '
                f"start one with <code>swarm peer --run {_esc(run_id)} ...</code></td></tr>"
            )
        for i, peer in enumerate(peers):
            state = peer["state"]
            out.append(
                "<tr>"
                + (stage_cell if i == 0 else "")
                + f'<td class="mono" title="{_esc(peer["peer_id"])}" data-peer="{_esc(peer["peer_id"])}">'
                f"{_esc(_short(peer['peer_id']))}</td>"
                f'<td><span class="state {_esc(state)}">{_esc(state)}</span></td>'
                f'<td class="r">{_num(peer["throughput"], ".1f")}</td><td class="r">{peer["queue"]}</td>'
                f'<td class="r">{peer["version"]}</td><td class="r">{_duration(peer.get("seen_for_s"))}</td>'
                f'<td class="mono dim">{_esc(peer["software"])}</td></tr>'
            )
        total = f"{_num(s['throughput'], '.1f')}"
        note = "" if s["covered"] else ' <span class="warn">UNCOVERED: no active peers</span>'
        out.append(
            f'<tr class="total"><td colspan="2">{s["active_peers"]} active{note}</td>'
            f'<td class="r">{total}</td><td colspan="4"></td></tr></tbody>'
        )
    out.append("</table>")

    # ---- curves
    hist = run["history"]
    t0 = hist[0]["t"] if hist else 0.0
    span = hist[-1]["t"] - t0 if hist else 0.0
    unit, scale = (
        ("seconds", 1.0) if span < 180 else ("minutes", 60.0) if span < 3 * 3600 else ("hours", 3600.0)
    )
    # One loss line per trainer (the latest trainers when there are more than the palette has).
    per_trainer: dict[str, list[tuple[float, float]]] = {}
    for h in hist:
        for tid, loss in h.get("losses", {}).items():
            if loss is not None:
                per_trainer.setdefault(tid, []).append(((h["t"] - t0) / scale, loss))
    loss_series = sorted(per_trainer.items(), key=lambda kv: kv[1][-1][0])[-MAX_SERIES:]
    rate_series = [("all trainers", [((h["t"] - t0) / scale, h["tokens_per_s"]) for h in hist])]
    x_label = f"{unit} since the monitor's first sample"
    x_range = (0.0, span / scale)
    out.append('<div class="charts">')
    out.append(
        line_chart_svg(
            loss_series, title="loss (last micro-batch of each trainer)", x_label=x_label, x_range=x_range
        )
    )
    out.append(
        line_chart_svg(
            rate_series,
            title="tokens/s (all trainers)",
            x_label=x_label,
            x_range=x_range,
            palette=PALETTE[1:],
        )
    )
    out.append("</div>")
    trainers = p.get("trainers", {})
    if trainers:
        out.append(
            '<table class="trainers"><thead><tr><th>trainer</th><th class="r">tokens</th><th class="r">steps</th>'
            '<th class="r">tokens/s</th><th class="r">loss</th></tr></thead><tbody>'
        )
        for tid, t in trainers.items():
            out.append(
                f'<tr><td class="mono">{_esc(tid)}</td><td class="r">{human(t["tokens"])}</td><td class="r">{t["steps"]}</td>'
                f'<td class="r">{human(t["tokens_per_s"])}</td><td class="r">{_num(t["loss"], ".4f")}</td></tr>'
            )
        out.append("</tbody></table>")
    for k in run.get("keepers", []):
        held = " ".join(f"{s}:v{v}" if v >= 0 else f"{s}:-" for s, v in enumerate(k["versions"]))
        out.append(
            f'<p class="note">keeper <span class="mono">{_esc(_short(k["keeper_id"]))}</span>: stage snapshots '
            f"{_esc(held)} (every {k['interval_s']:.0f} s)</p>"
        )
    for e in run.get("events", []):
        out.append(f'<p class="warn">event: {_esc(e["text"])}</p>')
    for n in run.get("notes", []):
        out.append(f'<p class="note">note: {_esc(n)}</p>')
    out.append("</section>")
    return "\n".join(out)


def render_fragment(snapshot: Mapping[str, Any]) -> str:
    """The page's content (what ``/fragment`` serves and the page's script swaps in)."""
    mon = snapshot["monitor"]
    out = []
    if mon["polls"] == 0 and not snapshot["runs"]:
        out.append('<p class="banner">connecting to the swarm: the first DHT read is in progress…</p>')
    err = mon.get("last_error")
    if err and (mon["last_poll_at"] is None or err["at"] >= mon["last_poll_at"]):
        out.append(
            f'<p class="banner bad">the last DHT read failed: {_esc(err["message"])} (showing older data)</p>'
        )
    for run_id, message in snapshot.get("run_errors", {}).items():
        out.append(f'<p class="banner bad">run <b>{_esc(run_id)}</b>: {_esc(message)}</p>')
    if mon["polls"] > 0 and not snapshot["runs"] and not snapshot.get("run_errors"):
        out.append(
            '<p class="banner">no runs registered in this swarm (start one with <code>swarm init RUN.yaml</code>)</p>'
        )
    out.extend(_render_run(run) for run in snapshot["runs"])
    last = mon.get("last_poll_at")
    when = time.strftime("%H:%M:%S", time.localtime(last)) if last else "never"
    out.append(
        f"<footer>DHT read at {when} · {mon['polls']} reads, {mon['errors']} failed · every "
        f'{mon["poll_interval_s"]:g} s · "seen for" counts from when this monitor first saw a peer · '
        '<a href="/api/status">JSON</a> · <a href="/metrics">metrics</a></footer>'
    )
    return "\n".join(out)


_STYLE = """
:root { --fg:#0f172a; --dim:#64748b; --line:#e2e8f0; --bg:#f8fafc; --card:#fff; --good:#15803d; --bad:#b91c1c; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg); background:var(--bg); }
header { display:flex; align-items:baseline; gap:12px; padding:14px 24px; background:#0f172a; color:#f8fafc; }
header h1 { font-size:18px; margin:0; } header .sub { color:#94a3b8; font-size:13px; }
#stale { display:none; margin-left:auto; color:#fca5a5; font-size:13px; } #stale.on { display:inline; }
main { padding:8px 24px 24px; max-width:1200px; }
h2 { font-size:17px; margin:18px 0 2px; } .meta { color:var(--dim); font-size:13px; margin-bottom:10px; }
.mono { font-family: ui-monospace,SFMono-Regular,Menlo,Consolas,monospace; font-size:12.5px; }
.dim { color:var(--dim); } .r { text-align:right; }
.badge { font-size:12px; font-weight:600; padding:2px 8px; border-radius:10px; margin-left:6px; vertical-align:2px; }
.badge.good { background:#dcfce7; color:var(--good); } .badge.bad { background:#fee2e2; color:var(--bad); }
.cards { display:grid; grid-template-columns:repeat(auto-fill,minmax(170px,1fr)); gap:10px; margin:8px 0 14px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 12px; }
.card .label { color:var(--dim); font-size:12px; text-transform:uppercase; letter-spacing:.03em; }
.card .value { font-size:22px; font-weight:600; margin-top:2px; } .card .note { color:var(--dim); font-size:12px; }
table { border-collapse:collapse; width:100%; background:var(--card); border:1px solid var(--line); border-radius:8px; margin-bottom:14px; }
th { text-align:left; font-size:12px; color:var(--dim); font-weight:600; padding:7px 10px; border-bottom:1px solid var(--line); background:#f1f5f9; }
td { padding:6px 10px; border-bottom:1px solid #f1f5f9; vertical-align:middle; }
tbody.stage { border-top:2px solid var(--line); } td.stage-id { font-size:16px; }
tbody.uncovered td { background:#fef2f2; } .warn { color:var(--bad); font-weight:600; }
tr.total td { color:var(--dim); font-size:12px; }
.state { font-size:12px; font-weight:600; padding:1px 8px; border-radius:9px; }
.state.online { background:#dcfce7; color:var(--good); } .state.joining { background:#fef9c3; color:#a16207; }
.state.leaving { background:#e2e8f0; color:#475569; } .state.reading { background:#e0f2fe; color:#0369a1; }
.charts { display:flex; flex-wrap:wrap; gap:12px; margin-bottom:14px; }
svg.chart { background:var(--card); border:1px solid var(--line); border-radius:8px; max-width:100%; height:auto; }
svg .chart-title { font-size:13px; font-weight:600; fill:var(--fg); } svg .tick { font-size:11px; fill:var(--dim); }
svg .axis { font-size:11px; fill:var(--dim); } svg .grid { stroke:#eef2f7; } svg .frame { fill:none; stroke:var(--line); }
svg .chart-empty { font-size:12px; fill:var(--dim); } svg .legend { font-size:11px; fill:var(--fg); }
.banner { background:#eff6ff; border:1px solid #bfdbfe; padding:8px 12px; border-radius:8px; }
.banner.bad { background:#fef2f2; border-color:#fecaca; color:var(--bad); }
footer { color:var(--dim); font-size:12px; margin-top:8px; } a { color:#2563eb; }
"""

_SCRIPT = """
(function () {
  var stale = document.getElementById('stale');
  function tick() {
    fetch('/fragment', {cache: 'no-store'}).then(function (r) {
      if (!r.ok) { throw new Error('HTTP ' + r.status); }
      return r.text();
    }).then(function (text) {
      document.getElementById('content').innerHTML = text;
      stale.className = '';
    }).catch(function () { stale.className = 'on'; });
  }
  setInterval(tick, REFRESH_MS);
})();
"""


def render_page(snapshot: Mapping[str, Any], *, refresh_s: float = 3.0) -> str:
    """The whole page: content rendered now, plus a script that refreshes it every ``refresh_s``."""
    runs = ", ".join(r["run_id"] for r in snapshot["runs"]) or "swarm"
    script = _SCRIPT.replace("REFRESH_MS", str(int(refresh_s * 1000)))
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<noscript><meta http-equiv="refresh" content="{max(1, int(refresh_s))}"></noscript>'
        f"<title>swarm monitor · {_esc(runs)}</title><style>{_STYLE}</style></head><body>"
        '<header><h1>swarmpipe monitor</h1><span class="sub">'
        f"refreshes every {refresh_s:g} s</span>"
        '<span id="stale">connection to the monitor lost; retrying…</span></header>'
        f'<main id="content">{render_fragment(snapshot)}</main>'
        f"<script>{script}</script></body></html>"
    )


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(snapshot: Mapping[str, Any]) -> str:
    """Prometheus text exposition (version 0.0.4) of the snapshot: gauges per run, stage and peer."""
    families: dict[str, tuple[str, list[str]]] = {}

    def gauge(name: str, help_text: str, labels: Mapping[str, object], value: float | None) -> None:
        if value is None or not math.isfinite(float(value)):
            return
        rendered = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        sample = f"{name}{{{rendered}}}" if rendered else name
        families.setdefault(name, (help_text, []))[1].append(f"{sample} {float(value):.10g}")

    mon = snapshot["monitor"]
    gauge("swarm_monitor_polls", "DHT reads done by this monitor", {}, mon["polls"])
    gauge("swarm_monitor_poll_errors", "DHT reads that failed", {}, mon["errors"])
    if mon.get("last_poll_at") is not None:
        gauge(
            "swarm_monitor_last_poll_timestamp_seconds",
            "Unix time of the last DHT read",
            {},
            mon["last_poll_at"],
        )
    for run in snapshot["runs"]:
        r = {"run": run["run_id"]}
        p = run["progress"]
        gauge("swarm_run_stages", "Stages of the run", r, run["num_stages"])
        gauge("swarm_run_uncovered_stages", "Stages without an active peer", r, len(run["uncovered_stages"]))
        gauge("swarm_run_peers", "Distinct active stage peers", r, run["peers"])
        gauge("swarm_run_trainers", "Trainers publishing progress", r, len(p.get("trainers", {})))
        gauge(
            "swarm_run_stage_events",
            "Stage rollbacks and fresh starts of the last hour",
            r,
            len(run.get("events", [])),
        )
        gauge(
            "swarm_run_tokens", "Tokens trained by live trainers (sum of their totals)", r, p.get("tokens", 0)
        )
        gauge("swarm_run_steps", "Steps done by live trainers", r, p.get("steps", 0))
        gauge("swarm_run_tokens_per_second", "Tokens/s of all trainers", r, p.get("tokens_per_s", 0.0))
        gauge("swarm_run_loss", "Mean of the trainers' last losses", r, p.get("loss"))
        gauge(
            "swarm_run_capacity_tokens_per_second",
            "Throughput of the slowest stage",
            r,
            run["bottleneck_tokens_per_s"],
        )
        for kind, value in run["bytes_per_token"].items():
            gauge(
                "swarm_run_bytes_per_token", "Bytes on all stage links per token", {**r, "kind": kind}, value
            )
        for s in run["stages"]:
            sl = {**r, "stage": s["stage"]}
            gauge(
                "swarm_stage_covered", "1 if the stage has an active peer", sl, 1.0 if s["covered"] else 0.0
            )
            gauge("swarm_stage_active_peers", "Active peers of the stage", sl, s["active_peers"])
            gauge(
                "swarm_stage_tokens_per_second", "Throughput of the stage's active peers", sl, s["throughput"]
            )
            for peer in s["peers"]:
                pl = {**sl, "peer": peer["peer_id"], "state": peer["state"]}
                gauge("swarm_peer_tokens_per_second", "Throughput a peer announces", pl, peer["throughput"])
                gauge("swarm_peer_queue", "Requests waiting in a peer's compute queue", pl, peer["queue"])
                gauge("swarm_peer_version", "A peer's weight version", pl, peer["version"])
                gauge(
                    "swarm_peer_seen_seconds",
                    "Seconds since this monitor first saw the peer",
                    pl,
                    peer["seen_for_s"],
                )
    lines = []
    for name, (help_text, samples) in families.items():
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(samples)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ serving


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
