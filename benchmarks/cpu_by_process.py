"""CPU seconds of a command and all its descendants, by kind of process.

    python -m benchmarks.cpu_by_process -- python -m swarm.cli demo --out /tmp/d --no-reference --quiet

Every second it reads utime + stime of every thread of every descendant from /proc and keeps each
thread's last reading; at the end it prints the totals by kind: ``peer`` (a ``swarm peer`` process),
``peer/child`` (processes it forked: hivemind's DHT and averager), ``.../p2pd`` (libp2p daemons),
``trainer``, ``demo``. A thread that lived less than a second between samples is missed, so the
totals are a lower bound. Linux only. BENCHMARKS.md "Demo throughput" shows what it found.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def _parents() -> dict[int, list[int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children[ppid].append(int(name))
    return children


def _descendants(root: int) -> list[int]:
    children, out, todo = _parents(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _kind(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
    except OSError:
        return None
    for needle, kind in (("p2pd", "p2pd"), (" peer ", "peer"), (" train ", "trainer"), (" demo ", "demo")):
        if needle in cmd:
            return kind
    return cmd[:60] or "?"


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def measure(argv: list[str], every_s: float = 1.0) -> tuple[int, dict[str, float]]:
    """Run ``argv``; its exit code and CPU seconds by kind of process."""
    last: dict[tuple[int, int], tuple[str, int]] = {}
    labels: dict[int, str] = {}
    proc = subprocess.Popen(argv)
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            kind, ppid = _kind(pid), _ppid(pid)
            if kind is None or ppid is None:
                continue
            parent = labels.get(ppid) or _kind(ppid) or "?"
            if kind == "p2pd":
                labels[pid] = f"{parent}/p2pd"
            elif parent.split("/")[0] == kind:  # forked (same command line): hivemind's DHT, averager
                labels[pid] = f"{parent}/child"
            else:
                labels[pid] = kind
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    last[(pid, int(tid))] = (labels[pid], int(fields[11]) + int(fields[12]))
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(every_s)
    totals: dict[str, float] = collections.Counter()
    for label, ticks in last.values():
        totals[label] += ticks / TICKS
    return proc.returncode, dict(totals)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    rc, totals = measure(args)
    total = sum(totals.values()) or 1.0
    print(f"CPU seconds, all processes: {total:.1f}")
    for label, s in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:40s} {s:7.1f}  {s / total:.1%}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
