"""Convergence: does a model trained through a swarm reach the loss of the same training in one process?

Run (from the repository root; everything on loopback, no root needed)::

    python -m benchmarks.convergence --plan              # list the runs of the whole matrix, run nothing
    python -m benchmarks.convergence --quick             # 4 short runs, 1 seed, 1 corpus (~5 min on 2 cores)
    python -m benchmarks.convergence                     # the whole matrix (108 runs; ~6.5 h on 2 cores)
    python -m benchmarks.convergence --configs 'p2-*' --seeds 0 --corpora stdlib   # a part of it
    python -m benchmarks.convergence --codecs lowrank --configs p1-sync-lowrank --seeds 0   # another codec
    python -m benchmarks.convergence --skip-done         # go on where an interrupted run stopped
    python -m benchmarks.convergence --render            # rewrite the Convergence section from the JSON

What runs (:func:`plan`), for every corpus and seed, references first:

- ``ref-stage``: the model trained in one process with the spec's own optimizer through
  ``swarm.run.optimizer.StageOptimizer``, one per stage, driven as stage peers drive theirs
  (``benchmarks/single_process.py``, ``--optimizer stage``). Every ratio is to this run.
- ``ref-adamw``: the same with ``torch.optim.AdamW`` (the spec's lr, betas, weight decay): a second
  reference, which tells whether our optimizer itself costs anything.
- ``ref-stage-ss32``: ``ref-stage`` of the subspace-constrained model (the reference of the ``-ss32`` runs).
- swarms (``pP-MODE-CODEC``): a loopback swarm of ``P`` peers per stage (``swarm.tools.demo.Demo``: a bootstrap,
  ``swarm peer`` processes, a trainer), P in 1, 2, 4, mode sync / async, codec none / blockwise8
  (activations and gradients); ``p1-MODE-blockwise8-ss32``: the subspace model (``model.subspace:
  {ratio: 32}``, k = d_model / 32 coefficients per token at a boundary, see swarm/run/subspace.py);
  ``p2-async-blockwise8-churn``: every ``churn_every_s`` a random stage peer (of a stage with two online
  peers) is SIGKILLed (its process group) and a fresh peer started for its stage, which downloads the
  stage's state from the survivor.

Protocol: every run trains ``micro_batches`` micro-batches (equal tokens) of the same data stream: the
trainer's ``--seed`` and the reference's data seed are the run's seed, which is also the spec's ``seed``
(the initial weights). The held-out loss is that of the trained model on ``eval_tokens`` tokens of fixed,
evenly spaced held-out windows (``swarm.train.reference.held_out_loss``): for a swarm, of the model
``swarm export`` writes (``swarm.tools.export.export_run`` while the peers still run, loaded with
``load_model``); for a reference, of its final weights. Ratio = a run's held-out loss / ``ref-stage``'s of
the same corpus, seed and model; per configuration the mean and the spread (min..max) over seeds.

Each swarm run is a worker process of its own (``--worker``), in its own session; the peers are its
children. On Ctrl-C or SIGTERM the worker gets SIGTERM and stops its swarm (``Demo.shutdown``); whatever
is left after a grace period is SIGKILLed, and the stale hivemind socket files are removed.

Note [accumulate]: ``optimizer.accumulate`` is micro-batches per optimizer step of a *stage*, across all of
its replicas (peer/replicas.py: the replicas of a stage sum their gradients in a round and step as one);
the references step every ``accumulate`` micro-batches, so at equal tokens both sides take the same number
of steps. The exported stages' step counts are in each run's ``export`` record (compare them with
``micro_batches / accumulate``).

Corpora (``CORPORA``): ``stdlib`` = swarm.train.data's default (the standard library's ``.py`` sources, the first
``data_bytes``); ``pydoc`` = Python's own reference documentation, the text ``help()`` shows
(``pydoc_data/topics.py``, ~0.75 MB of prose, part of every CPython standard library on Linux, macOS and
Windows). ``--corpus NAME=PATH`` adds or replaces one. The held-out fraction is raised above swarm.train.data's
5% where a corpus needs it to hold ``eval_tokens`` in non-overlapping windows.

Outputs: ``benchmarks/results/NAME.json`` (every run: configuration, seed, corpus, tokens, held-out loss,
loss-vs-tokens points, tokens/s, wall time, peers killed; rewritten after every run; runs of a partial
invocation replace the same runs of an earlier one of the same protocol), ``NAME_loss_tokens.png``, and
(full runs, or ``--render``) the "Convergence" section of BENCHMARKS.md with the reading in
``results/NAME_reading.md`` when it exists. NAME = ``convergence`` (``convergence_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import importlib.util
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from benchmarks.markdown import MARKDOWN, write_section
from benchmarks.pipelining_baseline import ROOT, _load_spec
from benchmarks.report import cell, machine_info, smooth
from swarm.dht.processes import (
    SOCKET_PREFIX_ENV,
    child_socket_prefix,
    remove_stale_sockets,
    terminate_as_interrupt,
)
from swarm.errors import ConfigError, SwarmError
from swarm.train.data import DEFAULT_MAX_BYTES

__all__ = [
    "CORPORA",
    "ConvergenceConfig",
    "Job",
    "analyse",
    "held_out_fraction",
    "main",
    "markdown_section",
    "plan",
    "run_matrix",
    "target_for",
]

RESULTS_DIR = ROOT / "benchmarks" / "results"
SECTION = "## Convergence"
DEFAULT_OVERRIDES = {"optimizer.accumulate": 2, "optimizer.warmup_steps": 20}
PEER_ARGS = ("--throughput", "1000", "--no-rebalance")  # declared speed: no measurement at start-up
EXPORT_MAX_STEP_LAG = 1_000_000  # export whatever the stages hold; their step counts are recorded
QUICK_CONFIGS = ("p1-sync-none", "p1-async-blockwise8", "p2-async-blockwise8")
CURVE_POINTS = 150  # loss-vs-tokens points kept per run (means of equal runs of steps)


# ------------------------------------------------------------------------------------ configuration


@dataclass(frozen=True, kw_only=True)
class ConvergenceConfig:
    """The matrix and the protocol. Units: micro-batches (mb) unless named otherwise."""

    spec_path: str = "examples/demo.yaml"
    """Base run spec (model, stages, optimizer, averaging); every run changes only what :func:`job_spec`
    says."""
    overrides: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_OVERRIDES))
    """Dotted spec keys replaced for every run (``--set optimizer.lr=2e-3``); the defaults make optimizer
    steps of 2 micro-batches with 20 steps of LR warm-up."""
    micro_batches: int = 600
    """Training micro-batches per run (equal tokens); a multiple of ``optimizer.accumulate``."""
    eval_tokens: int = 65536
    """Held-out tokens the final models are evaluated on (rounded up to whole micro-batches)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    corpora: tuple[str, ...] = ("stdlib", "pydoc")
    corpus_paths: dict[str, str] = field(default_factory=dict)
    """Corpora added or replaced by name: ``{name: file or directory}`` (``--corpus NAME=PATH``)."""
    data_bytes: int = DEFAULT_MAX_BYTES
    """Text read per corpus (swarm.train.data's ``max_bytes``)."""
    peers: tuple[int, ...] = (1, 2, 4)
    """Peers per stage of the swarm layouts."""
    modes: tuple[str, ...] = ("sync", "async")
    codecs: tuple[str, ...] = ("none", "blockwise8")
    subspace_ratio: int | None = 32
    """The subspace model's ratio (k = d_model / ratio); None = no subspace runs."""
    subspace_codec: str = "blockwise8"
    churn_every_s: float | None = 25.0
    """Seconds between SIGKILLs of the churn run; None = no churn run."""
    churn_peers: int = 2
    max_inflight: int | None = None
    """Micro-batches in flight (async); None = the trainer's rule of thumb (``inflight_rule_of_thumb``:
    max(2 x stages, peers))."""
    throughput_warmup_mb: int = 40
    """Micro-batches left out of the tokens/s median (start-up, warm-up)."""
    throughput_window_mb: int = 16
    """Window of the tokens/s median."""
    reference_threads: int | None = 1
    """torch threads of the reference runs (None = torch's default); one thread is the fastest on a
    machine whose cores are busy (see benchmarks/links.py, Note [threads])."""
    start_timeout_s: float = 300.0
    run_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("micro_batches", "eval_tokens", "churn_peers", "throughput_window_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be at least 1")
        if not self.seeds or not self.corpora:
            raise ConfigError("give at least one seed (--seeds) and one corpus (--corpora)")
        for p in self.peers:
            if not isinstance(p, int) or p < 1:
                raise ConfigError(f"peers per stage {p!r} must be a whole number >= 1")
        for m in self.modes:
            if m not in ("sync", "async"):
                raise ConfigError(f"mode {m!r} must be sync or async")
        if self.churn_every_s is not None and not self.churn_every_s > 0:
            raise ConfigError(
                f"churn_every_s = {self.churn_every_s} must be positive, or None for no churn run"
            )
        if self.churn_peers < 2:
            raise ConfigError(f"churn_peers = {self.churn_peers}: a stage needs a survivor, so at least 2")
        if self.subspace_ratio is not None and self.subspace_ratio < 1:
            raise ConfigError(f"subspace_ratio = {self.subspace_ratio} must be >= 1 (k = d_model / ratio)")


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with a dotted spec key; the value is read as YAML (numbers, true/false, null, lists)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r} must look like optimizer.lr=2e-3 (a dotted spec key = a value)")
    parsed = yaml.safe_load(value)
    if isinstance(
        parsed, str
    ):  # YAML 1.1 reads 2e-3 (no dot) as a string; the spec files read it as a number
        with contextlib.suppress(ValueError):
            parsed = float(parsed)
    return key.strip(), parsed


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            raise ConfigError(
                f"--set {key}: {part!r} is not a section of the run spec; see examples/tiny.yaml"
            )
        node = node[part]
    node[parts[-1]] = value


def base_spec_dict(cfg: ConvergenceConfig) -> dict[str, Any]:
    """The base spec with the overrides, as a plain dict (validated by :func:`job_spec`)."""
    path = cfg.spec_path if os.path.isabs(cfg.spec_path) else str(ROOT / cfg.spec_path)
    data = json.loads(json.dumps(_load_spec(path).to_dict()))
    for key, value in cfg.overrides.items():
        _set_dotted(data, key, value)
    return data


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Job:
    """One run: ``kind`` reference | swarm."""

    kind: str
    seed: int = 0
    corpus: str = "stdlib"
    optimizer: str | None = None
    """reference: ``stage`` (StageOptimizer) or ``torch_adamw``."""
    peers: int = 0
    """swarm: peers per stage."""
    mode: str | None = None
    codec: str | None = None
    subspace: int | None = None
    """the model's subspace ratio; None = the ordinary model."""
    churn: bool = False

    @property
    def config(self) -> str:
        """The configuration's id, e.g. ``p2-async-blockwise8-churn`` or ``ref-stage-ss32``."""
        sub = f"-ss{self.subspace}" if self.subspace else ""
        if self.kind == "reference":
            return ("ref-stage" if self.optimizer == "stage" else "ref-adamw") + sub
        return f"p{self.peers}-{self.mode}-{self.codec}{sub}" + ("-churn" if self.churn else "")

    @property
    def key(self) -> str:
        return f"{self.config}/{self.corpus}/seed{self.seed}"

    @property
    def reference_config(self) -> str:
        """The configuration every ratio of this run is taken against."""
        return "ref-stage" + (f"-ss{self.subspace}" if self.subspace else "")

    def describe(self, churn_every_s: float | None = None) -> str:
        if self.kind == "reference":
            opt = (
                "StageOptimizer (the spec's optimizer)" if self.optimizer == "stage" else "torch.optim.AdamW"
            )
            model = f", subspace d/{self.subspace}" if self.subspace else ""
            return f"one process, {opt}{model}"
        text = f"swarm {self.peers} peer(s)/stage, {self.mode}, {self.codec}"
        if self.subspace:
            text += f", subspace d/{self.subspace}"
        if self.churn:
            text += f", SIGKILL + replacement every {churn_every_s:g} s" if churn_every_s else ", churn"
        return text


def configurations(cfg: ConvergenceConfig) -> list[Job]:
    """Every configuration of the matrix (seed and corpus left at their defaults), references first."""
    jobs = [Job("reference", optimizer="stage"), Job("reference", optimizer="torch_adamw")]
    if cfg.subspace_ratio:
        jobs.append(Job("reference", optimizer="stage", subspace=cfg.subspace_ratio))
    for peers in cfg.peers:
        for mode in cfg.modes:
            for codec in cfg.codecs:
                jobs.append(Job("swarm", peers=peers, mode=mode, codec=codec))
    if cfg.subspace_ratio:
        for mode in cfg.modes:
            jobs.append(
                Job("swarm", peers=1, mode=mode, codec=cfg.subspace_codec, subspace=cfg.subspace_ratio)
            )
    if cfg.churn_every_s:
        jobs.append(Job("swarm", peers=cfg.churn_peers, mode="async", codec="blockwise8", churn=True))
    return list({j.config: j for j in jobs}.values())


def plan(cfg: ConvergenceConfig, select: Sequence[str] = ()) -> list[Job]:
    """The runs, in order (pure; ``--plan`` prints it): per corpus and seed, references, then swarms.

    ``select``: configuration ids or shell patterns (``p2-*``); empty = all. The reference a selected
    configuration's ratio needs is always included.
    """
    confs = configurations(cfg)
    ids = [j.config for j in confs]
    if select:
        unknown = [s for s in select if not fnmatch.filter(ids, s)]
        if unknown:
            raise ConfigError(
                f"--configs {' '.join(unknown)} matches no configuration; they are: {' '.join(ids)}"
            )
        chosen = {i for i in ids if any(fnmatch.fnmatchcase(i, s) for s in select)}
        chosen |= {j.reference_config for j in confs if j.config in chosen}
        confs = [j for j in confs if j.config in chosen]
    return [
        replace(j, seed=seed, corpus=corpus) for corpus in cfg.corpora for seed in cfg.seeds for j in confs
    ]


def target_for(job: Job) -> float | None:
    """The issue's bound on a run's held-out loss ratio (mean of seeds) to ``ref-stage``; None = none.

    By layout: 1 peer/stage sync 1.01, async 1.02; more peers sync 1.02, async 1.03; with churn 1.04.
    """
    if job.kind != "swarm":
        return None
    if job.churn:
        return 1.04
    if job.peers == 1:
        return 1.01 if job.mode == "sync" else 1.02
    return 1.02 if job.mode == "sync" else 1.03


def job_spec(cfg: ConvergenceConfig, job: Job, *, tag: str = ""):
    """The ``RunSpec`` of one run: the base spec, the run's seed, codec, mode and model."""
    from swarm.run.spec import RunSpec

    data = base_spec_dict(cfg)
    data["run_id"] = f"conv-{job.config}-{job.corpus}-s{job.seed}{tag}"[:64]
    data["seed"] = job.seed
    if job.kind == "swarm":
        data["codecs"] = {"activations": job.codec, "gradients": job.codec}
        data["optimizer"]["mode"] = job.mode
    if job.subspace:
        data["model"]["subspace"] = {"ratio": job.subspace}
    spec = RunSpec.from_dict(data)
    acc = spec.optimizer.accumulate
    if cfg.micro_batches % acc:
        raise ConfigError(
            f"micro_batches = {cfg.micro_batches} must be a multiple of optimizer.accumulate = {acc} "
            "(runs train whole optimizer steps)"
        )
    return spec


# ------------------------------------------------------------------------------------------- corpora


@dataclass(frozen=True)
class Corpus:
    name: str
    source: str | None
    """A ``swarm.train.data`` source (file or directory); None = swarm.train.data's default corpus."""
    about: str


def _pydoc_topics() -> str | None:
    spec = importlib.util.find_spec("pydoc_data.topics")
    return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None


CORPORA: dict[str, Callable[[], Corpus]] = {
    "stdlib": lambda: Corpus(
        "stdlib", None, "the Python standard library's .py sources (swarm.train.data's default)"
    ),
    "pydoc": lambda: Corpus(
        "pydoc",
        _pydoc_topics(),
        "Python's reference documentation as `help()` shows it (pydoc_data/topics.py of the standard library)",
    ),
}


def resolve_corpus(cfg: ConvergenceConfig, name: str) -> Corpus:
    """The corpus ``name`` (``--corpus NAME=PATH`` first); ConfigError with the way out if it is missing."""
    if name in cfg.corpus_paths:
        path = cfg.corpus_paths[name]
        if not os.path.exists(path):
            raise ConfigError(f"corpus {name}={path}: no such file or directory")
        return Corpus(name, os.path.abspath(path), f"`{path}`")
    if name not in CORPORA:
        raise ConfigError(
            f"unknown corpus {name!r}; built in: {', '.join(CORPORA)}; add one with --corpus {name}=PATH"
        )
    corpus = CORPORA[name]()
    if name == "pydoc" and corpus.source is None:
        raise ConfigError(
            "corpus 'pydoc' (pydoc_data/topics.py) is not part of this Python installation (some "
            "distributions strip it); run with --corpora stdlib, or give another text with --corpus pydoc=PATH "
            "(e.g. a directory of .txt files)"
        )
    return corpus


def held_out_fraction(
    n_tokens: int, *, eval_tokens: int, batch: int, seq_len: int, floor: float = 0.05
) -> float:
    """The held-out fraction that gives ``eval_tokens`` (whole micro-batches of ``batch`` windows) in
    non-overlapping windows of ``seq_len + 1`` tokens, at least ``floor`` (pure)."""
    windows = -(-eval_tokens // (batch * seq_len)) * batch
    need = (windows + 1) * (seq_len + 1)
    frac = max(floor, math.ceil(need / n_tokens * 1.01 * 1e4) / 1e4)
    if frac >= 0.5:
        raise ConfigError(
            f"a corpus of {n_tokens} tokens cannot hold {eval_tokens} held-out tokens in separate windows "
            f"and still train on the larger part; give more text or lower --eval-tokens"
        )
    return frac


def corpus_data(cfg: ConvergenceConfig, corpus: Corpus, spec) -> dict[str, Any]:
    """What every run on ``corpus`` reads: its ``swarm.train.data.DataConfig`` fields and sizes."""
    from swarm.train.data import read_documents

    docs = read_documents(corpus.source, max_bytes=cfg.data_bytes)
    n = len("\n".join(docs).encode("utf-8", errors="replace"))  # byte-level tokens
    frac = held_out_fraction(
        n, eval_tokens=cfg.eval_tokens, batch=spec.micro_batch_size, seq_len=spec.model.seq_len
    )
    return {
        "name": corpus.name,
        "source": corpus.source,
        "about": corpus.about,
        "tokens": n,
        "held_out_fraction": frac,
        "held_out_tokens": max(spec.model.seq_len + 1, int(n * frac)),
        "max_bytes": cfg.data_bytes,
    }


def _data_config(data: dict[str, Any]):
    from swarm.train.data import DataConfig

    return DataConfig(
        source=data["source"], max_bytes=data["max_bytes"], held_out_fraction=data["held_out_fraction"]
    )


# ------------------------------------------------------------------------------- one swarm (worker)


def _online(demo, stage: int) -> list:
    return [
        p for p in demo.peers if p.stage == stage and not p.killed and p.peer_id and p.popen.poll() is None
    ]


async def _churn(demo, every_s: float, rng: random.Random, kills: list[dict], fresh: list, t0: float) -> None:
    """Every ``every_s``: SIGKILL a random peer of a random stage that has two online peers (waiting
    while none has: a replacement is still starting) and start a fresh peer for its stage."""
    due = time.monotonic() + every_s
    while True:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        crowded = [s for s in range(demo.spec.num_stages) if len(_online(demo, s)) >= 2]
        if not crowded:
            await asyncio.sleep(0.5)
            continue
        stage = rng.choice(crowded)
        victim = rng.choice(_online(demo, stage))
        late_s = time.monotonic() - due
        demo.kill_peer(victim)
        while victim.popen.poll() is None:  # quick after SIGKILL
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # its DHT child and p2pd die with the group
        remove_stale_sockets(demo.socket_prefix)
        kills.append(
            {
                "t_s": round(time.monotonic() - t0, 1),
                "stage": stage,
                "peer": victim.peer_id,
                "late_s": round(late_s, 1),
            }
        )
        fresh.append(asyncio.ensure_future(demo.add_peer_async(stage, name=f"r{len(kills)}")))
        due = time.monotonic() + every_s


async def _train(demo, trainer, churn_every_s: float | None, seed: int, kills: list[dict]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    run = loop.create_task(trainer.run())
    fresh: list[asyncio.Future] = []
    t0 = time.monotonic()
    churn = (
        loop.create_task(_churn(demo, churn_every_s, random.Random(seed), kills, fresh, t0))
        if churn_every_s
        else None
    )
    try:
        return await run
    finally:
        if churn is not None:
            churn.cancel()
            [outcome] = await asyncio.gather(churn, return_exceptions=True)
            for f in fresh:  # a replacement still starting is stopped with the swarm
                f.cancel()
            for res in await asyncio.gather(*fresh, return_exceptions=True):
                if isinstance(res, Exception):  # it exited before coming online: say so in the result
                    kills.append({"replacement_failed": f"{type(res).__name__}: {res}"[:500]})
            if isinstance(outcome, Exception):  # a broken churn loop must not pass silently
                raise outcome


def train_swarm(cfg: ConvergenceConfig, job: Job, spec, data: dict[str, Any], work: Path) -> dict[str, Any]:
    """One swarm run in this process (the worker): start, train, export, stop; then evaluate the export."""
    from benchmarks.links import swarm_figures
    from swarm.dht.network import DHTConfig
    from swarm.tools.demo import Demo, DemoConfig
    from swarm.tools.export import ExportConfig, export_run, load_model
    from swarm.train.data import build_data
    from swarm.train.metrics import read_metrics
    from swarm.train.reference import held_out_loss
    from swarm.train.trainer import Trainer, TrainerConfig, inflight_rule_of_thumb

    dcfg = _data_config(data)
    tokens = cfg.micro_batches * spec.tokens_per_micro_batch
    inflight = cfg.max_inflight or inflight_rule_of_thumb(spec.num_stages, job.peers * spec.num_stages)
    demo = Demo(
        DemoConfig(
            spec=spec,
            peers_per_stage=job.peers,
            out_dir=str(work / "swarm"),
            peer_args=PEER_ARGS,
            start_timeout_s=cfg.start_timeout_s,
            quiet=True,
        )
    )
    kills: list[dict] = []
    t0 = time.monotonic()
    previous = terminate_as_interrupt((signal.SIGTERM, signal.SIGINT))  # the driver stops us with SIGTERM
    try:
        demo.start()
        startup_s = time.monotonic() - t0
        print(f"{len(demo.peers)} peers online after {startup_s:.1f} s", flush=True)
        trainer = Trainer(
            TrainerConfig(
                initial_peers=(demo.maddr,),
                run_id=spec.run_id,
                data=dcfg,
                tokens=tokens,
                max_inflight=inflight,
                pacing=cfg.max_inflight
                is None,  # --max-inflight K: exactly K (swarm/train/pacing.py otherwise)
                max_attempts=8,
                out_dir=str(work / "train"),
                seed=job.seed,
                trainer_id="convergence",
                quiet=True,
                refresh_every_s=1.0,
            )
        )
        summary = asyncio.run(
            _train(demo, trainer, cfg.churn_every_s if job.churn else None, job.seed, kills)
        )
        train_s = time.monotonic() - t0 - startup_s
        print(f"trained {summary.get('tokens')} tokens in {train_s:.1f} s; exporting", flush=True)
        export = export_run(
            ExportConfig(
                dht=DHTConfig(initial_peers=(demo.maddr,), client_mode=True),
                run_id=spec.run_id,
                out_dir=str(work / "export"),
                max_step_lag=EXPORT_MAX_STEP_LAG,
                overwrite=True,
            )
        )
    finally:
        demo.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    leftovers = demo.leftovers()
    rounds = round_counters(demo.logs, spec.num_stages)
    model = load_model(work / "export")
    token_data, _ = build_data(dcfg, seq_len=spec.model.seq_len, vocab_size=spec.model.vocab_size)
    eval_loss, held = held_out_loss(model, token_data, batch=spec.micro_batch_size, tokens=cfg.eval_tokens)
    records = read_metrics(work / "train" / "metrics.jsonl")
    fig = swarm_figures(
        records,
        summary,
        tokens_per_mb=spec.tokens_per_micro_batch,
        warmup_mb=cfg.throughput_warmup_mb,
        window_mb=cfg.throughput_window_mb,
    )
    return {
        "tokens": fig["tokens"],
        "tokens_per_s": fig["tokens_per_s"],
        "tokens_per_s_overall": fig["tokens"] / fig["train_s"] if fig["train_s"] else None,
        "losses": fig["losses"],
        "eval_loss": eval_loss,
        "held_out_tokens": held,
        "completed": fig["completed"],
        "dropped": fig["dropped"],
        "retries": fig["retries"],
        "startup_s": startup_s,
        "train_s": train_s,
        "max_inflight": inflight,
        "kills": kills,
        "peers_killed": len([k for k in kills if "stage" in k]),
        "export": {
            "stages": [
                {"stage": s.stage, "version": s.version, "step_count": s.step_count} for s in export.stages
            ],
            "notes": list(export.notes),
        },
        "peers_by_stage": summary.get("peers_by_stage"),
        "staleness": summary.get("staleness"),  # per stage: mean versions between forward and backward
        "applied_staleness": summary.get("applied_staleness"),  # ... and the step that applied it
        "leftover_pids": leftovers,
        "rounds": rounds,
    }


ROUND_COUNTERS = (
    "rounds",
    "rounds_failed",
    "solo_steps",
    "caught_up",
    "diverged",
    "partial_rounds",
    "micro_batches_combined",
)


def round_counters(logs: Path, stages: int) -> dict[str, list[dict[str, int]]]:
    """Per stage, each peer's replica-round counters (peer/replicas.py) from its stop line: how the
    stage's steps came about (rounds, solo steps after failed rounds, catch-up downloads). A peer killed
    by churn writes no stop line and is missing here."""
    from benchmarks.bubbles import peer_stop_counters

    out: dict[str, list[dict[str, int]]] = {}
    for s in range(stages):
        found = [c for c in (peer_stop_counters(p) for p in sorted(logs.glob(f"peer-s{s}-*.log"))) if c]
        out[str(s)] = [{k: int(c.get(k, 0)) for k in ROUND_COUNTERS} for c in found]
    return out


def _worker_main(job_path: str, out_path: str) -> int:
    from swarm.run.spec import RunSpec

    payload = json.loads(Path(job_path).read_text())
    cfg = _config_from_dict(payload["config"])
    job = Job(**payload["job"])
    spec = RunSpec.from_dict(payload["spec"])
    result = train_swarm(cfg, job, spec, payload["data"], Path(payload["work"]))
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(out_path)
    return 0


# ------------------------------------------------------------------------------------------ driver


def socket_prefix() -> str:
    """The hivemind socket-file prefix of every process this benchmark starts (stale ones are removed)."""
    return child_socket_prefix("conv")


def _stop_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the worker (it stops its swarm); after ``grace_s`` SIGKILL it and every descendant it had,
    also those in process groups of their own (stage peers) or orphaned by its death."""
    import psutil

    def tree() -> list[psutil.Process]:
        try:
            root = psutil.Process(proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    seen = tree()
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    for p in {p.pid: p for p in [*seen, *tree()]}.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


class _Progress:
    """Prints a progress line from a run's metrics.jsonl every ``every_s`` while the run goes on."""

    def __init__(self, path: Path, total_tokens: int, say: Callable[[str], None], every_s: float = 30.0):
        self.path, self.total, self.say, self.every_s = path, total_tokens, say, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="convergence-progress", daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)

    def _loop(self) -> None:
        from swarm.train.metrics import read_metrics

        while not self._stop.wait(self.every_s):
            steps = read_metrics(self.path, "step") if self.path.exists() else []
            elapsed = time.monotonic() - self._t0
            if not steps:
                self.say(f"      {elapsed:4.0f} s: starting")
                continue
            last = steps[-1]
            loss = smooth([s["loss"] for s in steps if s.get("loss") is not None], 10)
            self.say(
                f"      {elapsed:4.0f} s: {last['tokens'] / 1e3:.0f}k / {self.total / 1e3:.0f}k tokens, "
                f"train loss {cell(loss[-1] if loss else None, '.3f')}"
            )


def run_job(
    cfg: ConvergenceConfig, job: Job, data: dict[str, Any], work: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    """One run (a reference in a child process, or a swarm in a worker process); its result record."""
    from benchmarks.single_process import SingleConfig, run_single

    work.mkdir(parents=True, exist_ok=True)
    spec = job_spec(cfg, job, tag=f"-{os.getpid()}")
    total = cfg.micro_batches * spec.tokens_per_micro_batch
    t = time.perf_counter()
    if job.kind == "reference":
        spec_path = work / "spec.json"
        spec_path.write_bytes(spec.canonical_bytes())
        acc = spec.optimizer.accumulate
        steps = cfg.micro_batches // acc
        metrics = work / "metrics.jsonl"
        scfg = SingleConfig(
            spec_path=str(spec_path),
            accumulate=acc,
            steps=steps,
            warmup_steps=min(steps - 1, cfg.throughput_warmup_mb // acc),
            seed=job.seed,
            data_bytes=data["max_bytes"],
            threads=cfg.reference_threads,
            timeout_s=cfg.run_timeout_s,
            optimizer=job.optimizer or "stage",
            data_source=data["source"],
            held_out_fraction=data["held_out_fraction"],
            eval_tokens=cfg.eval_tokens,
            metrics_path=str(metrics),
        )
        with _Progress(metrics, total, say):
            res = run_single(scfg, work)
        out = {
            k: res.get(k)
            for k in ("tokens_per_s", "losses", "eval_loss", "held_out_tokens", "threads", "optimizer_name")
        }
        out["tokens"] = res["losses"][-1]["tokens"] if res["losses"] else 0
        out["train_s"] = res["losses"][-1]["wall_s"] if res["losses"] else None
        out["tokens_per_s_overall"] = out["tokens"] / out["train_s"] if out["train_s"] else None
    else:
        job_path, out_path, log_path = work / "job.json", work / "result.json", work / "worker.log"
        payload = {
            "config": asdict(cfg),
            "job": asdict(job),
            "spec": spec.to_dict(),
            "data": data,
            "work": str(work),
        }
        job_path.write_text(json.dumps(payload))
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "HIVEMIND_LOGLEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
            SOCKET_PREFIX_ENV: socket_prefix(),
        }
        argv = [
            sys.executable,
            "-m",
            "benchmarks.convergence",
            "--worker",
            str(job_path),
            "--out",
            str(out_path),
        ]
        with open(log_path, "wb") as log, _Progress(work / "train" / "metrics.jsonl", total, say):
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(ROOT),
                env=env,
                start_new_session=True,
            )
            try:
                proc.wait(cfg.run_timeout_s)
            except subprocess.TimeoutExpired:
                raise SwarmError(
                    f"{job.key}: the run did not finish within {cfg.run_timeout_s:.0f} s"
                ) from None
            finally:
                if proc.poll() is None:
                    _stop_tree(proc, grace_s=60.0)
                remove_stale_sockets(socket_prefix())
        if proc.returncode != 0 or not out_path.exists():
            raise SwarmError(
                f"{job.key}: worker exited with {proc.returncode}; {log_path} ends with:\n"
                + log_path.read_text(errors="replace")[-2000:]
            )
        out = json.loads(out_path.read_text())
    out.update(
        {
            "key": job.key,
            "config": job.config,
            "job": asdict(job),
            "spec_hash": spec.spec_hash,
            "micro_batches": cfg.micro_batches,
            "wall_s": time.perf_counter() - t,
            "losses": bin_curve(out.get("losses") or []),
        }
    )
    return out


def bin_curve(points: list[dict[str, Any]], max_points: int = CURVE_POINTS) -> list[dict[str, Any]]:
    """At most ``max_points`` loss-vs-tokens points: means of consecutive, equally many points (pure)."""
    pts = [p for p in points if p.get("loss") is not None]
    if len(pts) <= max_points:
        return [{"tokens": p["tokens"], "wall_s": p.get("wall_s"), "loss": p["loss"]} for p in pts]
    out = []
    for i in range(max_points):
        part = pts[i * len(pts) // max_points : (i + 1) * len(pts) // max_points]
        out.append(
            {
                "tokens": part[-1]["tokens"],
                "wall_s": part[-1].get("wall_s"),
                "loss": sum(p["loss"] for p in part) / len(part),
            }
        )
    return out


def protocol(cfg: ConvergenceConfig) -> dict[str, Any]:
    """What must agree between runs for their losses to compare (the results file refuses a mix)."""
    return {
        "spec": base_spec_dict(cfg),
        "micro_batches": cfg.micro_batches,
        "eval_tokens": cfg.eval_tokens,
        "data_bytes": cfg.data_bytes,
        "churn_every_s": cfg.churn_every_s,
        "max_inflight": cfg.max_inflight,
    }


def _config_from_dict(d: dict[str, Any]) -> ConvergenceConfig:
    known = {f.name for f in fields(ConvergenceConfig)}
    return ConvergenceConfig(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
    )


def run_matrix(
    cfg: ConvergenceConfig,
    jobs: list[Job],
    *,
    name: str,
    command: str,
    say: Callable[[str], None] = print,
    results_dir: Path = RESULTS_DIR,
    fresh: bool = False,
    skip_done: bool = False,
) -> dict[str, Any]:
    """Run ``jobs``; merge them into ``results/NAME.json`` (rewritten after every run), plot, analyse."""
    import tempfile

    results_dir.mkdir(parents=True, exist_ok=True)
    out_json = results_dir / f"{name}.json"
    proto = protocol(cfg)
    report: dict[str, Any] = {"name": name, "protocol": proto, "results": []}
    if out_json.exists() and not fresh:
        old = json.loads(out_json.read_text())
        if old.get("protocol") != proto:
            raise ConfigError(
                f"{out_json} holds runs of another protocol (spec, micro-batches, held-out tokens, data or churn "
                "differ), which do not compare with these; pass --fresh to replace it or --name to write another file"
            )
        report = old
    base = job_spec(cfg, Job("reference", optimizer="stage"))
    corpora = {}
    for c in dict.fromkeys(j.corpus for j in jobs):
        corpora[c] = corpus_data(cfg, resolve_corpus(cfg, c), base)
    report.update(
        {
            "command": command,
            "config": asdict(cfg),
            "machine": machine_info(),
            "n_params": base.n_params(),
            "num_stages": base.num_stages,
            "micro_batch": f"{base.micro_batch_size}x{base.model.seq_len}",
            "tokens_per_mb": base.tokens_per_micro_batch,
            "optimizer": base.to_dict()["optimizer"],
            "corpora": {**report.get("corpora", {}), **corpora},
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
    )
    done = {r["key"] for r in report["results"] if not r.get("error")}
    todo = [j for j in jobs if not (skip_done and j.key in done)]
    if len(todo) < len(jobs):
        say(f"skipping {len(jobs) - len(todo)} runs already in {out_json.name} (--skip-done)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="swarmpipe-convergence-") as tmp:
        for i, job in enumerate(todo):
            say(
                f"[{i + 1}/{len(todo)}] {job.key}: {job.describe(cfg.churn_every_s)} ({time.perf_counter() - t0:.0f} s elapsed)"
            )
            load0 = os.getloadavg()[0]
            try:
                res = run_job(cfg, job, corpora[job.corpus], Path(tmp) / f"run{i}", say)
            except (SwarmError, ConfigError, OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
                res = {
                    "key": job.key,
                    "config": job.config,
                    "job": asdict(job),
                    "error": f"{type(e).__name__}: {e}",
                }
                say(f"    FAILED: {res['error'][:800]}")
            res["load_1min"] = [round(load0, 1), round(os.getloadavg()[0], 1)]
            report["results"] = [r for r in report["results"] if r["key"] != job.key] + [res]
            if not res.get("error"):
                ratio = _ratio_of(res, report["results"])
                say(
                    f"    held-out {res['eval_loss']:.4f}"
                    + (f" (ratio to {job.reference_config} {ratio:.4f})" if ratio else "")
                    + f", {cell(res.get('tokens_per_s'))} tokens/s, {res['wall_s']:.0f} s"
                    + (f", {res['peers_killed']} peers killed" if job.churn else "")
                )
            report["wall_min"] = (time.perf_counter() - t0) / 60
            out_json.write_text(json.dumps(report, indent=1, default=str))
    report["analysis"] = analyse(report["results"])
    report["plots"] = [str(plot(report, results_dir / f"{name}_loss_tokens.png"))]
    out_json.write_text(json.dumps(report, indent=1, default=str))
    return report


# ---------------------------------------------------------------------------------------- analysis


def _job(r: dict[str, Any]) -> Job:
    return Job(**r["job"])


def _ratio_of(r: dict[str, Any], results: list[dict[str, Any]]) -> float | None:
    """``r``'s held-out loss over that of its reference run (same corpus, seed, model), or None."""
    job = _job(r)
    ref_key = replace(
        job, kind="reference", optimizer="stage", peers=0, mode=None, codec=None, churn=False
    ).key
    ref = next((x for x in results if x["key"] == ref_key and not x.get("error")), None)
    if ref is None or r.get("eval_loss") is None or not ref.get("eval_loss") or r["key"] == ref_key:
        return None
    return r["eval_loss"] / ref["eval_loss"]


def _overall_rate(r: dict[str, Any]) -> float | None:
    """Tokens / training seconds of a run (stored, or from the end of its loss curve)."""
    if r.get("tokens_per_s_overall"):
        return r["tokens_per_s_overall"]
    last = (r.get("losses") or [{}])[-1]
    return r["tokens"] / last["wall_s"] if r.get("tokens") and last.get("wall_s") else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _mean_by_stage(per_run: list[dict[str, float] | None]) -> dict[str, float]:
    """Per stage, the mean over the runs that report it (runs before the figure existed do not)."""
    values: dict[str, list[float]] = {}
    for d in per_run:
        for stage, v in (d or {}).items():
            values.setdefault(stage, []).append(float(v))
    return {st: round(statistics.fmean(v), 2) for st, v in sorted(values.items(), key=lambda kv: int(kv[0]))}


def analyse(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration and corpus: held-out loss and its ratio to the reference over seeds (mean, min,
    max, sample standard deviation), the target and whether the mean meets it, tokens/s (pure)."""
    ok = [r for r in results if not r.get("error")]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault((r["config"], r["job"]["corpus"]), []).append(r)
    order = {j.config: i for i, j in enumerate(configurations(ConvergenceConfig()))}
    rows = []
    for (conf, corpus), runs in sorted(
        groups.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 99), kv[0][0])
    ):
        runs = sorted(runs, key=lambda r: r["job"]["seed"])
        job = _job(runs[0])
        ratios = [x for x in (_ratio_of(r, results) for r in runs) if x is not None]
        target = target_for(job)
        mean = _mean(ratios)
        rows.append(
            {
                "config": conf,
                "corpus": corpus,
                "kind": job.kind,
                "seeds": [r["job"]["seed"] for r in runs],
                "eval_loss_mean": _mean([r["eval_loss"] for r in runs]),
                "ratio_seeds": len(ratios),
                "ratio_mean": mean,
                "ratio_min": min(ratios) if ratios else None,
                "ratio_max": max(ratios) if ratios else None,
                "ratio_sd": statistics.stdev(ratios) if len(ratios) >= 2 else None,
                "target": target,
                "met": None if target is None or mean is None else mean <= target,
                "tokens_per_s_mean": _mean([r["tokens_per_s"] for r in runs if r.get("tokens_per_s")]),
                "tokens_per_s_overall_mean": _mean([x for x in map(_overall_rate, runs) if x]),
                "wall_s_mean": _mean([r["wall_s"] for r in runs if r.get("wall_s")]),
                "peers_killed": sum(r.get("peers_killed") or 0 for r in runs),
                "dropped": sum(r.get("dropped") or 0 for r in runs),
                "step_counts": [
                    [s["step_count"] for s in r["export"]["stages"]] for r in runs if r.get("export")
                ],
                "applied_staleness": _mean_by_stage([r.get("applied_staleness") for r in runs]),
            }
        )
    failed = [{"key": r["key"], "error": r["error"]} for r in results if r.get("error")]
    met = [r for r in rows if r["met"] is True]
    missed = [r for r in rows if r["met"] is False]
    return {"rows": rows, "failed": failed, "met": len(met), "missed": len(missed)}


# ---------------------------------------------------------------------------------------- plot


def plot(report: dict[str, Any], path: Path) -> Path:
    """Training loss (smoothed) against tokens, one panel per corpus, the lowest seed of every
    configuration; the references in black and grey."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in report["results"] if not r.get("error") and r.get("losses")]
    corpora = list(dict.fromkeys(r["job"]["corpus"] for r in ok)) or ["-"]
    fig = Figure(figsize=(7.5 * len(corpora), 4.8))
    FigureCanvasAgg(fig)
    for i, corpus in enumerate(corpora):
        ax = fig.add_subplot(1, len(corpora), i + 1)
        firsts: dict[str, dict[str, Any]] = {}
        for r in sorted(ok, key=lambda r: r["job"]["seed"]):
            if r["job"]["corpus"] == corpus:
                firsts.setdefault(r["config"], r)
        for conf, r in firsts.items():
            pts = r["losses"]
            style: dict[str, Any] = {"lw": 1.0}
            if conf.startswith("ref-"):
                style = {
                    "lw": 2.0,
                    "color": "black" if conf == "ref-stage" else "grey",
                    "ls": "-" if "adamw" not in conf else ":",
                }
            elif "-sync-" in conf:
                style["ls"] = "-"
            else:
                style["ls"] = "--"
            ax.plot(
                [p["tokens"] for p in pts],
                smooth([p["loss"] for p in pts], 5),
                label=f"{conf} (seed {r['job']['seed']})",
                **style,
            )
        ax.set_xlabel("tokens")
        ax.set_ylabel("training loss (smoothed)")
        ax.set_title(f"corpus {corpus}: loss vs tokens")
        ax.grid(alpha=0.3)
        if firsts:
            ax.legend(fontsize=6, ncol=2)
            lows = [min(p["loss"] for p in r["losses"]) for r in firsts.values()]
            ax.set_ylim(min(lows) - 0.1, min(lows) + 2.0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


# -------------------------------------------------------------------------------------- markdown


def _protocol_warning(report: dict[str, Any], seeds: list[int]) -> list[str]:
    """A warning paragraph when the runs fall short of the issue's protocol (>= 600k tokens, >= 64k
    held-out tokens, 3 seeds, 2 corpora), so that a smoke run is never read as the benchmark."""
    cfg = report["config"]
    corpora = {r["job"]["corpus"] for r in report["results"] if not r.get("error")}
    short = []
    if cfg["micro_batches"] * report["tokens_per_mb"] < 600_000:
        short.append(f"{cfg['micro_batches'] * report['tokens_per_mb']:,} tokens per run instead of >= 600k")
    if cfg["eval_tokens"] < 65536:
        short.append(f"{cfg['eval_tokens']:,} held-out tokens instead of >= 64k")
    if len(seeds) < 3:
        short.append(f"{len(seeds)} seed(s) instead of 3")
    if len(corpora) < 2:
        short.append(f"{len(corpora)} corpus instead of 2")
    if not short:
        return []
    return [
        f"**Not the full protocol** ({'; '.join(short)}): the verdicts below are indicative only; "
        "`python -m benchmarks.convergence` runs the whole matrix.",
        "",
    ]


def markdown_section(report: dict[str, Any]) -> str:
    """The "Convergence" section of BENCHMARKS.md from a report (pure)."""
    cfg = report["config"]
    m = report["machine"]
    a = report["analysis"]
    seeds = sorted({r["job"]["seed"] for r in report["results"] if not r.get("error")})
    lines = [
        SECTION,
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores, {m['memory_gib']:.0f} GiB, torch {m['torch']}, hivemind "
        f"{m['hivemind']}, Python {m['python']}; every swarm on loopback. Load average at start {m['load_start']}.",
        "",
        f"Command: `{report['command']}` ({report.get('wall_min', 0):.0f} min for the runs of that command; results "
        f"in `benchmarks/results/{report['name']}.json`).",
        "",
        f"Model: `{cfg['spec_path']}` with {cfg['overrides']} ({report['n_params'] / 1e6:.2f}M parameters, "
        f"{report['num_stages']} stages, micro-batch {report['micro_batch']}); optimizer "
        + ", ".join(f"{k} {v}" for k, v in report["optimizer"].items() if v is not None and k != "mode")
        + ". "
        f"Every run: {cfg['micro_batches']} micro-batches ({cfg['micro_batches'] * report['tokens_per_mb']:,} "
        f"tokens, {cfg['micro_batches'] // report['optimizer'].get('accumulate', 1)} optimizer steps per stage); "
        f"held-out loss of the final (for a swarm: exported) model on {cfg['eval_tokens']:,} held-out "
        f"tokens; seeds {seeds} (data stream and initial weights); in-flight micro-batches "
        f"{cfg['max_inflight'] or 'paced by the trainer (swarm/train/pacing.py) from the number of stages up to max(2 x stages, peers)'}"
        "; churn run: a SIGKILL every "
        f"{cell(cfg['churn_every_s'], 'g')} s.",
        "",
        "Corpora: "
        + "; ".join(
            f"`{c['name']}` ({c['about']}, {c['tokens'] / 1e6:.2f}M tokens, {c['held_out_tokens']:,} held out)"
            for c in report["corpora"].values()
        )
        + ".",
        "",
        *_protocol_warning(report, seeds),
        "Ratio = held-out loss / that of `ref-stage` (one process, the spec's optimizer through "
        "`StageOptimizer`) with the same corpus, seed and model; mean and min..max over seeds. The target "
        "applies to the mean of 3 seeds. Tokens/s: the median over windows after warm-up (what the swarm "
        "sustains), and overall = tokens / training seconds (stalls included, e.g. after a kill).",
        "",
        "| configuration | corpus | seeds | held-out loss | ratio | min..max | target | | tokens/s (median, overall) "
        "| s per run "
        "| peers killed | exported stage steps | applied staleness by stage |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in a["rows"]:
        spread = (
            f"{cell(r['ratio_min'], '.4f')}..{cell(r['ratio_max'], '.4f')}" if r["ratio_seeds"] > 1 else "-"
        )
        verdict = {True: "met", False: "**missed**", None: ""}[r["met"]]
        if r["met"] is not None and r["ratio_seeds"] < 3:
            verdict += f" ({r['ratio_seeds']} seed{'s' if r['ratio_seeds'] > 1 else ''})"
        lines.append(
            f"| {r['config']} | {r['corpus']} | {len(r['seeds'])} | {cell(r['eval_loss_mean'], '.4f')} | "
            f"{cell(r['ratio_mean'], '.4f')} | {spread} | {cell(r['target'], '.2f')} | {verdict} | "
            f"{cell(r['tokens_per_s_mean'])}, {cell(r.get('tokens_per_s_overall_mean'))} | "
            f"{cell(r['wall_s_mean'])} | "
            f"{r['peers_killed'] if r['config'].endswith('churn') else '-'} | "
            f"{', '.join('/'.join(map(str, c)) for c in r['step_counts']) or '-'} | "
            f"{' / '.join(f'{v:.2f}' for v in r.get('applied_staleness', {}).values()) or '-'} |"
        )
    for f in a["failed"]:
        lines.append(
            f"| {f['key']} (failed: {' '.join(f['error'].split())[:100].replace('|', '/')})" + " |" * 13
        )
    tput = [r for r in a["rows"] if r["config"] == "p2-async-blockwise8"]
    if tput:
        lines += [
            "",
            "Throughput of the 2 stages x 2 peers async layout (blockwise8, median over "
            f"{cfg['throughput_window_mb']}-micro-batch windows after {cfg['throughput_warmup_mb']}): "
            + ", ".join(f"{cell(r['tokens_per_s_mean'])} tokens/s ({r['corpus']})" for r in tput)
            + ".",
        ]
    lines += ["", *[f"![loss vs tokens](benchmarks/results/{Path(p).name})" for p in report.get("plots", [])]]
    if report.get("reading"):
        lines += ["", "### Reading", "", report["reading"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- CLI


def quick_config(**kw: Any) -> ConvergenceConfig:
    """``--quick``: 96 micro-batches, 16k held-out tokens, seed 0, corpus stdlib."""
    base: dict[str, Any] = {
        "micro_batches": 96,
        "eval_tokens": 16384,
        "seeds": (0,),
        "corpora": ("stdlib",),
        "throughput_warmup_mb": 16,
        "throughput_window_mb": 8,
    }
    base.update(kw)
    return ConvergenceConfig(**base)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.convergence",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", default=None, help="base run spec (default examples/demo.yaml)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replace a spec key for every run, e.g. optimizer.lr=2e-3 (repeatable; added to the defaults optimizer.accumulate=2, optimizer.warmup_steps=20)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"short runs of {', '.join(QUICK_CONFIGS)} and their reference"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=(),
        metavar="ID",
        help="configurations to run (ids or patterns as --plan lists them, e.g. 'p2-*')",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None)
    parser.add_argument(
        "--codecs",
        nargs="+",
        default=None,
        help="activation and gradient codecs of the swarm configurations (default: none blockwise8)",
    )
    parser.add_argument(
        "--corpora", nargs="+", default=None, help=f"corpus names (built in: {', '.join(CORPORA)})"
    )
    parser.add_argument(
        "--corpus", action="append", default=[], metavar="NAME=PATH", help="add or replace a corpus"
    )
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--eval-tokens", type=int, default=None)
    parser.add_argument("--churn-every-s", type=float, default=None)
    parser.add_argument("--max-inflight", type=int, default=None)
    parser.add_argument("--name", default=None, help="results name (default convergence, convergence_quick)")
    parser.add_argument("--plan", action="store_true", help="print the runs and exit")
    parser.add_argument("--skip-done", action="store_true", help="skip runs the results file already holds")
    parser.add_argument("--fresh", action="store_true", help="start a new results file instead of merging")
    parser.add_argument("--no-markdown", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--render",
        nargs="?",
        const="convergence",
        default=None,
        metavar="NAME",
        help="rewrite the Convergence section from results/NAME.json (default convergence) and run nothing",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker, args.out)
    if args.render:
        report = json.loads((RESULTS_DIR / f"{args.render}.json").read_text())
        report["analysis"] = analyse(report["results"])  # re-derived: a changed rule applies to old runs
        reading = RESULTS_DIR / f"{args.render}_reading.md"
        if reading.exists():
            report["reading"] = reading.read_text().strip()
        write_section(markdown_section(report))
        print(f"rewrote the {SECTION!r} section of {MARKDOWN} from results/{args.render}.json")
        return 0
    kw: dict[str, Any] = {}
    if args.spec:
        kw["spec_path"] = args.spec
    if args.set:
        kw["overrides"] = {**DEFAULT_OVERRIDES, **dict(parse_override(s) for s in args.set)}
    if args.corpus:
        pairs = [c.partition("=") for c in args.corpus]
        if any(not sep or not n for n, sep, _ in pairs):
            raise SystemExit("--corpus takes NAME=PATH, e.g. --corpus licenses=/usr/share/common-licenses")
        kw["corpus_paths"] = {n: p for n, _, p in pairs}
    for name in ("seeds", "corpora", "codecs"):
        if getattr(args, name) is not None:
            kw[name] = tuple(getattr(args, name))
    for name in ("micro_batches", "eval_tokens", "churn_every_s", "max_inflight"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    try:
        cfg = quick_config(**kw) if args.quick else ConvergenceConfig(**kw)
        jobs = plan(cfg, args.configs or (QUICK_CONFIGS if args.quick else ()))
        for job in {j.config: j for j in jobs}.values():
            job_spec(cfg, job)  # every spec is valid before anything runs
        for corpus in cfg.corpora:
            resolve_corpus(cfg, corpus)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plan:
        for j in jobs:
            print(f"{j.key:45s} {j.describe(cfg.churn_every_s)}")
        print(f"{len(jobs)} runs of {cfg.micro_batches} micro-batches")
        return 0
    name = args.name or ("convergence_quick" if args.quick else "convergence")
    command = "python -m benchmarks.convergence " + " ".join(argv if argv is not None else sys.argv[1:])
    previous = terminate_as_interrupt()  # SIGTERM: the same cleanup as Ctrl-C
    try:
        # a --quick run stands alone (its short protocol would refuse the next --quick with other options)
        fresh = args.fresh or (args.quick and not args.skip_done)
        report = run_matrix(
            cfg, jobs, name=name, command=command.strip(), fresh=fresh, skip_done=args.skip_done
        )
    except KeyboardInterrupt:
        print(
            f"interrupted; the finished runs are in {RESULTS_DIR / name}.json (--skip-done goes on from there)",
            file=sys.stderr,
        )
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    a = report["analysis"]
    print(f"{a['met']} configurations met their target, {a['missed']} missed, {len(a['failed'])} runs failed")
    if args.no_markdown or args.quick:
        print(
            f"results in {RESULTS_DIR / name}.json; `python -m benchmarks.convergence --render {name}` writes them to BENCHMARKS.md"
        )
    else:
        reading = RESULTS_DIR / f"{name}_reading.md"
        if reading.exists():
            report["reading"] = reading.read_text().strip()
        write_section(markdown_section(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
