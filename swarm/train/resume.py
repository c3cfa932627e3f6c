"""Where a trainer's session starts: a fresh ``OUT`` directory, or the one a killed trainer left (note "resume").

Resuming (note "resume")
------------------------
``resume=True`` (``swarm train --resume OUT``) continues the run whose trainer wrote ``OUT`` and was
killed or stopped: :func:`read_resume_state` reads ``OUT/metrics.jsonl`` (its first ``start`` event and
its last step record) and the trainer continues from that step, token count and data position (the
number of micro-batches drawn from the seeded data stream, skipped again on resume), with the same
trainer id and data seed, appending to the metrics file. The steps (or tokens) to reach are the same
totals as before unless given again. Anything that does not fit (no such directory, no start record, a
different run, spec, data source or seed, nothing left to do) raises ``ConfigError`` before anything is
written. Micro-batches the old trainer had in flight are lost with it (their peers drop them: note
"trainers that vanish" in peer/trainers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.errors import ConfigError
from swarm.train.metrics import read_metrics

if TYPE_CHECKING:
    from swarm.run.spec import RunSpec
    from swarm.train.config import TrainerConfig

__all__ = ["ResumeState", "read_resume_state", "check_resume", "target_steps", "prepare_out_dir"]


@dataclass(frozen=True)
class ResumeState:
    """Where a trainer's earlier session stopped (note "resume"), read from its ``metrics.jsonl``."""

    out_dir: str
    run_id: str
    spec_hash: str
    trainer_id: str
    seed: int
    data_source: str | None
    target_steps: int
    step: int = 0
    tokens: int = 0
    data_position: int = 0
    time_s: float = 0.0


def read_resume_state(out_dir: str, *, run_id: str) -> ResumeState:
    """Read where the trainer that wrote ``out_dir`` stopped; ``ConfigError`` (naming the value, the rule
    and the next step) when there is nothing of run ``run_id`` to resume there. Reads only."""
    out = Path(out_dir)
    fresh = "or drop --resume to start a new run there"
    if not out.is_dir():
        raise ConfigError(
            f"--resume {out_dir}: no such directory; give the --out directory of the trainer to continue, {fresh}"
        )
    path = out / "metrics.jsonl"
    records = read_metrics(path) if path.is_file() else []
    starts = [r for r in records if r.get("type") == "event" and r.get("event") == "start"]
    start = starts[-1] if starts else None  # the latest session's (a resumed one repeats the rest)
    if start is None:
        raise ConfigError(
            f"--resume {out_dir}: {path} holds no trainer start record, so no trainer ran there; "
            f"give the --out directory of the trainer to continue, {fresh}"
        )
    if start.get("run_id") != run_id:
        raise ConfigError(
            f"--resume {out_dir} was written by a trainer of run {start.get('run_id')!r}, not of run "
            f"{run_id!r} (--run); resume with --run {start.get('run_id')}, or use another --out for run {run_id!r}"
        )
    steps = [r for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)]
    last = steps[-1] if steps else {}
    target = start.get("target_steps")
    return ResumeState(
        out_dir=str(out),
        run_id=run_id,
        spec_hash=str(start.get("spec_hash")),
        trainer_id=str(start.get("trainer")),
        seed=int(start.get("seed", 0)),
        data_source=start.get("data_source"),
        target_steps=int(target) if isinstance(target, int) else 0,
        step=int(last.get("step", 0)),
        tokens=int(last.get("tokens", 0)),
        # older files have no data position: at least every completed or dropped one was drawn
        data_position=int(
            last.get("data_position", int(last.get("completed", 0)) + int(last.get("dropped", 0)))
        ),
        time_s=float(last.get("time", 0.0) or 0.0),
    )


def target_steps(config: TrainerConfig, spec: RunSpec, resumed: ResumeState | None) -> int:
    """The trainer step to reach: from ``tokens``, ``steps``, the resumed session's target, else 100."""
    if config.tokens is not None:
        return math.ceil(math.ceil(config.tokens / spec.tokens_per_micro_batch) / spec.optimizer.accumulate)
    if config.steps is not None:
        return config.steps
    if resumed is not None and resumed.target_steps > 0:
        return resumed.target_steps
    return 100


def check_resume(config: TrainerConfig, state: ResumeState, spec: RunSpec) -> None:
    """Refuse a resume that would not continue the same run (note "resume"); writes nothing."""
    where = f"--resume {config.out_dir}"
    if state.spec_hash != spec.spec_hash:
        raise ConfigError(
            f"{where} trained run {config.run_id!r} with spec {state.spec_hash}, but the run's spec is now "
            f"{spec.spec_hash} (the run was set up again with another spec); a resume needs the same spec, "
            "so train into a new --out instead"
        )
    if state.data_source != config.data.source:
        raise ConfigError(
            f"{where} read data from {state.data_source or 'the standard library'}, not "
            f"{config.data.source or 'the standard library'} (--data); resume with the same --data, or use a new --out"
        )
    target = target_steps(config, spec, state)
    if state.step >= target:
        raise ConfigError(
            f"{where} already reached step {state.step} of {target}: nothing is left to do; "
            f"pass a larger --steps (or --tokens) to train further"
        )


def prepare_out_dir(config: TrainerConfig, state: ResumeState | None, spec: RunSpec) -> None:
    """Make ``out_dir`` ready for this session's records: checked and appended to when resuming, else
    created and emptied (this run's records only). Nothing is written when the resume is refused."""
    if config.resume:
        assert state is not None and config.out_dir is not None
        check_resume(config, state, spec)
        metrics = Path(config.out_dir, "metrics.jsonl")
        if metrics.read_bytes()[-1:] not in (b"", b"\n"):
            with open(metrics, "a", encoding="utf-8") as f:
                f.write("\n")  # the killed trainer's last line was cut: keep ours apart
    elif config.out_dir:
        Path(config.out_dir).mkdir(parents=True, exist_ok=True)
        Path(config.out_dir, "metrics.jsonl").write_text("")
