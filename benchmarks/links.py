"""The swarm over slow links vs ``torch.distributed.pipelining`` and one process, in one run.

Run (from the repository root, as root for the network lab; ``--loopback`` anywhere)::

    python -m benchmarks.links                 # full run (~55 min on 2 idle cores): results/links.json,
                                               # plots, and the "Links" section of BENCHMARKS.md
    python -m benchmarks.links --quick         # small model, 12 runs: 4 min on 2 cores (mostly start-up)
    python -m benchmarks.links --render links  # rewrite the Links section from results/links.json
    python -m benchmarks.links --loopback      # no namespaces, no rate limits (not root)
    python -m benchmarks.links --plan          # print what would run, run nothing

What runs (see :func:`plan`): every process in its own namespace of one lab (benchmarks/netlab.py):
a bootstrap node (``swarm init``), one stage peer per stage (``swarm peer --stage i``), the trainer
(``swarm train``); the pipelining ranks use the stage peers' namespaces. Each link's egress is capped
with tbf at the run's rate, the same for every node.

- throughput: at each rate, the swarm with its default codec (async mode), the subspace-constrained
  models (``subspace_ratios``, async, coefficients sent with the default codec), the swarm without
  compression (their reference, async) and pipelining with the
  GPipe and 1F1B schedules; at the ``sweep_rates`` (100mbit, 20mbit) and unshaped also every codec in
  both optimizer modes. Tokens/s = median over windows of ``pipe_n_micro`` micro-batches after warm-up
  (for pipelining a window is one optimizer step), so both sides are measured the same way.
- bytes on the wire per token: the lab's link counters (all nodes, frames with headers, DHT chatter
  included) over tokens trained; next to it the payload the trainer's metrics count.
- memory: peak resident memory (VmHWM) of each stage peer (main process; with its hivemind DHT child
  and p2pd as ``tree``), of the trainer, of each pipelining rank and of the single process.
- convergence: on unshaped links (rate ``none``) every codec in both optimizer modes, the same data
  (trainer seed 0) and token budget; loss against tokens and wall-clock, held-out loss at the end,
  tokens to reach a target loss, all against sync mode without compression; the same for the
  subspace models. Wall-clock to the target at each rate = tokens to target / that configuration's
  tokens/s at the rate (see ``analyse``).

Note [threads]: every stage process (stage peer or pipelining rank) gets cores / stages torch threads
(at least 1), so the stage processes of either system use the machine's cores once. The single process
runs twice, with 1 thread and with every core: on a busy machine a multi-threaded process can be far
slower than a single-threaded one (OpenMP threads wait for each other whenever another process holds
one of the cores), and the report shows both.

The benchmark run spec is the given spec (``examples/bench.yaml``) with, for every run:
``optimizer.accumulate`` (default 4: micro-batches per optimizer step, the same for sync and async)
and ``optimizer.warmup_steps`` (default 4: bench.yaml's 50 would cover the whole token budget), the
codec under test for activations and gradients, the optimizer mode, and a run id of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.markdown import MARKDOWN, write_section
from benchmarks.netlab import Lab, LabError, format_rate, lab_unavailable_reason, open_lab
from benchmarks.pipelining_baseline import ROOT, PipeConfig, _load_spec, peak_rss_bytes, run_pipelining
from benchmarks.report import cell as _f
from benchmarks.report import machine_info
from benchmarks.report import smooth as _smooth
from benchmarks.single_process import SingleConfig, run_single
from swarm.dht.processes import SOCKET_PREFIX_ENV, child_socket_prefix, remove_stale_sockets
from swarm.errors import ConfigError, SwarmError

__all__ = ["LinksConfig", "Job", "plan", "run_swarm", "analyse", "markdown_section", "main"]

RESULTS_DIR = ROOT / "benchmarks" / "results"
SECTION = "## Links"
_INITIAL = re.compile(r"initial peers: (\S+)")
_SERVING = re.compile(r"peer (\S+) serving stage (\d+) of run (\S+)")
ALL_CODECS = ("none", "fp16", "blockwise8", "blockwise4", "lowrank")

# The --quick model: the bench model's shape (4 stages, 2 sequences per micro-batch) at 1/4 width.
QUICK_MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128}


@dataclass(frozen=True, kw_only=True)
class LinksConfig:
    """One benchmark run. Units: micro-batches (mb) unless named otherwise."""

    spec_path: str = "examples/bench.yaml"
    """Base run spec; see the module docstring for what each run overrides."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Replace these ``model`` fields of the base spec (``--quick`` shrinks the model this way)."""
    rates: tuple[str, ...] = ("none", "100mbit", "20mbit", "5mbit")
    """Link rates of the throughput sweep (egress of every node)."""
    codecs: tuple[str, ...] = ALL_CODECS
    """Codecs of the codec sweep and of the convergence runs."""
    default_codec: str = "blockwise8"
    """The swarm's default codec (examples/bench.yaml), run at every rate."""
    sweep_rates: tuple[str, ...] = ("100mbit", "20mbit")
    """Shaped rates at which every codec in both optimizer modes is measured (unshaped, the convergence
    runs measure them all)."""
    subspace_ratios: tuple[int, ...] = (32, 100)
    """Subspace-constrained models (``model.subspace: {ratio: r}``, k = d_model / r numbers per token at a
    boundary, coefficients sent with the default codec): convergence in both modes, throughput (async)
    at every rate. Empty: none."""
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    """Pipelining schedules measured at every rate."""
    single_threads: tuple[int, ...] | None = None
    """Thread counts of the single-process runs; None = 1 and every core (see Note [threads])."""
    accumulate: int = 4
    """Micro-batches per optimizer step, in sync and async mode alike."""
    lr_warmup_steps: int = 4
    """Optimizer steps of LR warm-up (replaces the spec's)."""
    recompute: bool | None = None
    """Replace the spec's ``optimizer.recompute`` (None: keep it)."""
    throughput_mb: int = 24
    """Micro-batches per throughput run (warm-up included)."""
    warmup_mb: int = 8
    """Micro-batches left out of throughput medians."""
    convergence_mb: int = 192
    """Micro-batches per convergence run (the token budget), on unshaped links."""
    target_fraction: float = 0.5
    """The target loss is the reference's (sync, uncompressed) smoothed training loss after this fraction
    of the budget: early enough that slower-converging modes reach it too, so that tokens and seconds
    to the target compare every mode (their final losses are compared separately)."""
    pipe_n_micro: int = 8
    """Micro-batches per pipelining step (its throughput window; also the swarm's window)."""
    pipe_fused_adamw: bool = False
    """The pipelining ranks step with ``torch.optim.AdamW(fused=True)`` (``PipeConfig.fused_adamw``)."""
    max_inflight: int = 8
    """Micro-batches the swarm trainer keeps in flight (async)."""
    threads: int | None = None
    """torch threads per stage process (peer or rank); None = cores / stages, at least 1."""
    loopback: bool = False
    """Run without namespaces (no rates other than none)."""
    data_bytes: int | None = None
    """Text read by trainers and baselines (None = swarm.train.data's default)."""
    start_timeout_s: float = 240.0
    run_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("accumulate", "throughput_mb", "convergence_mb", "pipe_n_micro", "max_inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be at least 1")
        if not 0 <= self.warmup_mb < self.throughput_mb:
            raise ConfigError(
                f"warmup_mb = {self.warmup_mb} must be below throughput_mb = {self.throughput_mb}; "
                "raise --throughput-mb or lower the warm-up"
            )
        for name in ("throughput_mb", "convergence_mb"):
            if getattr(self, name) % self.accumulate:
                raise ConfigError(
                    f"{name} = {getattr(self, name)} must be a multiple of accumulate = {self.accumulate} "
                    "(a trainer runs whole optimizer steps)"
                )
        for r in (*self.rates, *self.sweep_rates):
            format_rate(r)  # raises ConfigError on a bad rate
        for r in self.subspace_ratios:
            if not isinstance(r, int) or r < 1:
                raise ConfigError(
                    f"subspace ratio {r!r} must be a whole number >= 1 (k = d_model / ratio), e.g. 32"
                )
        if self.loopback and any(format_rate(r) != "none" for r in self.rates):
            raise ConfigError(
                f"rates {list(self.rates)} need the network lab; with --loopback only 'none' is possible"
            )


@dataclass(frozen=True)
class Job:
    """One measured run: ``kind`` swarm | pipelining | single."""

    kind: str
    rate: str = "none"
    codec: str | None = None
    mode: str | None = None
    """sync | async (swarm)."""
    schedule: str | None = None
    """gpipe | 1f1b (pipelining)."""
    micro_batches: int = 0
    purposes: tuple[str, ...] = ()
    """throughput, codecs, modes, convergence, memory."""
    threads: int | None = None
    """torch threads (single process only; see Note [threads])."""
    subspace: int | None = None
    """swarm: the model's ``subspace`` ratio (k = d_model / subspace), None = an ordinary model."""

    @property
    def label(self) -> str:
        """What crosses a boundary: the codec, or the subspace coefficients and their codec."""
        return subspace_label(self.codec, self.subspace)

    @property
    def name(self) -> str:
        if self.kind == "swarm":
            return f"swarm {self.label} {self.mode} @ {self.rate}"
        if self.kind == "pipelining":
            return f"pipelining {self.schedule} @ {self.rate}"
        return f"single process, {self.threads} thread(s)"


def subspace_label(codec: str | None, subspace: int | None) -> str:
    return f"subspace d/{subspace} + {codec}" if subspace else str(codec)


def plan(cfg: LinksConfig) -> list[Job]:
    """Every run of the benchmark, in order (pure; ``--plan`` prints it).

    Convergence runs (every codec x both modes, unshaped) double as the unshaped throughput points of
    the swarm, so the swarm has one run per (codec, mode, rate) at most.
    """
    rates = [format_rate(r) for r in cfg.rates]
    sweeps = {format_rate(r) for r in cfg.sweep_rates}
    dc = cfg.default_codec
    jobs: dict[tuple, Job] = {}

    def add(job: Job) -> None:
        key = (job.kind, job.rate, job.codec, job.mode, job.schedule, job.subspace)
        old = jobs.get(key)
        if old is None:
            jobs[key] = job
        else:
            jobs[key] = replace(
                old,
                micro_batches=max(old.micro_batches, job.micro_batches),
                purposes=tuple(dict.fromkeys(old.purposes + job.purposes)),
            )

    for threads in dict.fromkeys(cfg.single_threads or (1, os.cpu_count() or 1)):
        jobs[("single", threads)] = Job(
            "single", micro_batches=cfg.throughput_mb, purposes=("throughput", "memory"), threads=threads
        )
    for codec, ratio in [*((c, None) for c in cfg.codecs), *((dc, r) for r in cfg.subspace_ratios)]:
        for mode in ("sync", "async"):
            add(
                Job(
                    "swarm",
                    "none",
                    codec,
                    mode,
                    micro_batches=cfg.convergence_mb,
                    purposes=("convergence",),
                    subspace=ratio,
                )
            )
    for rate in rates:
        for schedule in cfg.schedules:
            add(
                Job(
                    "pipelining",
                    rate,
                    schedule=schedule,
                    micro_batches=_pipe_steps(cfg) * cfg.pipe_n_micro,
                    purposes=("throughput", "memory"),
                )
            )
        # the default codec, the subspace models, and (their reference) the uncompressed swarm
        for codec, ratio in ((dc, None), *((dc, r) for r in cfg.subspace_ratios), ("none", None)):
            add(
                Job(
                    "swarm",
                    rate,
                    codec,
                    "async",
                    micro_batches=cfg.throughput_mb,
                    purposes=("throughput",),
                    subspace=ratio,
                )
            )
        if rate in sweeps:
            for codec in cfg.codecs:
                for mode in ("sync", "async"):
                    add(
                        Job(
                            "swarm",
                            rate,
                            codec,
                            mode,
                            micro_batches=cfg.throughput_mb,
                            purposes=("codecs", "modes"),
                        )
                    )
    add(
        Job(
            "swarm", "none", cfg.default_codec, "async", micro_batches=cfg.throughput_mb, purposes=("memory",)
        )
    )
    add(
        Job("swarm", "none", cfg.default_codec, "sync", micro_batches=cfg.throughput_mb, purposes=("memory",))
    )
    # Unshaped runs first (convergence, the reference throughput), then by falling rate.
    order = {r: i for i, r in enumerate(sorted(set(rates) | {"none"}, key=_rate_key))}
    return sorted(
        jobs.values(),
        key=lambda j: (
            order.get(j.rate, 0),
            j.kind != "single",
            j.kind,
            j.codec or "",
            j.subspace or 0,
            j.mode or "",
            j.schedule or "",
        ),
    )


def _pipe_steps(cfg: LinksConfig) -> int:
    """Pipelining steps covering ``throughput_mb`` micro-batches (at least 2: one warm-up, one measured)."""
    return max(2, -(-cfg.throughput_mb // cfg.pipe_n_micro))


def _rate_key(rate: str) -> float:
    from benchmarks.netlab import parse_rate

    bits = parse_rate(rate)
    return -(bits if bits is not None else float("inf"))


# ------------------------------------------------------------------------------------- run specs


def base_spec_dict(cfg: LinksConfig) -> dict[str, Any]:
    """The benchmark's spec as a plain dict (before per-run codec, mode and run id)."""
    path = cfg.spec_path if os.path.isabs(cfg.spec_path) else str(ROOT / cfg.spec_path)
    data = json.loads(json.dumps(_load_spec(path).to_dict()))
    if cfg.model_overrides:
        data["model"].update(cfg.model_overrides)
        data["stages"] = len(data["stages"])  # the same number of stages, split over the new depth
    data["optimizer"]["accumulate"] = cfg.accumulate
    data["optimizer"]["warmup_steps"] = cfg.lr_warmup_steps
    if cfg.recompute is not None:
        data["optimizer"]["recompute"] = cfg.recompute
    return data


def pipelining_spec(cfg: LinksConfig) -> Any:
    """The base spec the pipelining ranks and the single process train (a ``RunSpec``): the benchmark
    spec with its overrides, uncompressed (they send fp32 tensors), run id ``links-base``."""
    from swarm.run.spec import RunSpec

    base = base_spec_dict(cfg)
    base.update(run_id="links-base", codecs={"activations": "none", "gradients": "none"})
    return RunSpec.from_dict(base)


def write_spec(
    cfg: LinksConfig, work: Path, run_id: str, codec: str, mode: str, subspace: int | None = None
) -> Path:
    """A YAML spec for one swarm run (``swarm init`` reads YAML); validated by loading it back."""
    import yaml

    from swarm.run.spec import RunSpec

    data = base_spec_dict(cfg)
    data["run_id"] = run_id
    data["codecs"] = {"activations": codec, "gradients": codec}
    data["optimizer"]["mode"] = mode
    if subspace:
        data["model"]["subspace"] = {"ratio": subspace}
    path = work / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=True))
    RunSpec.from_yaml(path)
    return path


# ---------------------------------------------------------------------------------------- memory


class PeakWatcher:
    """Samples VmHWM of processes and their descendants every ``interval_s`` while they live.

    VmHWM is the kernel's own high-water mark, so sampling only has to catch each process alive once
    (children like the hivemind DHT process may exit with their parent; their last sample stays). Every
    2 s, not faster: each sample walks every process of the swarm, and at 0.5 s the watcher took 0.013
    of the 2 cores the measured swarm shares with it (a /proc sample of a 144-micro-batch timeline run).
    A sample reads the process table once for all roots (``family``): one walk per root cost 0.006 cores
    at 2 s, on the swarm's side of the timeline benchmark only (session 20, ``cpu_by_process --window``).
    """

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self._roots: dict[str, int] = {}
        self.main: dict[str, int] = {}
        self.tree: dict[str, dict[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peak-watcher", daemon=True)
        self._lock = threading.Lock()

    def watch(self, name: str, pid: int) -> None:
        with self._lock:
            self._roots[name] = pid
        self.sample()

    def start(self) -> PeakWatcher:
        self._thread.start()
        return self

    def sample(self) -> None:
        with self._lock:
            roots = dict(self._roots)
        below = family(list(roots.values()), parents())
        for name, pid in roots.items():
            for p in [pid, *below[pid]]:
                hwm = peak_rss_bytes(p)
                if hwm is None:
                    continue
                self.tree.setdefault(name, {})[p] = max(hwm, self.tree.get(name, {}).get(p, 0))
                if p == pid:
                    self.main[name] = max(hwm, self.main.get(name, 0))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def report_mb(self) -> dict[str, dict[str, float]]:
        return {
            name: {
                "main": self.main.get(name, 0) / 2**20,
                "tree": sum(self.tree.get(name, {}).values()) / 2**20,
            }
            for name in self._roots
        }


def parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process, from one walk of the process table (empty without psutil)."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info.get("ppid")
        if ppid is not None:
            out[proc.pid] = ppid
    return out


def family(roots: list[int], parent_of: dict[int, int]) -> dict[int, list[int]]:
    """For each pid of ``roots``, the pids of every process below it in ``parent_of`` (pure)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for root in roots:
        below, todo = [], list(children.get(root, []))
        while todo:
            pid = todo.pop()
            below.append(pid)
            todo.extend(children.get(pid, []))
        out[root] = below
    return out


def descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid`` (none when psutil is missing or the process is gone)."""
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 (psutil missing or the process is gone: no children to sample)
        return []


# -------------------------------------------------------------------------------------- the swarm


def _wait_for(
    path: Path, pattern: re.Pattern, proc: subprocess.Popen, timeout_s: float, what: str
) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        m = pattern.search(text)
        if m:
            return m
        if proc.poll() is not None:
            raise SwarmError(
                f"{what} exited with code {proc.returncode} before it was ready; {path} ends with:\n"
                + text[-2000:]
            )
        if time.monotonic() > deadline:
            raise SwarmError(
                f"{what} was not ready after {timeout_s:.0f} s; {path} ends with:\n" + text[-2000:]
            )
        time.sleep(0.2)


def socket_prefix() -> str:
    """The hivemind socket-file prefix of this benchmark's swarm processes: what processes stopped with
    SIGKILL leave is removed after each run (:func:`swarm.dht.processes.remove_stale_sockets`), and only that."""
    return child_socket_prefix("links")


def start_bootstrap(lab: Lab, node: str, work: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """A plain bootstrap node (``swarm init`` without a run) on ``node``; its process and address."""
    log_path = work / "bootstrap.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HIVEMIND_LOGLEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
        SOCKET_PREFIX_ENV: socket_prefix(),
    }
    with open(log_path, "wb") as log:
        proc = lab.spawn(
            node,
            [
                sys.executable,
                "-m",
                "swarm.cli",
                "init",
                "--host-maddrs",
                f"/ip4/{lab.address(node)}/tcp/0",
                "--status-interval-s",
                "600",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )
    return proc, _wait_for(log_path, _INITIAL, proc, timeout_s, "the bootstrap node").group(1)


def run_swarm(
    lab: Lab,
    cfg: LinksConfig,
    job: Job,
    work: Path,
    nodes: dict[str, Any],
    boot_maddr: str | None = None,
    idle_s: float = 0.0,
    keeper: bool = True,
    probe: Callable[[], Any] | None = None,
    *,
    eval_every: int | None = None,
    eval_batches: int | None = None,
    stop_when: Callable[[list[dict[str, Any]]], bool] | None = None,
    timeline_dir: Path | None = None,
    trainer_args: Sequence[str] = (),
) -> dict[str, Any]:
    """One swarm run in ``lab``: its spec published by ``swarm init``, one peer per stage, one trainer.

    ``nodes``: {"boot": node, "trainer": node, "stages": [node per stage]}. With ``boot_maddr`` (a
    long-lived plain bootstrap node, see :func:`start_bootstrap`) the run's ``swarm init`` joins it and
    starts together with the peers and the trainer (they wait for the spec in the DHT), which saves a
    serial process start per run; without, ``swarm init`` is the bootstrap and starts first. With
    ``idle_s`` the peers stay up that long after the trainer ended and the result adds each node's
    bytes per second while nothing trains (``idle_tx_bytes_per_s_by_node``: the background traffic).
    ``keeper=False`` runs ``swarm init`` without its keeper (no stage snapshots downloaded). ``probe()``,
    if given, is called where the link counters are read (start and end of training, end of the idle
    time); its answers are in the result as ``probes`` (e.g. per-connection byte counters).

    The trainer evaluates held-out loss every ``eval_every`` steps (None: once, at the end) on
    ``eval_batches`` micro-batches (None: its default). ``stop_when(records)`` is asked every half
    second with the trainer's metrics.jsonl records so far; once it is true the trainer gets SIGTERM (it
    stops like Ctrl-C: drops what is in flight, writes its summary) and the run ends there
    (``result["stopped_early"]``). With ``timeline_dir`` every peer writes its timeline there
    (``peer<i>.jsonl``, note "timeline" in peer/timeline.py; read by benchmarks/timeline.py).
    ``trainer_args`` go to ``swarm train`` after the others (e.g. ``--fixed-inflight``).
    """
    sub = f"-ss{job.subspace}" if job.subspace else ""
    run_id = f"links-{job.codec.split(':')[0]}{sub}-{job.mode}-{job.rate}-{os.getpid()}"
    spec_path = write_spec(cfg, work, run_id, job.codec, job.mode, job.subspace)
    from swarm.run.spec import RunSpec

    spec = RunSpec.from_yaml(spec_path)
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // spec.num_stages)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HIVEMIND_LOGLEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        SOCKET_PREFIX_ENV: socket_prefix(),
    }
    py = [sys.executable, "-m", "swarm.cli"]
    procs: list[subprocess.Popen] = []
    logs: list[Any] = []
    watcher = PeakWatcher().start()

    def spawn(node: str, argv: list[str], log_name: str) -> tuple[subprocess.Popen, Path]:
        path = work / f"{run_id}-{log_name}.log"
        f = open(path, "wb")  # noqa: SIM115 (closed in finally)
        logs.append(f)
        f.write(("$ " + " ".join(argv) + "\n").encode())
        f.flush()
        proc = lab.spawn(node, argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT))
        procs.append(proc)
        return proc, path

    def listen(node: str) -> list[str]:
        return ["--host-maddrs", f"/ip4/{lab.address(node)}/tcp/0"]

    stages = nodes["stages"]
    out_dir = work / f"{run_id}-out"
    keeper_dir = work / f"{run_id}-snapshots"  # the run's keeper (swarm init's): not in the repository
    t_start = time.perf_counter()
    try:
        join = ["--initial-peers", boot_maddr] if boot_maddr else []
        boot, boot_log = spawn(
            nodes["boot"],
            [*py, "init", str(spec_path), *join, *listen(nodes["boot"]), "--status-interval-s", "30"]
            + (["--keeper-dir", str(keeper_dir)] if keeper else ["--no-keeper"]),
            "init",
        )
        maddr = boot_maddr or _wait_for(boot_log, _INITIAL, boot, cfg.start_timeout_s, "swarm init").group(1)
        peers = []
        for i in range(spec.num_stages):
            proc, path = spawn(
                stages[i],
                [
                    *py,
                    "peer",
                    "--initial-peers",
                    maddr,
                    "--run",
                    run_id,
                    "--stage",
                    str(i),
                    *listen(stages[i]),
                    "--throughput",
                    "1000",
                    "--no-rebalance",
                    *(["--timeline", str(timeline_dir / f"peer{i}.jsonl")] if timeline_dir else []),
                ],
                f"peer{i}",
            )
            peers.append((proc, path))
            watcher.watch(f"peer{i}", proc.pid)
        # The trainer starts with the peers (it waits for every stage by itself): its metrics' clock
        # starts at its first micro-batch, and the warm-up micro-batches cover the rest of the start.
        steps = job.micro_batches // cfg.accumulate
        train_argv = [
            *py,
            "train",
            "--initial-peers",
            maddr,
            "--run",
            run_id,
            "--steps",
            str(steps),
            "--out",
            str(out_dir),
            "--eval-every",
            str(eval_every or steps),
            *(["--eval-batches", str(eval_batches)] if eval_batches else []),
            "--seed",
            "0",
            "--quiet",
            "--max-inflight",
            str(cfg.max_inflight),
            *listen(nodes["trainer"]),
        ]
        if cfg.data_bytes is not None:
            train_argv += ["--max-data-bytes", str(cfg.data_bytes)]
        train_argv += list(trainer_args)
        trainer, trainer_log = spawn(nodes["trainer"], train_argv, "trainer")
        for i, (proc, path) in enumerate(peers):
            _wait_for(path, _SERVING, proc, cfg.start_timeout_s, f"stage peer {i}")
        if boot.poll() is not None:
            raise SwarmError(f"swarm init exited with {boot.returncode}:\n{boot_log.read_text()[-2000:]}")
        t_online = time.perf_counter()
        # Counters from here: the trainer has at most fetched the spec; every micro-batch is still ahead.
        tx0 = {n: lab.tx_bytes(n) for n in [nodes["boot"], nodes["trainer"], *stages]}
        probes = [probe()] if probe else []
        watcher.watch("trainer", trainer.pid)
        stopped = _wait_trainer(trainer, out_dir / "metrics.jsonl", cfg.run_timeout_s, stop_when, job.name)
        watcher.sample()
        tx1 = {n: lab.tx_bytes(n) for n in tx0}
        probes += [probe()] if probe else []
        t_trained = time.perf_counter()
        idle, idle_window_s = None, 0.0
        if idle_s > 0 and wire_known(tx0):
            time.sleep(idle_s)
            idle_window_s = time.perf_counter() - t_trained
            idle = {n: (lab.tx_bytes(n) - tx1[n]) / idle_window_s for n in tx0}
            probes += [probe()] if probe else []
        if trainer.returncode != 0 and not (stopped and trainer.returncode == 130):
            raise SwarmError(
                f"{job.name}: trainer exited with {trainer.returncode}:\n"
                + trainer_log.read_text(errors="replace")[-2000:]
            )
    finally:
        watcher.stop()
        for proc in procs:  # all at once: each peer takes seconds to leave the DHT cleanly
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            lab.stop(proc, grace_s=10.0)
        for f in logs:
            f.close()
        stale = remove_stale_sockets(socket_prefix())  # of processes that needed SIGKILL
    memory = watcher.report_mb()
    records = read_records(out_dir / "metrics.jsonl")
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    tokens_per_mb = spec.micro_batch_size * spec.model.seq_len
    result = swarm_figures(
        records, summary, tokens_per_mb=tokens_per_mb, warmup_mb=cfg.warmup_mb, window_mb=cfg.pipe_n_micro
    )
    tokens = result["tokens"] or 1
    wire = None if not wire_known(tx0) else sum(tx1[n] - tx0[n] for n in tx0) / tokens
    result.update(
        {
            "kind": "swarm",
            "rate": job.rate,
            "codec": job.codec,
            "subspace": job.subspace,
            "subspace_rank": spec.model.subspace_rank,
            "label": job.label,
            "mode": job.mode,
            "purposes": list(job.purposes),
            "micro_batches": job.micro_batches,
            "threads_per_peer": threads,
            "startup_s": t_online - t_start,
            "stopped_early": stopped,
            "stale_sockets_removed": len(stale),
            "wire_bytes_per_token": wire,
            "wire_bytes_per_token_by_node": None
            if wire is None
            else {n: (tx1[n] - tx0[n]) / tokens for n in tx0},
            "peak_rss_mb": {name: m for name, m in memory.items()},
            "measured_s": t_trained - t_online,
            # what the keeper downloaded and kept (stage snapshots, state downloads from the peers)
            "keeper_snapshot_bytes": sum(f.stat().st_size for f in keeper_dir.rglob("*") if f.is_file()),
            "idle_tx_bytes_per_s_by_node": idle,
            "idle_s": idle_window_s,
            "probes": probes,
        }
    )
    return result


def wire_known(tx: dict[str, int | None]) -> bool:
    """Whether the lab counts every node's bytes (a loopback lab counts none)."""
    return all(v is not None for v in tx.values())


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a trainer's metrics.jsonl (one being written may end in a partial line)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _wait_trainer(
    trainer: subprocess.Popen,
    metrics: Path,
    timeout_s: float,
    stop_when: Callable[[list[dict[str, Any]]], bool] | None,
    name: str,
) -> bool:
    """Wait for the trainer to exit; True if ``stop_when`` stopped it (SIGTERM) first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            trainer.wait(0.5 if stop_when else timeout_s)
            return False
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            raise SwarmError(f"{name}: the trainer did not finish within {timeout_s} s")
        if stop_when is not None and stop_when(read_records(metrics)):
            trainer.send_signal(signal.SIGTERM)
            try:
                trainer.wait(60)
            except subprocess.TimeoutExpired:
                raise SwarmError(f"{name}: the trainer did not stop within 60 s of SIGTERM") from None
            return True


def swarm_figures(
    records: list[dict[str, Any]],
    summary: dict[str, Any],
    *,
    tokens_per_mb: int,
    warmup_mb: int,
    window_mb: int,
) -> dict[str, Any]:
    """Throughput, loss curve and bytes from a trainer's ``metrics.jsonl`` records and summary (pure).

    Tokens/s: the step records after ``warmup_mb`` micro-batches are cut into windows of at least
    ``window_mb`` micro-batches; each window's rate is tokens / seconds between its end and the end of
    the previous window; the median of those rates. With fewer than one window, the whole post-warm-up
    rate. ``tokens_per_s_overall`` is always the whole post-warm-up rate (slow windows included, e.g. one
    in which the keeper downloaded the stages).
    """
    steps = [r for r in records if r.get("type") == "step" and r.get("tokens") is not None]
    evals = [r for r in records if r.get("type") == "eval" and r.get("eval_loss") is not None]
    warm_tokens = warmup_mb * tokens_per_mb
    window = window_mb * tokens_per_mb
    rates: list[float] = []
    start = next((r for r in steps if r["tokens"] >= warm_tokens), None)
    if start is not None:
        mark = start
        for r in steps:
            if r["tokens"] - mark["tokens"] >= window and r["time"] > mark["time"]:
                rates.append((r["tokens"] - mark["tokens"]) / (r["time"] - mark["time"]))
                mark = r
    overall = None  # every token after warm-up over all of its time: the windows' slow ones included
    if start is not None and steps[-1]["time"] > start["time"]:
        overall = (steps[-1]["tokens"] - start["tokens"]) / (steps[-1]["time"] - start["time"])
        if not rates:
            rates.append(overall)
    mb = summary.get("micro_batches", {})
    return {
        "tokens": steps[-1]["tokens"] if steps else 0,
        "tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_per_s_overall": overall,
        "window_rates": rates,
        "train_s": steps[-1]["time"] if steps else None,
        "losses": [{"tokens": r["tokens"], "wall_s": r["time"], "loss": r.get("loss")} for r in steps],
        "evals": [
            {
                "step": r.get("step"),
                "tokens": r.get("tokens"),
                "wall_s": r.get("time"),
                "eval_loss": r["eval_loss"],
                "eval_s": r.get("eval_s"),
                "paused": bool(r.get("paused")),
            }
            for r in evals
            if r.get("tokens") is not None and r.get("time") is not None
        ],
        "first_send_s": _first_send(steps),
        "eval_loss": evals[-1]["eval_loss"] if evals else summary.get("eval_loss_last"),
        "payload_bytes_per_token": summary.get("bytes_per_token"),
        "uncompressed_bytes_per_token": summary.get("uncompressed_bytes_per_token"),
        "completed": mb.get("completed"),
        "dropped": mb.get("dropped"),
        "retries": mb.get("retries"),
    }


def _first_send(steps: list[dict[str, Any]]) -> float | None:
    """Seconds from the trainer's start to its first micro-batch, from the first step record (its
    ``tokens_per_s`` counts from the first send); None without a usable record."""
    r = next((r for r in steps if r.get("tokens") and r.get("tokens_per_s")), None)
    return None if r is None else max(0.0, r["time"] - r["tokens"] / r["tokens_per_s"])


# -------------------------------------------------------------------------------------- analysis


def tokens_to_target(losses: list[dict[str, Any]], target: float) -> int | None:
    """Tokens at which the smoothed training loss first reaches ``target`` (None if it never does)."""
    pts = [p for p in losses if p.get("loss") is not None]
    sm = _smooth([p["loss"] for p in pts])
    return next((p["tokens"] for p, v in zip(pts, sm, strict=True) if v <= target), None)


def _final(losses: list[dict[str, Any]], k: int = 3) -> float | None:
    vals = [p["loss"] for p in losses if p.get("loss") is not None]
    return sum(vals[-k:]) / len(vals[-k:]) if vals else None


def _find(results: list[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
    for r in results:
        if r.get("error") is None and all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def analyse(cfg: LinksConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios for the issue's targets, the convergence table and wall-clock to the target loss at each
    rate, from one run's results (pure)."""
    dc = cfg.default_codec
    rates = [format_rate(r) for r in cfg.rates]
    out: dict[str, Any] = {"targets": {}, "convergence": {}, "time_to_target": {}}
    t = out["targets"]

    def tps(**kw: Any) -> float | None:
        if kw.get("kind") == "swarm":
            kw.setdefault("subspace", None)
        r = _find(results, **kw)
        return r.get("tokens_per_s") if r else None

    swarm_free = tps(kind="swarm", codec=dc, mode="async", rate="none")
    for rate in rates:
        t[f"swarm_{dc}_vs_1f1b@{rate}"] = _ratio(
            tps(kind="swarm", codec=dc, mode="async", rate=rate),
            tps(kind="pipelining", schedule="1f1b", rate=rate),
        )
        t[f"swarm_{dc}_vs_own_unshaped@{rate}"] = _ratio(
            tps(kind="swarm", codec=dc, mode="async", rate=rate), swarm_free
        )
    t["target_3x_1f1b_at_20mbit"] = t.get(f"swarm_{dc}_vs_1f1b@20mbit")
    t["target_0.9_own_at_100mbit"] = t.get(f"swarm_{dc}_vs_own_unshaped@100mbit")
    t["target_0.9_pipelining_unshaped"] = t.get(f"swarm_{dc}_vs_1f1b@none")
    t["swarm_vs_single_process_1_thread"] = _ratio(swarm_free, tps(kind="single", threads=1))
    # Memory: stage peers (main process) per mode, unshaped default codec.
    sync = _find(results, kind="swarm", codec=dc, mode="sync", rate="none", subspace=None)
    asyn = _find(results, kind="swarm", codec=dc, mode="async", rate="none", subspace=None)
    pipe = _find(results, kind="pipelining", schedule="1f1b", rate="none")

    def peer_peak(r: dict[str, Any] | None, key: str = "main") -> float | None:
        if not r:
            return None
        vals = [v[key] for k, v in r["peak_rss_mb"].items() if k.startswith("peer") and v.get(key)]
        return max(vals) if vals else None

    pipe_peak = max(pipe["peak_rss_mb"]) if pipe and all(pipe["peak_rss_mb"]) else None
    t["memory_async_vs_sync_peer"] = _ratio(peer_peak(asyn), peer_peak(sync))
    t["memory_async_peer_vs_pipelining_rank"] = _ratio(peer_peak(asyn), pipe_peak)
    t["memory_async_peer_tree_vs_pipelining_rank"] = _ratio(peer_peak(asyn, "tree"), pipe_peak)

    # Convergence: same data and budget, unshaped; reference = sync without compression.
    base = _find(
        results,
        kind="swarm",
        codec="none",
        mode="sync",
        rate="none",
        micro_batches=cfg.convergence_mb,
        subspace=None,
    )
    conv = out["convergence"]
    ttt = out["time_to_target"]
    if base:
        pts = [p for p in base["losses"] if p.get("loss") is not None]
        sm = _smooth([p["loss"] for p in pts])
        target = sm[max(0, int(len(sm) * cfg.target_fraction) - 1)] if sm else None
        conv["target_loss"] = target
        conv["target_rule"] = (
            f"the reference's (none sync) smoothed (3-step) training loss after {cfg.target_fraction:g} of the "
            "token budget"
        )
        for r in results:
            if (
                r.get("kind") != "swarm"
                or r.get("rate") != "none"
                or r.get("micro_batches") != cfg.convergence_mb
            ):
                continue
            if r.get("error"):
                continue
            key = f"{subspace_label(r['codec'], r.get('subspace'))} {r['mode']}"
            tokens = tokens_to_target(r["losses"], target) if target is not None else None
            conv[key] = {
                "final_train_loss": _final(r["losses"]),
                "eval_loss": r.get("eval_loss"),
                "eval_vs_reference": _ratio(r.get("eval_loss"), base.get("eval_loss")),
                "train_vs_reference": _ratio(_final(r["losses"]), _final(base["losses"])),
                "tokens_to_target": tokens,
                "wall_s_to_target": _wall_at(r["losses"], tokens),
                "tokens_per_s": r.get("tokens_per_s"),
            }
            # Wall-clock to the target at each rate = tokens to target (this unshaped run: same data and
            # schedule) / the same configuration's tokens/s measured at that rate.
            ttt[key] = {}
            for rate in rates:
                rate_tps = tps(
                    kind="swarm", codec=r["codec"], mode=r["mode"], rate=rate, subspace=r.get("subspace")
                )
                ttt[key][rate] = {
                    "tokens_per_s": rate_tps,
                    "s_to_target": tokens / rate_tps if tokens is not None and rate_tps else None,
                }
        # torch pipelining is synchronous and uncompressed: it needs the reference's tokens to target.
        ref_tokens = (conv.get("none sync") or {}).get("tokens_to_target")
        for schedule in cfg.schedules:
            key = f"torch pipelining {schedule}"
            ttt[key] = {}
            for rate in rates:
                rate_tps = tps(kind="pipelining", schedule=schedule, rate=rate)
                ttt[key][rate] = {
                    "tokens_per_s": rate_tps,
                    "s_to_target": ref_tokens / rate_tps if ref_tokens is not None and rate_tps else None,
                }
        t[f"convergence_{dc}_sync_within_1pct"] = (conv.get(f"{dc} sync") or {}).get("eval_vs_reference")
        t["convergence_async_vs_sync_none"] = (conv.get("none async") or {}).get("eval_vs_reference")
        t[f"convergence_{dc}_async_vs_sync_{dc}"] = _ratio(
            (conv.get(f"{dc} async") or {}).get("eval_loss"), (conv.get(f"{dc} sync") or {}).get("eval_loss")
        )
        for ratio in cfg.subspace_ratios:
            label = subspace_label(dc, ratio)
            for mode in ("sync", "async"):
                t[f"subspace_d/{ratio}_{mode}_loss_vs_none_{mode}"] = _ratio(
                    (conv.get(f"{label} {mode}") or {}).get("eval_loss"),
                    (conv.get(f"none {mode}") or {}).get("eval_loss"),
                )
            for rate in rates:
                mine = ((ttt.get(f"{label} async") or {}).get(rate) or {}).get("s_to_target")
                for other in ("none async", "none sync", f"{dc} async"):
                    theirs = ((ttt.get(other) or {}).get(rate) or {}).get("s_to_target")
                    t[f"subspace_d/{ratio}_time_to_target_speedup_vs_{other.replace(' ', '_')}@{rate}"] = (
                        _ratio(theirs, mine)
                    )
    return out


def _wall_at(losses: list[dict[str, Any]], tokens: int | None) -> float | None:
    if tokens is None:
        return None
    return next((p["wall_s"] for p in losses if p["tokens"] == tokens), None)


# ----------------------------------------------------------------------------------------- plots


def plot(
    cfg: LinksConfig, results: list[dict[str, Any]], prefix: str, results_dir: Path = RESULTS_DIR
) -> list[str]:
    """PNG plots next to the JSON: throughput vs rate, loss vs tokens and vs wall-clock."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []
    rates = [format_rate(r) for r in cfg.rates]
    xs = list(range(len(rates)))
    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    dc = cfg.default_codec
    series = [
        (f"swarm {dc} async", {"kind": "swarm", "codec": dc, "mode": "async", "subspace": None}),
        ("swarm none async", {"kind": "swarm", "codec": "none", "mode": "async", "subspace": None}),
        *(
            (
                f"swarm {subspace_label(dc, r)} async",
                {"kind": "swarm", "codec": dc, "mode": "async", "subspace": r},
            )
            for r in cfg.subspace_ratios
        ),
        ("pipelining 1F1B", {"kind": "pipelining", "schedule": "1f1b"}),
        ("pipelining GPipe", {"kind": "pipelining", "schedule": "gpipe"}),
    ]
    for label, kw in series:
        ys = []
        for rate in rates:
            r = _find(results, rate=rate, **kw)
            ys.append(r["tokens_per_s"] if r and r.get("tokens_per_s") else float("nan"))
        ax.plot(xs, ys, marker="o", label=label)
    for single, style in zip(
        [r for r in results if r.get("kind") == "single" and r.get("tokens_per_s")], ("--", ":"), strict=False
    ):
        ax.axhline(
            single["tokens_per_s"],
            color="grey",
            linestyle=style,
            label=f"one process, {single['threads']} thread(s), no network",
        )
    ax.set_xticks(xs, rates)
    ax.set_xlabel("egress rate of every node")
    ax.set_ylabel("tokens/s (median after warm-up)")
    ax.set_title("Throughput over shaped links")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = results_dir / f"{prefix}_throughput.png"
    fig.savefig(p, dpi=110)
    paths.append(str(p))

    conv = [
        r
        for r in results
        if r.get("kind") == "swarm"
        and r.get("rate") == "none"
        and r.get("micro_batches") == cfg.convergence_mb
        and not r.get("error")
    ]
    for x_key, x_label, name in (("tokens", "tokens", "loss_tokens"), ("wall_s", "seconds", "loss_time")):
        fig = Figure(figsize=(7, 4.2))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for r in conv:
            pts = [p for p in r["losses"] if p.get("loss") is not None]
            ax.plot(
                [p[x_key] for p in pts],
                _smooth([p["loss"] for p in pts]),
                linestyle="-" if r["mode"] == "sync" else "--",
                label=f"{subspace_label(r['codec'], r.get('subspace'))} {r['mode']}",
            )
        ax.set_xlabel(x_label)
        ax.set_ylabel("training loss (3-step mean)")
        ax.set_title(f"Convergence, same data and budget ({x_label})")
        ax.grid(alpha=0.3)
        if conv:
            ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        p = results_dir / f"{prefix}_{name}.png"
        fig.savefig(p, dpi=110)
        paths.append(str(p))
    return paths


# -------------------------------------------------------------------------------------- markdown


def markdown_section(report: dict[str, Any]) -> str:
    """The "Links" section of BENCHMARKS.md from a report (pure)."""
    cfg = report["config"]
    results = report["results"]
    a = report["analysis"]
    m = report["machine"]
    lines = [
        SECTION,
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores, {m['memory_gib']:.0f} GiB, torch {m['torch']}, "
        f"hivemind {m['hivemind']}, Python {m['python']}; network: "
        + (
            "network namespaces on a private bridge, tbf egress shaping per namespace (benchmarks/netlab.py)"
            if not cfg["loopback"]
            else "loopback, no shaping"
        )
        + f". Load average at start {m['load_start']}.",
        "",
        f"Command: `{report['command']}` ({report['wall_min']:.1f} min; results in "
        f"`benchmarks/results/{report['name']}.json`).",
        "",
        f"Model: `{cfg['spec_path']}`"
        + (f" with model {cfg['model_overrides']}" if cfg["model_overrides"] else "")
        + f" ({report['n_params'] / 1e6:.1f}M parameters, {report['num_stages']} stages, micro-batch "
        f"{report['micro_batch']}, {report['tokens_per_mb']} tokens, fp32 activation message "
        f"{report['act_mib']:.2f} MiB), optimizer steps of {cfg['accumulate']} micro-batches, "
        f"{report['threads_per_stage']} torch thread(s) per stage process. Pipelining: {cfg['pipe_n_micro']} "
        "micro-batches per step. Tokens/s = median over windows of "
        f"{cfg['pipe_n_micro']} micro-batches after {cfg['warmup_mb']} warm-up micro-batches.",
        "",
        "### Throughput",
        "",
        "| run | rate | tokens/s | wire bytes/token | payload bytes/token | peak RSS MiB (stage procs) "
        "| load avg start/end |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("error"):
            lines.append(
                f"| {r['name']} | {r.get('rate', '-')} | failed: {' '.join(r['error'].split())[:100].replace('|', '/')} | | | | |"
            )
            continue
        if r["kind"] == "swarm":
            mem = [round(v["main"]) for k, v in sorted(r["peak_rss_mb"].items()) if k.startswith("peer")]
        elif r["kind"] == "pipelining":
            mem = [round(v) for v in r["peak_rss_mb"] if v]
        else:
            mem = [round(r["peak_rss_mb"])] if r.get("peak_rss_mb") else []
        lines.append(
            f"| {r['name']} | {r.get('rate', 'none')} | {_f(r.get('tokens_per_s'))} | "
            f"{_f(r.get('wire_bytes_per_token'))} | {_f(r.get('payload_bytes_per_token'))} | {mem} | "
            f"{'/'.join(str(x) for x in r.get('load_1min', [])) or '-'} |"
        )
    t = a["targets"]
    lines += [
        "",
        "### Targets (ratios inside this run)",
        "",
        "| target | wanted | measured |",
        "|---|---|---|",
    ]
    rows = [
        ("swarm (default codec) / pipelining 1F1B at 20mbit", ">= 3", t.get("target_3x_1f1b_at_20mbit")),
        ("swarm at 100mbit / its own unshaped", ">= 0.9", t.get("target_0.9_own_at_100mbit")),
        ("swarm / pipelining 1F1B unshaped", ">= 0.9", t.get("target_0.9_pipelining_unshaped")),
        ("peak RSS: async peer / sync peer", "<= 1.5", t.get("memory_async_vs_sync_peer")),
        ("peak RSS: async peer / pipelining rank", "<= 2", t.get("memory_async_peer_vs_pipelining_rank")),
        (
            "peak RSS: async peer incl. DHT process + p2pd / pipelining rank",
            "-",
            t.get("memory_async_peer_tree_vs_pipelining_rank"),
        ),
    ]
    dc = report["config"]["default_codec"]
    rows.append(
        (f"held-out loss: {dc} sync / none sync", "<= 1.01", t.get(f"convergence_{dc}_sync_within_1pct"))
    )
    rows.append(("held-out loss: none async / none sync", "<= 1.02", t.get("convergence_async_vs_sync_none")))
    rows.append(
        (f"held-out loss: {dc} async / {dc} sync", "<= 1.02", t.get(f"convergence_{dc}_async_vs_sync_{dc}"))
    )
    for ratio in cfg.get("subspace_ratios", ()):
        for mode in ("sync", "async"):
            rows.append(
                (
                    f"held-out loss: subspace d/{ratio} {mode} / none {mode}",
                    "<= 1.03" if ratio == 32 else "-",
                    t.get(f"subspace_d/{ratio}_{mode}_loss_vs_none_{mode}"),
                )
            )
        rows.append(
            (
                f"wall-clock to target at 20mbit: none async / subspace d/{ratio} async",
                ">= 3" if ratio == 32 else "-",
                t.get(f"subspace_d/{ratio}_time_to_target_speedup_vs_none_async@20mbit"),
            )
        )
    for key, val in sorted(t.items()):
        if (key.startswith("swarm_") or "speedup" in key) and "@" in key and val is not None:
            rows.append((key.replace("_", " "), "-", val))
    for name, wanted, val in rows:
        lines.append(f"| {name} | {wanted} | {_f(val, '.2f')} |")
    conv = a.get("convergence", {})
    if conv:
        lines += [
            "",
            f"### Convergence (unshaped links, {cfg['convergence_mb']} micro-batches, same data)",
            "",
            f"Target loss {_f(conv.get('target_loss'), '.3f')} ({conv.get('target_rule')}).",
            "",
            "| codec, mode | final train loss | held-out loss | vs none sync | tokens to target | s to target "
            "| tokens/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, c in conv.items():
            if not isinstance(c, dict):
                continue
            lines.append(
                f"| {key} | {_f(c['final_train_loss'], '.3f')} | {_f(c['eval_loss'], '.3f')} | "
                f"{_f(c['eval_vs_reference'], '.3f')} | {_f(c['tokens_to_target'])} | "
                f"{_f(c['wall_s_to_target'], '.0f')} | {_f(c['tokens_per_s'])} |"
            )
    ttt = a.get("time_to_target", {})
    if ttt:
        rates = [format_rate(r) for r in cfg["rates"]]
        lines += [
            "",
            "### Wall-clock to the target loss at each rate",
            "",
            "Seconds = tokens to the target loss (the unshaped convergence run above; torch pipelining is "
            "synchronous and uncompressed, so it is given the `none sync` run's tokens) / tokens/s of the "
            "same configuration measured at that rate in this run. Derived, not a training run to the target "
            "at each rate: in sync mode the loss per token does not depend on the link, only the tokens/s "
            "does; in async mode staleness depends on timing, so its figures are estimates. Measured "
            'runs to a target at 100mbit and 20mbit: section "Time to quality (measured)" '
            "(benchmarks/time_to_target.py).",
            "",
            "| codec, mode | tokens to target | " + " | ".join(f"tokens/s, s @ {r}" for r in rates) + " |",
            "|---|---|" + "---|" * len(rates),
        ]
        for key, per_rate in ttt.items():
            tokens = (conv.get(key) or {}).get("tokens_to_target") if key in conv else None
            if key.startswith("torch pipelining"):
                tokens = (conv.get("none sync") or {}).get("tokens_to_target")
            cells = [
                f"{_f(per_rate.get(r, {}).get('tokens_per_s'))}, {_f(per_rate.get(r, {}).get('s_to_target'))}"
                for r in rates
            ]
            lines.append(f"| {key} | {_f(tokens)} | " + " | ".join(cells) + " |")
    lines += ["", *[f"![{Path(p).stem}](benchmarks/results/{Path(p).name})" for p in report.get("plots", [])]]
    if report.get("reading"):
        lines += ["", "### Reading", "", report["reading"]]
    return "\n".join(lines) + "\n"


def write_markdown(section: str, path: Path = MARKDOWN) -> None:
    """Replace (or append) the "Links" section; other sections are left exactly as they are."""
    write_section(section, path)


# ----------------------------------------------------------------------------------------- driver


def run_all(
    cfg: LinksConfig,
    jobs: list[Job],
    *,
    name: str,
    command: str,
    say: Callable[[str], None] = print,
    results_dir: Path = RESULTS_DIR,
) -> dict[str, Any]:
    """Run ``jobs`` in one lab; write ``results/NAME.json`` after every job (partial results survive)."""

    results_dir.mkdir(parents=True, exist_ok=True)
    spec = pipelining_spec(cfg)
    s = spec.num_stages
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // s)
    stage_nodes = [f"s{i}" for i in range(s)]
    nodes = {"boot": "boot", "trainer": "trainer", "stages": stage_nodes}
    report: dict[str, Any] = {
        "name": name,
        "command": command,
        "config": asdict(cfg),
        "machine": machine_info(),
        "n_params": spec.n_params(),
        "num_stages": s,
        "micro_batch": f"{spec.micro_batch_size}x{spec.model.seq_len}",
        "tokens_per_mb": spec.tokens_per_micro_batch,
        "act_mib": spec.micro_batch_size * spec.model.seq_len * spec.model.d_model * 4 / 2**20,
        "threads_per_stage": threads,
        "results": [],
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    out_json = results_dir / f"{name}.json"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="swarmpipe-links-") as tmp:
        work = Path(tmp)
        base_path = work / "base.json"
        base_path.write_bytes(spec.canonical_bytes())
        with open_lab(["boot", "trainer", *stage_nodes], loopback=cfg.loopback) as lab:
            report["lab"] = getattr(lab, "tag", "loopback")
            boot_maddr = None
            if any(j.kind == "swarm" for j in jobs):
                _, boot_maddr = start_bootstrap(lab, nodes["boot"], work, cfg.start_timeout_s)
            nodes["boot_maddr"] = boot_maddr
            for i, job in enumerate(jobs):
                say(f"[{i + 1}/{len(jobs)}] {job.name} ({time.perf_counter() - t0:.0f} s elapsed)")
                lab.set_rate(job.rate)
                t = time.perf_counter()
                load_start = os.getloadavg()[0]
                try:
                    res = _run_job(lab, cfg, job, work / f"job{i}", nodes, base_path, threads)
                except (SwarmError, LabError, OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
                    res = {
                        "kind": job.kind,
                        "rate": job.rate,
                        "codec": job.codec,
                        "subspace": job.subspace,
                        "mode": job.mode,
                        "schedule": job.schedule,
                        "error": f"{type(e).__name__}: {e}",
                    }
                    say(f"    FAILED: {res['error'][:800]}")
                res["name"] = job.name
                res["load_1min"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]
                res["purposes"] = list(job.purposes)
                res["job_s"] = time.perf_counter() - t
                if not res.get("error"):
                    say(
                        f"    {_f(res.get('tokens_per_s'))} tokens/s, wire {_f(res.get('wire_bytes_per_token'))} B/token"
                        f" ({res['job_s']:.0f} s)"
                    )
                report["results"].append(res)
                report["wall_min"] = (time.perf_counter() - t0) / 60
                out_json.write_text(json.dumps(report, indent=1, default=str))
    remove_stale_sockets(socket_prefix())  # the bootstrap node's, if the lab had to SIGKILL it
    report["analysis"] = analyse(cfg, report["results"])
    report["plots"] = plot(cfg, report["results"], name, results_dir)
    report["wall_min"] = (time.perf_counter() - t0) / 60
    out_json.write_text(json.dumps(report, indent=1, default=str))
    return report


def _run_job(
    lab: Lab, cfg: LinksConfig, job: Job, work: Path, nodes: dict[str, Any], base_path: Path, threads: int
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    if job.kind == "swarm":
        return run_swarm(lab, cfg, job, work, nodes, boot_maddr=nodes.get("boot_maddr"))
    if job.kind == "pipelining":
        steps = _pipe_steps(cfg)
        pcfg = PipeConfig(
            spec_path=str(base_path),
            schedule=job.schedule,
            n_micro=cfg.pipe_n_micro,
            steps=steps,
            warmup_steps=min(steps - 1, max(1, -(-cfg.warmup_mb // cfg.pipe_n_micro))),
            threads=threads,
            data_bytes=cfg.data_bytes,
            timeout_s=cfg.run_timeout_s,
            fused_adamw=cfg.pipe_fused_adamw,
        )
        res = run_pipelining(lab, pcfg, nodes["stages"], work)
        res["rate"] = job.rate
        return res
    scfg = SingleConfig(
        threads=job.threads,
        spec_path=str(base_path),
        accumulate=cfg.accumulate,
        steps=max(2, job.micro_batches // cfg.accumulate),
        warmup_steps=max(1, cfg.warmup_mb // cfg.accumulate),
        data_bytes=cfg.data_bytes,
        timeout_s=cfg.run_timeout_s,
    )
    res = run_single(scfg, work)
    res["rate"] = "none"
    return res


def quick_config(**kw: Any) -> LinksConfig:
    """``--quick``: the bench model at 1/4 width and half depth; codecs none and blockwise8 and the d/32
    subspace model (both modes, unshaped), rates none and 5mbit, 1F1B only, one single-process run: 12
    runs, most of their time is process start-up."""
    base = {
        "model_overrides": dict(QUICK_MODEL),
        "rates": ("none", "5mbit"),
        "sweep_rates": (),
        "subspace_ratios": (32,),
        "schedules": ("1f1b",),
        "single_threads": (1,),
        "codecs": ("none", "blockwise8"),
        "throughput_mb": 16,
        "warmup_mb": 4,
        "convergence_mb": 32,
        "pipe_n_micro": 4,
        "data_bytes": 1 << 20,
    }
    base.update(kw)
    return LinksConfig(**base)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.links",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", default="examples/bench.yaml")
    parser.add_argument("--quick", action="store_true", help="small model and few runs (a few minutes)")
    parser.add_argument("--loopback", action="store_true", help="no namespaces or rate limits (not root)")
    parser.add_argument("--rates", nargs="+", default=None, help="link rates, e.g. none 100mbit 20mbit 5mbit")
    parser.add_argument("--codecs", nargs="+", default=None)
    parser.add_argument("--throughput-mb", type=int, default=None)
    parser.add_argument("--convergence-mb", type=int, default=None)
    parser.add_argument("--name", default=None, help="results name (default links, links_quick, ...)")
    parser.add_argument("--plan", action="store_true", help="print the runs and exit")
    parser.add_argument(
        "--no-markdown",
        action="store_true",
        help="do not touch BENCHMARKS.md (--quick and --loopback never do)",
    )
    parser.add_argument(
        "--render",
        metavar="NAME",
        default=None,
        help="rewrite the Links section from results/NAME.json (and the reading in results/NAME_reading.md) "
        "without running anything",
    )
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads((RESULTS_DIR / f"{args.render}.json").read_text())
        # the analysis is re-derived from the stored results (with the stored config), so that a change
        # of an analysis rule applies to an existing run without running it again
        stored = {k: tuple(v) if isinstance(v, list) else v for k, v in report["config"].items()}
        known = {f.name for f in dataclasses.fields(LinksConfig)}
        report["analysis"] = analyse(
            LinksConfig(**{k: v for k, v in stored.items() if k in known}), report["results"]
        )
        reading = RESULTS_DIR / f"{args.render}_reading.md"
        if reading.exists():
            report["reading"] = reading.read_text().strip()
        write_markdown(markdown_section(report))
        print(f"rewrote the {SECTION!r} section of {MARKDOWN} from results/{args.render}.json")
        return 0

    kw: dict[str, Any] = {"spec_path": args.spec, "loopback": args.loopback}
    if args.rates:
        kw["rates"] = tuple(args.rates)
    elif args.loopback:
        kw["rates"] = ("none",)
    if args.codecs:
        kw["codecs"] = tuple(args.codecs)
    if args.throughput_mb:
        kw["throughput_mb"] = args.throughput_mb
    if args.convergence_mb:
        kw["convergence_mb"] = args.convergence_mb
    if args.loopback and "rates" not in kw:
        kw["rates"] = ("none",)
    cfg = quick_config(**kw) if args.quick else LinksConfig(**kw)
    jobs = plan(cfg)
    if args.plan:
        for j in jobs:
            print(f"{j.name:45s} {j.micro_batches:4d} mb  {', '.join(j.purposes)}")
        return 0
    if not args.loopback:
        reason = lab_unavailable_reason(probe=True)
        if reason:
            print(f"cannot run the network lab: {reason}", file=sys.stderr)
            return 2
    name = args.name or ("links" + ("_quick" if args.quick else "") + ("_loopback" if args.loopback else ""))
    command = "python -m benchmarks.links " + " ".join(argv if argv is not None else sys.argv[1:])
    report = run_all(cfg, jobs, name=name, command=command.strip())
    # Only the full run in the lab goes to BENCHMARKS.md by default: a --quick or --loopback run must not
    # replace it by accident (``--render NAME`` puts any run's results there on purpose).
    if args.no_markdown or args.quick or args.loopback:
        print(
            f"results in {RESULTS_DIR / name}.json; `python -m benchmarks.links --render {name}` writes "
            "them to BENCHMARKS.md"
        )
    else:
        write_markdown(markdown_section(report))
    print(json.dumps(report["analysis"]["targets"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
