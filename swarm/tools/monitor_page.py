"""The monitor's HTML page, rendered on the server from a snapshot (``swarm.tools.monitor_state``).

Pure functions; the markup, style and script are files in ``monitor_assets/`` (``page.html``,
``fragment.html``, ``run.html``, ``monitor.css``, ``monitor.js``). The page is complete without
JavaScript; its script only swaps in a fresh ``/fragment`` every ``refresh_s``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from string import Template
from typing import Any

from swarm.tools.monitor_assets import asset, esc, snippets
from swarm.tools.monitor_chart import MAX_SERIES, PALETTE, line_chart_svg
from swarm.tools.status import human

__all__ = ["render_page", "render_fragment"]


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


def _run_t() -> dict[str, Template]:
    return snippets("run.html")


def _head(run: Mapping[str, Any]) -> str:
    """Run id, coverage badge and the spec line (hash, model shape, codecs)."""
    t = _run_t()
    uncovered, stages = run["uncovered_stages"], run["num_stages"]
    if uncovered:
        badge = t["badge_uncovered"].substitute(uncovered=len(uncovered), stages=stages)
    else:
        badge = t["badge_covered"].substitute(stages=stages)
    meta = f"spec {esc(run['spec_hash'] or '?')}"
    model = run.get("model")
    if model:
        meta += (
            f" · {human(model['n_params'])} params · d_model {model['d_model']} · {model['n_layers']} layers"
            f" · {model['n_heads']} heads · seq {model['seq_len']}"
        )
    if run.get("codecs"):
        meta += f" · codecs {esc(run['codecs']['activations'])} / {esc(run['codecs']['gradients'])}"
    return t["head"].substitute(run_id=esc(run["run_id"]), badge=badge, meta=meta)


def _card(label: str, value: str, note: str = "") -> str:
    t = _run_t()
    note_html = t["card_note"].substitute(note=esc(note)) if note else ""
    return t["card"].substitute(label=esc(label), value=value, note=note_html)


def _cards(run: Mapping[str, Any]) -> str:
    """The headline numbers: trainer rate, capacity, loss, tokens, bytes per token, peers."""
    p, bpt = run["progress"], run["bytes_per_token"]
    if bpt.get("measured") is not None:
        bpt_value = human(bpt["measured"])
        bpt_note = f"nominal {human(bpt['nominal'] or 0)} · fp32 {human(bpt['uncompressed'] or 0)}"
    elif bpt.get("nominal") is not None:
        bpt_value = human(bpt["nominal"])
        bpt_note = f"nominal for the codecs · fp32 {human(bpt['uncompressed'] or 0)}"
    else:
        bpt_value, bpt_note = "-", "spec not available"
    uncovered = run["uncovered_stages"]
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
    return _run_t()["cards"].substitute(cards="".join(cards))


def _stage(run_id: str, s: Mapping[str, Any]) -> list[str]:
    """One stage's rows: its peers (or an UNCOVERED row) and the stage's total."""
    t = _run_t()
    if not s["layers"]:
        layers = "?"
    else:
        first, last = s["layers"][0], s["layers"][1] - 1
        layers = str(first) if first == last else f"{first}–{last}"
    peers = s["peers"]
    cell = t["stage_cell"].substitute(rows=max(1, len(peers)) + 1, stage=s["stage"], layers=layers)
    out = [
        t["stage_head"].substitute(
            {"class": "stage" if s["covered"] else "stage uncovered", "stage": s["stage"]}
        )
    ]
    if not peers:
        out.append(t["no_peers"].substitute(stage_cell=cell, run_id=esc(run_id)))
    for i, peer in enumerate(peers):
        out.append(
            t["peer"].substitute(
                stage_cell=cell if i == 0 else "",
                peer_id=esc(peer["peer_id"]),
                short_id=esc(_short(peer["peer_id"])),
                state=esc(peer["state"]),
                throughput=_num(peer["throughput"], ".1f"),
                queue=peer["queue"],
                version=peer["version"],
                seen_for=_duration(peer.get("seen_for_s")),
                software=esc(peer["software"]),
            )
        )
    note = "" if s["covered"] else t["stage_total_uncovered"].template
    out.append(
        t["stage_total"].substitute(
            active=s["active_peers"], note=note, throughput=_num(s["throughput"], ".1f")
        )
    )
    return out


def _charts(hist: list[Mapping[str, Any]]) -> str:
    """Loss per trainer and the trainers' tokens/s over the monitor's history of the run."""
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
    loss = line_chart_svg(
        loss_series, title="loss (last micro-batch of each trainer)", x_label=x_label, x_range=x_range
    )
    rate = line_chart_svg(
        rate_series, title="tokens/s (all trainers)", x_label=x_label, x_range=x_range, palette=PALETTE[1:]
    )
    return _run_t()["charts"].substitute(loss=loss, rate=rate)


def _details(run: Mapping[str, Any]) -> list[str]:
    """The trainers' table, the keepers' snapshot versions, stage events and notes."""
    t = _run_t()
    out = []
    trainers = run["progress"].get("trainers", {})
    if trainers:
        rows = [
            t["trainer"].substitute(
                trainer_id=esc(tid),
                tokens=human(tr["tokens"]),
                steps=tr["steps"],
                tokens_per_s=human(tr["tokens_per_s"]),
                loss=_num(tr["loss"], ".4f"),
            )
            for tid, tr in trainers.items()
        ]
        out.append(t["trainers"].substitute(rows="\n".join(rows)))
    for k in run.get("keepers", []):
        held = " ".join(f"{s}:v{v}" if v >= 0 else f"{s}:-" for s, v in enumerate(k["versions"]))
        out.append(
            t["keeper"].substitute(
                keeper_id=esc(_short(k["keeper_id"])), held=esc(held), interval_s=f"{k['interval_s']:.0f}"
            )
        )
    out.extend(t["event"].substitute(text=esc(e["text"])) for e in run.get("events", []))
    out.extend(t["note"].substitute(text=esc(n)) for n in run.get("notes", []))
    return out


def _render_run(run: Mapping[str, Any]) -> str:
    t = _run_t()
    out = [_head(run), _cards(run), t["stages_head"].template]
    for s in run["stages"]:
        out.extend(_stage(run["run_id"], s))
    out += [t["stages_end"].template, _charts(run["history"]), *_details(run), t["end"].template]
    return "\n".join(out)


def render_fragment(snapshot: Mapping[str, Any]) -> str:
    """The page's content (what ``/fragment`` serves and the page's script swaps in)."""
    t = snippets("fragment.html")
    mon = snapshot["monitor"]
    out = []
    if mon["polls"] == 0 and not snapshot["runs"]:
        out.append(t["connecting"].template)
    err = mon.get("last_error")
    if err and (mon["last_poll_at"] is None or err["at"] >= mon["last_poll_at"]):
        out.append(t["poll_failed"].substitute(message=esc(err["message"])))
    for run_id, message in snapshot.get("run_errors", {}).items():
        out.append(t["run_error"].substitute(run_id=esc(run_id), message=esc(message)))
    if mon["polls"] > 0 and not snapshot["runs"] and not snapshot.get("run_errors"):
        out.append(t["no_runs"].template)
    out.extend(_render_run(run) for run in snapshot["runs"])
    last = mon.get("last_poll_at")
    when = time.strftime("%H:%M:%S", time.localtime(last)) if last else "never"
    out.append(
        t["footer"].substitute(
            when=when, polls=mon["polls"], errors=mon["errors"], interval_s=f"{mon['poll_interval_s']:g}"
        )
    )
    return "\n".join(out)


def render_page(snapshot: Mapping[str, Any], *, refresh_s: float = 3.0) -> str:
    """The whole page: content rendered now, plus a script that refreshes it every ``refresh_s``."""
    runs = ", ".join(r["run_id"] for r in snapshot["runs"]) or "swarm"
    return Template(asset("page.html")).substitute(
        noscript_refresh_s=max(1, int(refresh_s)),
        title=esc(runs),
        style=asset("monitor.css"),
        refresh_s=f"{refresh_s:g}",
        content=render_fragment(snapshot),
        script=Template(asset("monitor.js")).substitute(refresh_ms=int(refresh_s * 1000)),
    )
