"""The "Control plane" section of BENCHMARKS.md from benchmarks/control_plane.py's results (pure)."""

from __future__ import annotations

from typing import Any

__all__ = ["SECTION", "TARGETS", "markdown_section"]

SECTION = "## Control plane"
TARGETS = {"blockwise8": 0.10, "subspace d/32 + blockwise8": 0.50}
"""The issue's targets: non-payload bytes / payload bytes on the wire."""


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def markdown_section(report: dict[str, Any], streams: dict[str, Any] | None = None) -> str:
    """The "Control plane" section: the reading, one table of per-source bytes per token for each group of
    variants (a variant's ``table``; the first changes' variants have none), and the wire cost of one
    message (``streams``: results/stream_cost.json, benchmarks/stream_cost.py) when given."""
    variants = report.get("variants", {})
    lines = [SECTION, ""]
    lines += [report.get("reading", "").strip(), ""] if report.get("reading") else []
    if streams and streams.get("runs"):
        lines += _stream_table(streams)
    tables: dict[str, dict[str, Any]] = {}
    for name, v in variants.items():
        tables.setdefault(v.get("table", FIRST_TABLE), {})[name] = v
    for title, group in tables.items():
        lines += [f"**{title}**", ""] if len(tables) > 1 else []
        lines += _variants_table(group)
    return "\n".join(lines).rstrip("\n") + "\n"


FIRST_TABLE = "Announce on change, compact headers (24 micro-batches)"
"""Title of the table of variants without a ``table`` (the first control-plane changes)."""


def _stream_table(streams: dict[str, Any]) -> list[str]:
    lines = [
        f"One message on the wire (`{streams.get('command', 'python -m benchmarks.stream_cost')}`, "
        f"{streams.get('started', '?')}): two lab nodes over a warm connection, each call either a new libp2p "
        "stream (a stream of its own) or a message on the channel the warm-up opened (swarm/wire/channel.py), "
        "both directions, an idle window of the same length subtracted.",
        "",
        "| message | carried on | calls in flight | serialised bytes | wire bytes per call | packets per call "
        "| beyond what we serialise |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(streams["runs"], key=lambda r: (bool(r.get("channels")), r["concurrency"])):
        carried = "channel" if r.get("channels") else "stream of its own"
        lines.append(
            f"| {r['shape']} | {carried} | {r['concurrency']} | {r['serialised_bytes_per_call']} | "
            f"{r['wire_bytes_per_call']:.0f} | {r['packets_per_call']:.1f} | {r['fixed_bytes_per_call']:.0f} |"
        )
    return [*lines, ""]


def _variants_table(variants: dict[str, Any]) -> list[str]:
    lines = []
    for name, v in variants.items():
        lines.append(
            f"- **{name}**: commit {v.get('commit', '?')}, {v.get('started', '?')}, command `{v.get('command', '?')}`; "
            f"load average at start {v.get('load', '?')}"
        )
    lines.append("")
    runs = [(name, r) for name, v in variants.items() for r in v["runs"]]
    keys = list(dict.fromkeys(k for _, r in runs for k in r["breakdown"]["serialised"]))
    several = len({r.get("micro_batches") for _, r in runs}) > 1

    def title(n: str, r: dict[str, Any]) -> str:
        length = f", {r['micro_batches']} mb" if several else ""
        return f"{r['label']} @ {r['rate']}{length}, {n}"

    head = "| bytes per token | " + " | ".join(title(n, r) for n, r in runs) + " |"
    lines += [head, "|---" * (len(runs) + 1) + "|"]

    def row(title: str, get: Any, spec: str = ".1f") -> None:
        lines.append(f"| {title} | " + " | ".join(_f(get(r["breakdown"]), spec) for _, r in runs) + " |")

    row("payload (trainer metrics)", lambda b: b["payload"])
    row("**wire, all nodes**", lambda b: b["wire"])
    row("**non-payload on the wire**", lambda b: b["overhead"])
    for k in keys:
        if k.startswith("payload"):
            continue
        row(f"serialised: {k}", lambda b, k=k: b["serialised"].get(k))
    for kind in sorted({k for _, r in runs for k in r["breakdown"]["dht_stored_values"]}):
        row(f"serialised: DHT values stored ({kind})", lambda b, kind=kind: b["dht_stored_values"].get(kind))
    row("keeper's stage snapshots (state downloads; in the wire total)", lambda b: b.get("keeper_snapshots"))
    row("TCP payload, all connections (ss)", lambda b: b.get("tcp_total"))
    row(
        "of it not serialised by us: DHT RPCs, averagers, libp2p framing",
        lambda b: (
            None
            if b.get("tcp_total") is None
            else b["tcp_total"]
            - b["serialised"]["payload (activations, gradients)"]
            - b["serialised_control"]
        ),
    )
    row("IP/TCP headers and ACKs (wire - TCP payload)", lambda b: _minus(b["wire"], b.get("tcp_total")))
    row("(idle tx rate after training x run time)", lambda b: b["background_wire"])
    for kind in ("forward", "backward", "report", "info", "cancel"):
        row(
            f"{kind.upper()} messages per micro-batch",
            lambda b, kind=kind: _per_mb(b, kind),
            ".2f",
        )
    row("DHT stores per 1k tokens", lambda b: b["dht_stores_per_1k_tokens"], ".2f")
    row("DHT reads per 1k tokens", lambda b: b["dht_gets_per_1k_tokens"], ".2f")
    lines.append("| tokens/s | " + " | ".join(_f(r["tokens_per_s"], ".0f") for _, r in runs) + " |")
    row("**non-payload / payload**", lambda b: b["ratio"], ".3f")
    lines.append(
        "| target | " + " | ".join(f"<= {TARGETS.get(r['label'], float('nan')):.2f}" for _, r in runs) + " |"
    )
    lines.append(
        "| met | "
        + " | ".join(
            "yes" if r["breakdown"]["ratio"] <= TARGETS.get(r["label"], -1) else "**no**" for _, r in runs
        )
        + " |"
    )
    return [*lines, ""]


TOKENS_PER_MB = 512
"""Tokens of one micro-batch of examples/bench.yaml (2 x 256): messages per micro-batch from per-1k counts."""


def _per_mb(b: dict[str, Any], kind: str) -> float | None:
    """Messages of ``kind`` (all processes) per trained micro-batch; eval micro-batches' count too."""
    per_1k = b.get("messages_per_1k_tokens", {})
    return per_1k.get(kind, 0.0) * TOKENS_PER_MB / 1000 if per_1k else None
