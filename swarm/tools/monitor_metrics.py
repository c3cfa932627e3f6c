"""The monitor's ``/metrics``: a snapshot (``swarm.tools.monitor_state``) as Prometheus text, pure.

Text exposition format 0.0.4, every metric a gauge: the monitor re-reads the swarm's current state
each poll, and even totals (tokens, steps) fall when a trainer's record expires.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["render_prometheus"]


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Families:
    """Samples grouped by metric name, in first-seen order, each family with its HELP text."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[str, list[str]]] = {}

    def gauge(self, name: str, help_text: str, labels: Mapping[str, object], value: float | None) -> None:
        """Add one sample; a missing or non-finite value adds nothing."""
        if value is None or not math.isfinite(float(value)):
            return
        rendered = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        sample = f"{name}{{{rendered}}}" if rendered else name
        self._families.setdefault(name, (help_text, []))[1].append(f"{sample} {float(value):.10g}")

    def text(self) -> str:
        lines = []
        for name, (help_text, samples) in self._families.items():
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} gauge")
            lines.extend(samples)
        return "\n".join(lines) + "\n"


def _monitor(out: _Families, mon: Mapping[str, Any]) -> None:
    out.gauge("swarm_monitor_polls", "DHT reads done by this monitor", {}, mon["polls"])
    out.gauge("swarm_monitor_poll_errors", "DHT reads that failed", {}, mon["errors"])
    if mon.get("last_poll_at") is not None:
        out.gauge(
            "swarm_monitor_last_poll_timestamp_seconds",
            "Unix time of the last DHT read",
            {},
            mon["last_poll_at"],
        )


def _run(out: _Families, run: Mapping[str, Any]) -> None:
    r = {"run": run["run_id"]}
    p = run["progress"]
    g = out.gauge
    g("swarm_run_stages", "Stages of the run", r, run["num_stages"])
    g("swarm_run_uncovered_stages", "Stages without an active peer", r, len(run["uncovered_stages"]))
    g("swarm_run_peers", "Distinct active stage peers", r, run["peers"])
    g("swarm_run_trainers", "Trainers publishing progress", r, len(p.get("trainers", {})))
    g(
        "swarm_run_stage_events",
        "Stage rollbacks and fresh starts of the last hour",
        r,
        len(run.get("events", [])),
    )
    g("swarm_run_tokens", "Tokens trained by live trainers (sum of their totals)", r, p.get("tokens", 0))
    g("swarm_run_steps", "Steps done by live trainers", r, p.get("steps", 0))
    g("swarm_run_tokens_per_second", "Tokens/s of all trainers", r, p.get("tokens_per_s", 0.0))
    g("swarm_run_loss", "Mean of the trainers' last losses", r, p.get("loss"))
    g(
        "swarm_run_capacity_tokens_per_second",
        "Throughput of the slowest stage",
        r,
        run["bottleneck_tokens_per_s"],
    )
    for kind, value in run["bytes_per_token"].items():
        g("swarm_run_bytes_per_token", "Bytes on all stage links per token", {**r, "kind": kind}, value)
    for s in run["stages"]:
        _stage(out, {**r, "stage": s["stage"]}, s)


def _stage(out: _Families, sl: Mapping[str, object], s: Mapping[str, Any]) -> None:
    g = out.gauge
    g("swarm_stage_covered", "1 if the stage has an active peer", sl, 1.0 if s["covered"] else 0.0)
    g("swarm_stage_active_peers", "Active peers of the stage", sl, s["active_peers"])
    g("swarm_stage_tokens_per_second", "Throughput of the stage's active peers", sl, s["throughput"])
    for peer in s["peers"]:
        pl = {**sl, "peer": peer["peer_id"], "state": peer["state"]}
        g("swarm_peer_tokens_per_second", "Throughput a peer announces", pl, peer["throughput"])
        g("swarm_peer_queue", "Requests waiting in a peer's compute queue", pl, peer["queue"])
        g("swarm_peer_version", "A peer's weight version", pl, peer["version"])
        g("swarm_peer_seen_seconds", "Seconds since this monitor first saw the peer", pl, peer["seen_for_s"])


def render_prometheus(snapshot: Mapping[str, Any]) -> str:
    """Prometheus text exposition (version 0.0.4) of the snapshot: gauges per run, stage and peer."""
    out = _Families()
    _monitor(out, snapshot["monitor"])
    for run in snapshot["runs"]:
        _run(out, run)
    return out.text()
