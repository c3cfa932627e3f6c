"""CPU seconds of a command and all its descendants, by kind of process.

    python -m benchmarks.cpu_by_process -- python -m swarm.cli demo --out /tmp/d --no-reference --quiet
    python -m benchmarks.cpu_by_process --threads -- python -m swarm.cli demo --out /tmp/d --no-reference --quiet
    python -m benchmarks.cpu_by_process --window 60:120 -- python -m benchmarks.timeline --no-pipelining

Every second it reads utime + stime of every thread of every descendant from /proc and keeps each
thread's last reading; at the end it prints the totals by kind: ``peer`` (a ``swarm peer`` process),
``peer/child`` (processes it forked: hivemind's DHT and averager), ``.../p2pd`` (libp2p daemons),
``trainer``, ``demo``. A thread that lived less than a second between samples is missed, so the
totals are a lower bound. Linux only. BENCHMARKS.md "Demo throughput" shows what it found.

``--threads`` also prints the CPU seconds of every kind of thread: every ``NAME_EVERY_S`` it asks
``py-spy dump`` (when py-spy is installed: it is not a dependency) for the Python name and the entry
function of each thread of each process, and it tells a forked child that runs hivemind's DHT from one
that runs an averager by those entry functions (``peer/dht``, ``peer/averager``). Threads it could not
name are ``?`` (a native thread, such as torch's, or one that ended between two dumps).

Beside each kind's CPU it prints how much of it was system time and how many minor page faults its
threads took (``/proc``: a fault maps a page touched for the first time; on the 2-core VM of BENCHMARKS.md
they cost 6-35 µs each from run to run, and a stage peer's first steps take hundreds of thousands of
them).

``--window A:B`` counts only what was spent between A and B seconds after the start (each thread's
reading at B less its reading at A; a thread born in between counts from 0): the steady state of a run,
without its start-up and shut-down. It also prints the window's length, so totals read as cores.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
NAME_EVERY_S = 20.0
_DUMP_THREAD = re.compile(r'Thread (\d+) \(\w+\): "([^"]*)"\n((?:    .*\n)*)')
_ENTRY_SKIP = {"Thread.run", "Thread._bootstrap_inner", "Thread._bootstrap"}


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
    """The kind of process ``pid`` is, from its command line; "" once it has exited (a zombie's command
    line is empty) and None where /proc has no such process."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
    except OSError:
        return None
    for needle, kind in (("p2pd", "p2pd"), (" peer ", "peer"), (" train ", "trainer"), (" demo ", "demo")):
        if needle in cmd:
            return kind
    return cmd[:60]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def thread_names(pid: int, py_spy: str) -> dict[int, str]:
    """``{thread id: "python name | entry function"}`` of one process, from ``py-spy dump``."""
    try:
        out = subprocess.run(
            [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_dump(out)


def parse_dump(out: str) -> dict[int, str]:
    """``{thread id: "python name | entry function"}`` from the text of ``py-spy dump``: the entry is the
    outermost frame below threading's own."""
    names = {}
    for m in _DUMP_THREAD.finditer(out):
        frames = [line.strip().split(" (")[0] for line in m.group(3).splitlines()]
        entry = [f for f in frames if f not in _ENTRY_SKIP]
        names[int(m.group(1))] = f"{m.group(2)} | {entry[-1] if entry else '?'}"
    return names


def _child_role(names: dict[int, str]) -> str:
    """What a forked child of a peer or trainer runs, from its threads' entry functions."""
    entries = " ".join(names.values())
    if "_run_internal" in entries:
        return "averager"
    if "DHT.run" in entries:  # DHT.run, DHT.run_in_background
        return "dht"
    return "child"


Reading = tuple[str, int, int, int]  # a thread's kind of process, CPU ticks, system ticks, minor faults


def measure(
    argv: list[str], every_s: float = 1.0, *, threads: bool = False, window: tuple[float, float] | None = None
) -> tuple[int, dict[str, float], dict[str, float], dict[str, tuple[float, int]]]:
    """Run ``argv``; its exit code, CPU seconds by kind of process, (``threads``) by kind of thread, and
    system seconds and minor faults by kind of process; all of the run or (``window``: seconds after the
    start) between two readings."""
    last: dict[tuple[int, int], Reading] = {}
    at_start: dict[tuple[int, int], Reading] = {}
    at_end: dict[tuple[int, int], Reading] | None = None
    t0 = time.monotonic()
    labels: dict[int, str] = {}
    names: dict[tuple[int, int], str] = {}
    py_spy = _py_spy() if threads else None
    if threads and py_spy is None:
        print("cpu_by_process: py-spy not found; threads stay unnamed", file=sys.stderr)
    named_at = time.monotonic()
    proc = subprocess.Popen(argv)
    while proc.poll() is None:
        if py_spy is not None and time.monotonic() - named_at > NAME_EVERY_S:
            named_at = time.monotonic()
            for pid, label in list(labels.items()):
                if label.endswith("p2pd"):
                    continue
                found = thread_names(pid, py_spy)
                for tid, name in found.items():
                    names.setdefault((pid, tid), name)
                if label.endswith("/child") and found:
                    labels[pid] = label.rsplit("/", 1)[0] + "/" + _child_role(found)
        for pid in _descendants(proc.pid):
            kind, ppid = _kind(pid), _ppid(pid)
            if kind is None or ppid is None or (kind == "" and pid not in labels):
                continue
            if kind:  # "": exited, not yet reaped; its last counters count under the label it had alive
                parent = labels.get(ppid) or _kind(ppid) or "?"
                if kind == "p2pd":
                    labels[pid] = f"{parent}/p2pd"
                elif parent.split("/")[0] == kind:  # forked (same command line): hivemind's DHT, averager
                    labels.setdefault(pid, f"{parent}/child")
                else:
                    labels[pid] = kind
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    utime, stime, minflt = int(fields[11]), int(fields[12]), int(fields[7])
                    last[(pid, int(tid))] = (labels[pid], utime + stime, stime, minflt)
            except (OSError, ValueError, IndexError):
                continue
        if window is not None:
            elapsed = time.monotonic() - t0
            if elapsed >= window[0] and not at_start:
                at_start = dict(last)
            if elapsed >= window[1] and at_end is None:
                at_end = dict(last)
        time.sleep(every_s)
    if window is not None and at_end is None:
        print(f"cpu_by_process: the run ended before {window[1]:.0f} s; counting to its end", file=sys.stderr)
    totals: dict[str, float] = collections.Counter()
    by_thread: dict[str, float] = collections.Counter()
    system: dict[str, float] = collections.Counter()
    faults: dict[str, int] = collections.Counter()
    for (pid, tid), (_label, ticks, sys_ticks, minflt) in (last if at_end is None else at_end).items():
        label = labels.get(pid, _label)
        _, ticks0, sys0, minflt0 = at_start.get((pid, tid), ("", 0, 0, 0))
        ticks -= ticks0
        totals[label] += ticks / TICKS
        system[label] += (sys_ticks - sys0) / TICKS
        faults[label] += minflt - minflt0
        if threads:
            name = names.get((pid, tid), "main" if pid == tid else "?")
            by_thread[f"{label}: {name}"] += ticks / TICKS
    kernel = {label: (system[label], faults[label]) for label in totals}
    return proc.returncode, dict(totals), dict(by_thread), kernel


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    threads = "--threads" in args[: args.index("--") if "--" in args else len(args)]
    if threads:
        args.remove("--threads")
    window = None
    if args[:1] == ["--window"]:
        try:
            a, b = (float(x) for x in args[1].split(":"))
        except (IndexError, ValueError):
            print("cpu_by_process: --window wants START:END in seconds, e.g. 60:120", file=sys.stderr)
            return 2
        if not 0 <= a < b:
            print(f"cpu_by_process: --window {args[1]}: START must be >= 0 and below END", file=sys.stderr)
            return 2
        window, args = (a, b), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    rc, totals, by_thread, kernel = measure(args, threads=threads, window=window)
    total = sum(totals.values()) or 1.0
    span = f" between {window[0]:.0f} and {window[1]:.0f} s ({window[1] - window[0]:.0f} s)" if window else ""
    print(f"CPU seconds, all processes{span}: {total:.1f} (of which system, minor page faults)")
    for label, s in sorted(totals.items(), key=lambda kv: -kv[1]):
        sys_s, minflt = kernel[label]
        print(f"  {label:40s} {s:7.1f}  {s / total:6.1%}  ({sys_s:.1f} s, {minflt})")
    if threads:
        print("by thread (process kind: python thread name | entry function), 0.5 s or more:")
        for label, s in sorted(by_thread.items(), key=lambda kv: -kv[1]):
            if s >= 0.5:
                print(f"  {label:90s} {s:7.1f}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
