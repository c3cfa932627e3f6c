"""A network lab on one machine: one network namespace per process, each with a rate-limited link.

Why: the swarm is built for slow links between volunteers, so its benchmarks must run over slow links,
and a benchmark anyone can rerun needs those links on one machine. Linux network namespaces give each
process its own network stack; a ``tbf`` queueing discipline on each namespace's egress caps what it
can send (``netem`` is not available here, so there is no added delay: see docs/HIVEMIND.md, "Links on one machine").

Layout of one lab (``TAG`` is unique per lab, e.g. ``swl-4242-9f3a``: our prefix, the owner's pid,
random hex)::

    TAG-hub   : bridge br0, no address (the switch; it lives in its own namespace, so the host's
                namespace gets no interface, no address and no route)
    TAG-NODE  : eth0 = 10.213.0.(2+i)/24 on the bridge, lo up, IPv6 off, egress tbf at the rate
                given (none = no qdisc); no default route, so nothing can leave the lab.

Only addresses inside these namespaces are used; every lab is its own layer-2 island, so two labs
(of two concurrent runs) may use the same subnet without seeing each other. ``NetLab.close`` (also
run on SIGINT/SIGTERM and at interpreter exit) stops every process inside the lab's namespaces and
deletes them; ``clean_stale()`` deletes namespaces of our prefix whose owner process is gone.

:class:`LoopbackLab` has the same interface without namespaces (every node is 127.0.0.1, no rate
limits), for machines where one is not root.

Run::

    python -m benchmarks.netlab check        # can this machine run the lab? (says why not)
    python -m benchmarks.netlab selftest     # 2 namespaces: a 4 MiB transfer at 20mbit vs unlimited
    python -m benchmarks.netlab clean        # delete namespaces left by labs whose owner died

From Python::

    with NetLab(["a", "b"], rate="20mbit") as lab:
        proc = lab.spawn("a", ["python", "-m", "http.server", "--bind", lab.address("a")])
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from swarm.errors import ConfigError, SwarmError

__all__ = [
    "PREFIX",
    "LabError",
    "Lab",
    "NetLab",
    "LoopbackLab",
    "parse_rate",
    "format_rate",
    "lab_unavailable_reason",
    "clean_stale",
    "our_namespaces",
    "measure_transfer",
    "open_lab",
]

PREFIX = "swl-"
"""Every namespace a lab creates starts with this (``swl-<owner pid>-<hex>-<node>``)."""
_NODE_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,15}$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNIT = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_PROBE_NODES = ("probe",)


class LabError(SwarmError):
    """The lab could not be built or used here (not root, no ``ip``, namespaces refused, ...)."""


# ------------------------------------------------------------------------------------------ rates


def parse_rate(rate: str) -> float | None:
    """``"none"`` -> None (unlimited); ``"20mbit"`` -> 20e6 bits/s. Units: kbit, mbit, gbit."""
    text = str(rate).strip().lower()
    if text in ("none", "unlimited", "0"):
        return None
    m = _RATE_RE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(
            f"link rate {rate!r} is not understood; the rule is NUMBER followed by kbit, mbit or gbit "
            "(e.g. 20mbit, 1gbit) or 'none' for an unlimited link"
        )
    return float(m.group(1)) * _UNIT[m.group(2)]


def format_rate(rate: str) -> str:
    """The canonical spelling of a rate (``"20Mbit"`` -> ``"20mbit"``, ``"unlimited"`` -> ``"none"``)."""
    bits = parse_rate(rate)
    if bits is None:
        return "none"
    for unit in ("gbit", "mbit", "kbit"):
        value = bits / _UNIT[unit]
        if value >= 1 and value == int(value):
            return f"{int(value)}{unit}"
    return f"{bits / 1e3:g}kbit"


def _tbf_args(bits_per_s: float) -> list[str]:
    """tbf parameters for a rate: a bucket of >= 64 KiB (or 4 ms of traffic) and a 100 ms queue.

    The bucket must hold at least one full frame and what arrives in one timer tick at that rate, or
    tbf throttles below its rate; 64 KiB with 100 ms of queue measured ~12 MB/s at 100mbit here.
    """
    burst = max(64 * 1024, int(bits_per_s / 8 * 0.004))
    return ["rate", f"{int(bits_per_s)}bit", "burst", str(burst), "latency", "100ms"]


# ------------------------------------------------------------------------------------ processes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_pids(pids: Sequence[int], grace_s: float) -> None:
    """SIGTERM the given processes (SIGTERM lets hivemind stop its DHT child), then SIGKILL stragglers."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_pid_alive(p) and not _zombie(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _pid_alive(pid) and not _zombie(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _run(argv: Sequence[str], *, check: bool = True, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise LabError(
            f"`{' '.join(argv)}` failed with exit code {proc.returncode}: {proc.stderr.strip() or proc.stdout}"
        )
    return proc


# ------------------------------------------------------------------------------------- the labs


class Lab:
    """What a benchmark needs from a lab: addresses, processes per node, rates and byte counters."""

    nodes: tuple[str, ...]
    shaped: bool
    """True when rates are enforced (a NetLab); False on loopback."""

    def address(self, node: str) -> str:
        raise NotImplementedError

    def spawn(
        self,
        node: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: Any = None,
        stderr: Any = None,
        cwd: str | None = None,
    ) -> subprocess.Popen:
        raise NotImplementedError

    def set_rate(self, rate: str, nodes: Sequence[str] | None = None) -> None:
        raise NotImplementedError

    def tx_bytes(self, node: str) -> int | None:
        """Bytes this node has sent on its link so far (frames, headers included); None if unknown."""
        raise NotImplementedError

    def env_for(self, node: str) -> dict[str, str]:
        """Extra environment a process on ``node`` needs (e.g. which interface gloo must use)."""
        raise NotImplementedError

    def stop(self, proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
        """Stop one process this lab spawned (SIGTERM, then SIGKILL after ``grace_s``); its exit code."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return proc.returncode

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoopbackLab(Lab):
    """Every node is 127.0.0.1 of this machine; no namespaces, no rate limits, no root needed."""

    shaped = False

    def __init__(self, nodes: Sequence[str]):
        self.nodes = tuple(_check_nodes(nodes))
        self._procs: list[subprocess.Popen] = []

    def address(self, node: str) -> str:
        _known(self.nodes, node)
        return "127.0.0.1"

    def spawn(self, node, argv, *, env=None, stdout=None, stderr=None, cwd=None) -> subprocess.Popen:
        _known(self.nodes, node)
        proc = subprocess.Popen(
            list(argv),
            env=dict(env) if env is not None else None,
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def set_rate(self, rate: str, nodes: Sequence[str] | None = None) -> None:
        if parse_rate(rate) is not None:
            raise LabError(
                f"rate {rate!r} cannot be enforced on loopback (no namespaces); run as root on Linux for the "
                "network lab, or use rate 'none'"
            )

    def tx_bytes(self, node: str) -> int | None:
        _known(self.nodes, node)
        return None

    def env_for(self, node: str) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": "lo"}

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                # Our own child's process group (start_new_session): also its hivemind DHT/p2pd children.
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
        self._procs.clear()


class NetLab(Lab):
    """One namespace per node on a private bridge, egress-shaped with tbf (see the module docstring).

    Use as a context manager; ``close()`` is idempotent and also runs on SIGINT, SIGTERM and at exit.
    """

    shaped = True

    def __init__(self, nodes: Sequence[str], *, rate: str = "none", subnet: str = "10.213.0"):
        self.nodes = tuple(_check_nodes(nodes))
        if len(self.nodes) > 250:
            raise ConfigError(f"{len(self.nodes)} nodes do not fit one /24; the lab holds at most 250")
        if not re.match(r"^10\.\d{1,3}\.\d{1,3}$", subnet):
            raise ConfigError(f"subnet {subnet!r} must be the first three octets of a 10.x.y.0/24 network")
        self.subnet = subnet
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.rates: dict[str, str] = {n: "none" for n in self.nodes}
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._closed = False
        self._old_handlers: dict[int, Any] = {}
        reason = lab_unavailable_reason(probe=False)
        if reason:
            raise LabError(reason)
        self._install_cleanup()
        try:
            self._build()
            self.set_rate(rate)
        except BaseException:
            self.close()
            raise

    # -- naming
    def ns(self, node: str) -> str:
        """The namespace name of ``node`` (``ip netns exec NAME ...`` enters it)."""
        _known(self.nodes, node)
        return f"{self.tag}-{node}"

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{2 + self.nodes.index(_known(self.nodes, node))}"

    # -- building
    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        # No IPv6: no router solicitations or DAD chatter on the counters, and no link-local route out.
        _run(
            ["ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"],
            check=False,
        )

    def _build(self) -> None:
        self._add_ns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        for i, node in enumerate(self.nodes):
            ns = self.ns(node)
            self._add_ns(ns)
            _run(
                [
                    "ip",
                    "-n",
                    self.hub,
                    "link",
                    "add",
                    f"v{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                ]
            )
            _run(["ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0"])
            _run(["ip", "-n", self.hub, "link", "set", f"v{i}", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    # -- rates
    def set_rate(self, rate: str, nodes: Sequence[str] | None = None) -> None:
        """Cap the egress of ``nodes`` (default: all) at ``rate``; 'none' removes the cap."""
        bits = parse_rate(rate)
        for node in nodes if nodes is not None else self.nodes:
            ns = self.ns(node)
            _run(["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"], check=False)
            if bits is not None:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", *_tbf_args(bits)])
            self.rates[node] = format_rate(rate)

    def tx_bytes(self, node: str) -> int | None:
        out = _run(["ip", "-n", self.ns(node), "-j", "-s", "link", "show", "dev", "eth0"]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def env_for(self, node: str) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": "eth0"}

    # -- processes
    def spawn(self, node, argv, *, env=None, stdout=None, stderr=None, cwd=None) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (``ip netns exec`` execs it: same pid)."""
        if self._closed:
            raise LabError(f"lab {self.tag} is closed; start a new one")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(node), *argv],
            env=dict(env) if env is not None else None,
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process running inside this lab's namespaces (ours, since only we enter them)."""
        out: list[int] = []
        for name in self._created:
            res = _run(["ip", "netns", "pids", name], check=False)
            out += [int(x) for x in res.stdout.split() if x.isdigit()]
        return out

    # -- teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            _stop_pids(self.pids(), grace_s=10.0)
            for proc in self._procs:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
            # Deleting a namespace deletes the veth ends inside it (and so their peers in the hub).
            for name in reversed(self._created):
                _run(["ip", "netns", "del", name], check=False)
            self._created.clear()
        finally:
            self._restore_handlers()

    def _install_cleanup(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still covers exit

        def handler(signum: int, frame: FrameType | None) -> None:
            self.close()
            previous = self._old_handlers.get(signum)
            if callable(previous):
                previous(signum, frame)
            elif signum == signal.SIGINT:
                raise KeyboardInterrupt
            else:
                raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers.clear()
        atexit.unregister(self.close)


def _check_nodes(nodes: Sequence[str]) -> list[str]:
    nodes = list(nodes)
    if not nodes:
        raise ConfigError("a lab needs at least one node name")
    for n in nodes:
        if not isinstance(n, str) or not _NODE_RE.match(n) or n == "hub":
            raise ConfigError(
                f"node name {n!r} is invalid: use 1-16 lowercase letters, digits or '_' (not 'hub')"
            )
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"node names {nodes} repeat; each node needs its own name")
    return nodes


def _known(nodes: tuple[str, ...], node: str) -> str:
    if node not in nodes:
        raise ConfigError(f"node {node!r} is not in this lab; its nodes are {list(nodes)}")
    return node


# ------------------------------------------------------------------------------ availability, stale


def lab_unavailable_reason(*, probe: bool = True) -> str | None:
    """None when the network lab can run here; otherwise why not, and what to do instead.

    With ``probe``, a throwaway namespace with a tbf qdisc is created and deleted, so that missing
    capabilities (a container without CAP_NET_ADMIN, a kernel without sch_tbf) show up here.
    """
    if sys.platform != "linux":
        return f"the network lab needs Linux network namespaces; this is {sys.platform}. Use --loopback."
    if os.geteuid() != 0:
        return (
            "the network lab needs root (it creates network namespaces and tc qdiscs); run as root, "
            "or pass --loopback to benchmark on 127.0.0.1 without rate limits"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; install iproute2 or use --loopback"
    if not probe:
        return None
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}-probe"
    try:
        _run(["ip", "netns", "add", name])
    except (LabError, subprocess.TimeoutExpired) as e:
        return f"network namespaces are refused here ({e}); use --loopback"
    try:
        _run(["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", *_tbf_args(20e6)])
    except (LabError, subprocess.TimeoutExpired) as e:
        return f"veth or tbf is not available here ({e}); use --loopback"
    finally:
        _run(["ip", "netns", "del", name], check=False)
    return None


def our_namespaces() -> list[str]:
    """Names of every namespace of our prefix on this machine (any owner)."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def clean_stale() -> list[str]:
    """Delete namespaces of our prefix whose owner process is gone (and stop what runs in them).

    Labs of live owners (another benchmark running right now) are left alone. Returns the names deleted.
    """
    removed = []
    for name in our_namespaces():
        m = re.match(rf"^{re.escape(PREFIX)}(\d+)-", name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        res = _run(["ip", "netns", "pids", name], check=False)
        _stop_pids([int(x) for x in res.stdout.split() if x.isdigit()], grace_s=5.0)
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    return removed


def open_lab(nodes: Sequence[str], *, loopback: bool, rate: str = "none") -> Lab:
    """A :class:`NetLab` (after cleaning stale ones), or a :class:`LoopbackLab` when ``loopback``."""
    if loopback:
        return LoopbackLab(nodes)
    reason = lab_unavailable_reason(probe=True)
    if reason:
        raise LabError(reason)
    clean_stale()
    return NetLab(nodes, rate=rate)


# ------------------------------------------------------------------------------------- transfers

_RECEIVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 16)
    if not b: break
    n += len(b)
c.sendall(b"k"); print(n, flush=True)
"""
_SENDER = """
import socket, sys, time
n = int(sys.argv[3]); s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120)
t = time.perf_counter(); s.sendall(bytes(n)); s.shutdown(socket.SHUT_WR); s.recv(1)
print(time.perf_counter() - t, flush=True)
"""


def measure_transfer(lab: Lab, src: str, dst: str, nbytes: int, *, timeout_s: float = 120.0) -> float:
    """Seconds for ``src`` to push ``nbytes`` over TCP to ``dst`` and get the receipt (plain sockets)."""
    recv = lab.spawn(
        dst,
        [sys.executable, "-c", _RECEIVER, lab.address(dst)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert recv.stdout is not None
        port = int(recv.stdout.readline())
        send = lab.spawn(
            src,
            [sys.executable, "-c", _SENDER, lab.address(dst), str(port), str(nbytes)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = send.communicate(timeout=timeout_s)
        if send.returncode != 0:
            raise LabError(f"transfer {src} -> {dst} failed: {err.decode().strip()}")
        received = int(recv.stdout.readline())
        if received != nbytes:
            raise LabError(f"transfer {src} -> {dst} delivered {received} of {nbytes} bytes")
        return float(out)
    finally:
        lab.stop(recv, grace_s=2.0)


# ------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.netlab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether the network lab can run on this machine")
    sub.add_parser("clean", help="delete namespaces of labs whose owner process died")
    st = sub.add_parser("selftest", help="rate-limited vs unlimited transfer between two namespaces")
    st.add_argument("--rate", default="20mbit")
    st.add_argument("--mib", type=int, default=4)
    args = parser.parse_args(argv)

    if args.cmd == "check":
        reason = lab_unavailable_reason(probe=True)
        print(reason or "the network lab can run here (root, ip netns, veth and tbf work)")
        return 1 if reason else 0
    if args.cmd == "clean":
        removed = clean_stale()
        print(f"removed {len(removed)} stale namespace(s)" + (": " + " ".join(removed) if removed else ""))
        return 0
    nbytes = args.mib << 20
    with open_lab(["a", "b"], loopback=False) as lab:
        free = measure_transfer(lab, "a", "b", nbytes)
        lab.set_rate(args.rate, ["a"])
        shaped = measure_transfer(lab, "a", "b", nbytes)
        print(
            f"{args.mib} MiB a -> b: unlimited {nbytes / free / 1e6:.1f} MB/s, "
            f"{format_rate(args.rate)} {nbytes / shaped / 1e6:.2f} MB/s "
            f"(nominal {parse_rate(args.rate) / 8e6:.2f} MB/s)"
        )  # type: ignore[operator]
    left = [n for n in our_namespaces() if n.startswith(lab.tag)]  # type: ignore[attr-defined]
    print("torn down" if not left else f"LEFT BEHIND: {left}")
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
