"""``swarm demo``: a whole swarm on this machine, training a small model, then shut down cleanly.

    swarm demo                                   # 2 stages x 2 peers, examples/demo.yaml
    swarm demo --stages 2 --peers-per-stage 2 --steps 100 --codec int8 --out runs/demo --chaos

What runs (all on loopback):

- a bootstrap node (in this process, ``swarm.tools.bootstrap.Bootstrap``) that publishes the run spec;
- ``stages x peers_per_stage`` stage peers, each a separate process (``python -m swarm.cli peer``)
  in its own process group, its output in ``OUT/logs/``;
- a trainer (in this process, ``swarm.train.trainer.Trainer``) writing ``OUT/metrics.jsonl``.

With ``chaos`` one peer is killed with SIGKILL (its whole process group: the peer, its DHT process
and its p2pd) a third of the way through, and a fresh peer is started for the same stage, so the
summary shows micro-batches re-sent around the dead peer. At the end ``OUT/`` holds metrics.jsonl,
loss.png, status.json (what ``swarm status`` would show) and summary.json.

Shutdown (note "no leftovers"): in ``finally``, every peer process gets SIGTERM (it stops its
own DHT, averager and p2pd in order), then its whole process group gets SIGKILL after ``grace_s``
(whatever is left, also of a peer killed by chaos); the bootstrap and trainer DHTs are shut down.
SIGTERM to the demo itself is turned into ``KeyboardInterrupt`` so the same ``finally`` runs for
Ctrl-C and for ``kill``.

(Over 400 lines on purpose: one object, ``Demo``, owns a local swarm's whole life -- start, train,
chaos, summary, shutdown -- and the benchmarks drive exactly that object; its peer processes are
the only other class, and they are nothing without it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from swarm.dht.processes import (
    SOCKET_PREFIX_ENV,
    alive_in_groups,
    child_socket_prefix,
    remove_stale_sockets,
    terminate_as_interrupt,
)
from swarm.errors import ConfigError, SwarmError
from swarm.run.fields import check_fields, integer, number

__all__ = ["DemoConfig", "Demo", "PeerProcess", "demo_spec", "DEFAULT_DEMO_SPEC"]

# The run `swarm demo` trains when examples/demo.yaml is not at hand (an installed package): the same
# values as that file. Sized for 2 CPU cores: ~0.9M parameters, 1024 tokens per micro-batch.
DEFAULT_DEMO_SPEC: dict[str, Any] = {
    "run_id": "demo",
    "seed": 0,
    "model": {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
    "stages": 2,
    "codecs": {"activations": "blockwise8", "gradients": "blockwise8"},
    "optimizer": {
        "name": "muon",
        "lr": 3e-3,
        "accumulate": 4,
        "warmup_steps": 10,
        "mode": "async",
        "recompute": False,
    },
    "averaging": {"timeout_s": 5},
    "micro_batch_size": 8,
    "autocast": "auto",
    "stash_ttl_s": 120,
}

_SERVING = re.compile(r"peer (\S+) serving stage (\d+) of run (\S+)")


def _repo_example() -> Path | None:
    """``examples/demo.yaml`` of a source checkout (next to the package), if present."""
    for base in (Path.cwd(), Path(__file__).resolve().parent.parent):
        path = base / "examples" / "demo.yaml"
        if path.is_file():
            return path
    return None


def demo_spec(*, spec_path: str | None = None, stages: int | None = None, codec: str | None = None):
    """The demo's ``RunSpec``: ``spec_path``, else examples/demo.yaml, else :data:`DEFAULT_DEMO_SPEC`,
    with ``stages`` / ``codec`` (both directions) overridden when given."""
    from swarm.run.spec import RunSpec

    path = Path(spec_path) if spec_path else _repo_example()
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"--spec {spec_path!r} does not exist; omit it to use the built-in demo run")
        data = RunSpec.from_yaml(path).to_dict()  # validated with the file's own error messages
    else:
        data = json.loads(json.dumps(DEFAULT_DEMO_SPEC))
    if stages is not None:
        data["stages"] = stages
    if codec is not None:
        data.setdefault("codecs", {})
        data["codecs"] = {"activations": codec, "gradients": codec}
    return RunSpec.from_dict(data)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What ``swarm demo`` starts; the CLI flags map 1:1."""

    stages: int | None = integer(None, lo=1, optional=True, hint="Use e.g. --stages 2.")
    """Pipeline stages (None = the spec's, 2 for the demo run)."""
    peers_per_stage: int = integer(2, lo=1, hint="Use e.g. --peers-per-stage 2.")
    """Peer processes per stage (data parallel inside a stage)."""
    steps: int = integer(75, lo=1, hint="Use e.g. --steps 75.")
    """Trainer steps (``optimizer.accumulate`` = 4 micro-batches each: 300 micro-batches, 307k tokens); the
    default finishes in about 2 minutes on 2 CPU cores with the loss clearly falling."""
    codec: str | None = None
    """Codec for activations and gradients (None = the spec's, blockwise8); see `swarm codecs`."""
    out_dir: str = "runs/demo"
    chaos: bool = False
    """Kill one peer (SIGKILL) a third of the way through and start a fresh one."""
    spec_path: str | None = None
    """Run spec file (None = examples/demo.yaml when present, else the built-in demo run)."""
    spec: Any = None
    """A ``RunSpec`` to use as is (Python API and tests); overrides ``spec_path``, ``stages``, ``codec``."""
    max_inflight: int | None = integer(
        None, lo=1, optional=True, hint="Use e.g. --max-inflight 4, or leave it out."
    )
    """Micro-batches in flight, exactly (None = paced by the trainer between the number of stages and
    ``swarm.train.trainer.inflight_rule_of_thumb``; note "pacing" in swarm/train/pacing.py)."""
    reference: bool = True
    """After training, train the same model in one process on the same micro-batches (with the run's
    optimizer) and print both held-out losses: what training through the swarm cost."""
    eval_every: int | None = None
    """Held-out loss every N steps (None = 4 evaluations over the run; 0 = never)."""
    seed: int = 0
    peer_args: tuple[str, ...] = ()
    """Extra flags for every `swarm peer` process (e.g. ``("--throughput", "5000")``)."""
    peer_args_by_index: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Extra flags for the peer with this start index (stage * peers_per_stage + j), e.g. a slowdown."""
    start_timeout_s: float = number(180.0, gt=0.0, hint="Give a positive number of seconds.")
    """How long the peers may take to come online (imports, weights, throughput measurement)."""
    grace_s: float = number(10.0, ge=0.0, hint="Give a number of seconds >= 0.")
    """Seconds a peer may take to stop after SIGTERM (it drains, then stops its DHT) before SIGKILL."""
    torch_threads: int | None = None
    """OMP/MKL threads per peer process (None = CPU count / number of peers, at least 1)."""
    quiet: bool = False
    keeper: Any = None
    """A ``swarm.tools.keeper.KeeperConfig``: the bootstrap keeps stage snapshots (as ``swarm init`` does); None = none."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class PeerProcess:
    """One `swarm peer` subprocess (its own process group, pgid = pid)."""

    stage: int
    index: int
    popen: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]
    peer_id: str | None = None
    killed: bool = False
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class Demo:
    """Starts and owns a loopback swarm; :meth:`run` does everything and cleans up in ``finally``."""

    def __init__(self, config: DemoConfig, *, out: IO[str] | None = None):
        self.config = config
        self.out = out if out is not None else sys.stdout
        self.spec = config.spec or demo_spec(
            spec_path=config.spec_path, stages=config.stages, codec=config.codec
        )
        self.out_dir = Path(config.out_dir)
        self.logs = self.out_dir / "logs"
        self.peers: list[PeerProcess] = []
        self.pgids: list[int] = []  # every process group this demo created (for the leftover check)
        self.boot = None
        self.maddr: str | None = None
        self.trainer = None
        self.chaos_log: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._boot_thread: threading.Thread | None = None
        self.socket_prefix = child_socket_prefix("demo")
        """Prefix of the peers' hivemind socket files (see :meth:`shutdown`)."""

    # ---- output ---------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        if not self.config.quiet:
            print(text, file=self.out, flush=True)

    # ---- the whole demo -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Start everything, train, write OUT/, shut everything down. Returns the summary."""
        os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
        cfg, spec = self.config, self.spec
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        previous = terminate_as_interrupt((signal.SIGTERM, signal.SIGINT))  # Ctrl-C: see its docstring
        try:
            self.say(
                f"swarm demo: run {spec.run_id!r} ({spec.n_params() / 1e6:.2f}M parameters, {spec.num_stages} stages "
                f"x {cfg.peers_per_stage} peers, codec {spec.codecs.activations}), {cfg.steps} steps, "
                f"output in {self.out_dir}/"
            )
            self.start()
            self.say(f"all {len(self.peers)} peers online after {time.monotonic() - t0:.1f} s; training")
            summary = asyncio.run(self._train())
            status = self._write_status()
            wall_s = time.monotonic() - t0
        finally:
            self.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if cfg.reference:  # after the peers are gone: it gets the whole machine
            summary = dict(summary, reference=self._reference(summary))
        return self._finish(summary, status, wall_s=wall_s)

    def start(self) -> None:
        """Start the bootstrap and every peer and wait until they are online (tests call this and
        then train with their own ``Trainer``; call :meth:`shutdown` in ``finally``)."""
        cfg = self.config
        self.logs.mkdir(parents=True, exist_ok=True)
        self._start_bootstrap()
        for stage in range(self.spec.num_stages):
            for j in range(cfg.peers_per_stage):
                self._spawn_peer(stage, stage * cfg.peers_per_stage + j)
        self._await_online(self.peers)

    # ---- bootstrap ------------------------------------------------------------------------------

    def _start_bootstrap(self) -> None:
        from swarm.tools.bootstrap import Bootstrap, BootstrapConfig

        self.boot = Bootstrap(
            BootstrapConfig(spec=self.spec, status_interval_s=10.0, keeper=self.config.keeper)
        ).start()
        self.maddr = self.boot.maddrs[0]
        log = open(self.logs / "bootstrap.log", "a", encoding="utf-8")  # noqa: SIM115 (closed by the thread)

        def serve() -> None:
            try:
                self.boot.serve(self._stop, out=lambda line: (log.write(line + "\n"), log.flush()))
            finally:
                log.close()

        self._boot_thread = threading.Thread(target=serve, name="demo-bootstrap", daemon=True)
        self._boot_thread.start()
        self.say(f"bootstrap: {self.maddr}")

    # ---- peers ----------------------------------------------------------------------------------

    def _peer_env(self) -> dict[str, str]:
        env = dict(os.environ)
        n_peers = self.spec.num_stages * self.config.peers_per_stage
        threads = self.config.torch_threads or max(1, (os.cpu_count() or 1) // n_peers)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env.setdefault("MKL_NUM_THREADS", str(threads))
        env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
        env["PYTHONUNBUFFERED"] = "1"
        env[SOCKET_PREFIX_ENV] = self.socket_prefix
        return env

    def add_peer(self, stage: int, *, extra_args: tuple[str, ...] = (), name: str = "extra") -> PeerProcess:
        """Start one more peer for ``stage`` (e.g. a straggler: ``("--slowdown", "0.2")``) and wait
        until it is online."""
        proc = self._spawn_peer(stage, len(self.peers), suffix=f"-{name}", extra_args=extra_args)
        self._await_online([proc])
        return proc

    async def add_peer_async(
        self, stage: int, *, extra_args: tuple[str, ...] = (), name: str = "extra"
    ) -> PeerProcess:
        """:meth:`add_peer` for the event loop: the wait for the peer to come online is cancellable (a
        thread's would hold up the loop's shutdown); a cancelled peer is still stopped by :meth:`shutdown`."""
        proc = self._spawn_peer(stage, len(self.peers), suffix=f"-{name}", extra_args=extra_args)
        await self._await_online_async([proc])
        return proc

    def kill_peer(self, proc: PeerProcess) -> None:
        """SIGKILL ``proc``'s whole process group (the peer, its DHT process and its p2pd) and mark it
        killed; returns at once (reap it with ``proc.popen.wait()``, quick after SIGKILL). What it leaves
        (hivemind socket files) :meth:`shutdown` removes, or ``remove_stale_sockets(self.socket_prefix)``."""
        _kill_group(proc.pid, signal.SIGKILL)
        proc.killed = True

    def _spawn_peer(
        self, stage: int, index: int, *, suffix: str = "", extra_args: tuple[str, ...] = ()
    ) -> PeerProcess:
        assert self.maddr is not None
        cmd = [
            sys.executable,
            "-m",
            "swarm.cli",
            "peer",
            "--initial-peers",
            self.maddr,
            "--run",
            self.spec.run_id,
            "--stage",
            str(stage),
            *self.config.peer_args,
            *self.config.peer_args_by_index.get(index, ()),
            *extra_args,
        ]
        log_path = self.logs / f"peer-s{stage}-{index}{suffix}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 (closed in shutdown)
        log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        log_file.flush()
        popen = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._peer_env(),
            start_new_session=True,  # its own process group: SIGKILL reaches its DHT and p2pd too
        )
        proc = PeerProcess(stage=stage, index=index, popen=popen, log_path=log_path, log_file=log_file)
        self.peers.append(proc)
        self.pgids.append(popen.pid)
        return proc

    def _poll_online(self, procs: list[PeerProcess]) -> list[PeerProcess]:
        """One look at the logs of ``procs``: returns those not online yet; raises if one exited."""
        waiting = []
        for p in procs:
            if p.peer_id is not None:
                continue
            match = None
            with contextlib.suppress(OSError):
                match = _SERVING.search(p.log_path.read_text(errors="replace"))
            if match:
                p.peer_id = match.group(1)
                self.say(f"  stage {p.stage}: peer {p.peer_id} online (pid {p.pid}, log {p.log_path})")
            elif p.popen.poll() is not None:
                raise SwarmError(
                    f"peer process for stage {p.stage} exited with code {p.popen.returncode} before "
                    f"coming online; its log {p.log_path} ends with:\n{p.log_tail()}"
                )
            else:
                waiting.append(p)
        return waiting

    def _startup_timeout(self, waiting: list[PeerProcess]) -> SwarmError:
        p = waiting[0]
        return SwarmError(
            f"{len(waiting)} peers did not come online within {self.config.start_timeout_s:.0f} s "
            f"(start_timeout_s); the log {p.log_path} ends with:\n{p.log_tail()}"
        )

    def _await_online(self, procs: list[PeerProcess]) -> None:
        """Wait until each peer printed ``peer <id> serving stage <i> of run <run>``."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while waiting := self._poll_online(procs):
            if time.monotonic() > deadline:
                raise self._startup_timeout(waiting)
            time.sleep(0.2)

    async def _await_online_async(self, procs: list[PeerProcess]) -> None:
        """:meth:`_await_online` for the event loop (cancellable, unlike a thread)."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while waiting := self._poll_online(procs):
            if time.monotonic() > deadline:
                raise self._startup_timeout(waiting)
            await asyncio.sleep(0.2)

    # ---- training -------------------------------------------------------------------------------

    async def _train(self) -> dict[str, Any]:
        from swarm.train.trainer import Trainer, TrainerConfig, inflight_rule_of_thumb

        cfg = self.config
        n_peers = self.spec.num_stages * cfg.peers_per_stage
        eval_every = cfg.eval_every if cfg.eval_every is not None else max(1, cfg.steps // 4)
        self.trainer = Trainer(
            TrainerConfig(
                initial_peers=(self.maddr,),
                run_id=self.spec.run_id,
                steps=cfg.steps,
                max_inflight=cfg.max_inflight or inflight_rule_of_thumb(self.spec.num_stages, n_peers),
                pacing=cfg.max_inflight is None,  # a --max-inflight given is kept exactly (note "pacing")
                out_dir=str(self.out_dir),
                eval_every=eval_every,
                seed=cfg.seed,
                trainer_id="demo-trainer",
                quiet=cfg.quiet,
            ),
            out=self.out,
        )
        train = asyncio.get_running_loop().create_task(self.trainer.run())
        chaos = asyncio.get_running_loop().create_task(self._chaos()) if cfg.chaos else None
        try:
            return await train
        finally:
            if chaos is not None:
                chaos.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await chaos

    async def _chaos(self) -> None:
        """A third of the way in, SIGKILL one peer (prefer a stage with a stage-mate) and start a fresh one."""
        target_step = max(1, self.config.steps // 3)
        while getattr(self.trainer, "step", 0) < target_step:
            await asyncio.sleep(0.2)
        live = [p for p in self.peers if not p.killed and p.popen.poll() is None]
        by_stage: dict[int, list[PeerProcess]] = {}
        for p in live:
            by_stage.setdefault(p.stage, []).append(p)
        crowded = [ps for ps in by_stage.values() if len(ps) > 1]
        victim = (crowded[-1] if crowded else live)[-1]
        inflight = self.trainer.ledger.inflight() if self.trainer is not None else 0
        self.kill_peer(victim)
        while victim.popen.poll() is None:  # reaps it; SIGKILL takes effect at once
            await asyncio.sleep(0.05)
        event = {
            "time": time.time(),
            "step": self.trainer.step,
            "killed_peer": victim.peer_id,
            "stage": victim.stage,
            "pid": victim.pid,
            "inflight_at_kill": inflight,
        }
        self.trainer.say(
            f"chaos: killed peer {victim.peer_id} (stage {victim.stage}, pid {victim.pid}) with SIGKILL at step "
            f"{event['step']} while {inflight} micro-batches were in the swarm; starting a fresh peer"
        )
        self.chaos_log.append(event)
        fresh = self._spawn_peer(victim.stage, victim.index, suffix="-fresh")
        event["fresh_pid"] = fresh.pid
        await self._await_online_async([fresh])
        event["fresh_peer"] = fresh.peer_id
        self.trainer.say(f"chaos: fresh peer {fresh.peer_id} serves stage {fresh.stage}")

    # ---- results --------------------------------------------------------------------------------

    def _reference(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """Train the same model in this process on the same micro-batches (swarm/train/reference.py) and
        compare held-out losses on the trainer's own evaluation windows; says both."""
        from swarm.train.reference import held_out_loss, train_reference

        trainer = self.trainer
        swarm_loss = summary.get("eval_loss_last")
        if trainer is None or swarm_loss is None or not trainer.completed_train:
            return None
        n = trainer.completed_train
        self.say(f"training the same model in one process on the same {n} micro-batches, for comparison ...")
        t0 = time.monotonic()
        model = train_reference(self.spec, trainer.data, micro_batches=n, seed=self.config.seed)
        mbs = self.spec.micro_batch_size
        tokens = trainer.config.eval_batches * mbs * self.spec.model.seq_len
        loss, _ = held_out_loss(model, trainer.data, batch=mbs, tokens=tokens)
        ratio = swarm_loss / loss
        self.say(
            f"held-out loss: swarm {swarm_loss:.3f} vs one process {loss:.3f} on the same "
            f"{n * self.spec.tokens_per_micro_batch} tokens (ratio {ratio:.3f}; 1.0 = no cost of training through "
            f"the swarm; {time.monotonic() - t0:.0f} s)"
        )
        return {"eval_loss": loss, "ratio": ratio, "micro_batches": n, "eval_tokens": tokens}

    def _write_status(self) -> dict[str, Any]:
        from swarm.tools.status import gather_run_status

        status: dict[str, Any] = {}
        if self.boot is not None and self.boot.membership is not None:
            try:
                status = gather_run_status(self.boot.membership, spec_timeout_s=5.0).to_json()
            except SwarmError as e:
                status = {"error": str(e)}
        (self.out_dir / "status.json").write_text(json.dumps(status, indent=2, sort_keys=True) + "\n")
        return status

    def _finish(self, summary: dict[str, Any], status: dict[str, Any], *, wall_s: float) -> dict[str, Any]:
        summary = dict(summary)
        summary["demo"] = {
            "wall_s": round(wall_s, 1),
            "stages": self.spec.num_stages,
            "peers_per_stage": self.config.peers_per_stage,
            "steps": self.config.steps,
            "chaos": self.chaos_log,
            "peers": [
                {
                    "stage": p.stage,
                    "peer_id": p.peer_id,
                    "pid": p.pid,
                    "log": str(p.log_path),
                    "killed": p.killed,
                    "micro_batches": summary.get("peers_by_stage", {})
                    .get(str(p.stage), {})
                    .get(p.peer_id or "", 0),
                }
                for p in self.peers
            ],
        }
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        self.say(f"demo finished in {wall_s:.1f} s (start-up included). Peers:")
        for p in summary["demo"]["peers"]:
            if p["peer_id"] is None:
                self.say(
                    f"  stage {p['stage']}: a fresh peer (pid {p['pid']}) was still starting when training ended"
                )
                continue
            note = " (killed by chaos)" if p["killed"] else ""
            self.say(f"  stage {p['stage']}: {p['peer_id']} served {p['micro_batches']} micro-batches{note}")
        self.say(f"files: {self.out_dir}/metrics.jsonl loss.png status.json summary.json logs/")
        return summary

    # ---- shutdown -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """SIGTERM every peer group, SIGKILL what is left after ``grace_s``; stop the bootstrap."""
        live = [p for p in self.peers if p.popen.poll() is None]
        for p in live:
            # the peer process only: it stops its own DHT, averager and p2pd in order. SIGTERM to the
            # whole group would kill those under it first and leave it hanging on a dead daemon.
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_s
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for pgid in self.pgids:  # the whole group: DHT children and p2pd outlive a killed parent
            _kill_group(pgid, signal.SIGKILL)
        for p in self.peers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5.0)
            p.log_file.close()
        self._stop.set()
        if self._boot_thread is not None:
            self._boot_thread.join(timeout=15.0)
        if self.boot is not None:
            self.boot.close()
        # A SIGKILLed peer (chaos, or one that outlived the grace period) leaves its socket files.
        remove_stale_sockets(self.socket_prefix)

    def leftovers(self) -> list[int]:
        """Live processes (not zombies) in the process groups this demo created; empty after
        :meth:`shutdown`. Zombies are ignored: a killed peer's DHT child is reparented to init and is
        gone for every purpose but the process table until init reaps it."""
        return alive_in_groups(self.pgids)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
