"""The ``codecs``, ``optimizer`` and ``averaging`` sections of a run spec: how the stages train.

Part of ``swarm.run.spec`` (which re-exports everything here); the field rules are declared with the
fields (``swarm/run/fields.py``), only the rules between fields are written out below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from swarm.run.fields import (
    OMIT_NONE,
    check_fields,
    check_float,
    flag,
    integer,
    number,
    one_of,
    reject,
    set_field,
)

__all__ = [
    "CodecsConfig",
    "OptimizerConfig",
    "AveragingConfig",
    "OPTIMIZERS",
    "MUON_MOMENTUM",
    "MUON_LR_RATIO",
    "SCHEDULES",
    "MODES",
    "MAX_VERSIONS_CAP",
]

MAX_VERSIONS_CAP = 64
OPTIMIZERS = ("adamw", "nesterov", "muon")
MUON_MOMENTUM = 0.8
"""Muon's momentum when ``optimizer.muon_momentum`` is left out. The Muon paper and code use 0.95; at
the demo's size 0.8 trained better, in one process and asynchronously (BENCHMARKS.md, "Async replay")."""
MUON_LR_RATIO = 3.0
"""Muon's peak lr when ``optimizer.muon_lr`` is left out: this many times ``lr`` (3e-3 -> 9e-3; at the
demo's size 0.005-0.01 trained best with lr 3e-3)."""
SCHEDULES = ("constant", "cosine")
MODES = ("async", "sync")


@dataclass(frozen=True, kw_only=True)
class CodecsConfig:
    """Codec specs (``compression.get_codec`` grammar) for tensors sent between stages."""

    _SECTION: ClassVar[str] = "codecs"

    activations: str
    """Codec of forward activations, e.g. ``blockwise8`` (~4x smaller than fp32)."""
    gradients: str
    """Codec of backward gradients w.r.t. activations, e.g. ``blockwise8``."""

    def __post_init__(self) -> None:
        for name in ("activations", "gradients"):
            _check_codec(f"{self._SECTION}.{name}", getattr(self, name))


def _check_codec(path: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise reject(
            path,
            value,
            "it must be a non-empty codec spec string (at most 200 chars)",
            "Use a codec such as blockwise8; `swarm codecs` lists them.",
        )
    # The `compression` package is written concurrently with this module; until it exposes
    # `get_codec`, the name is only checked for being a non-empty string. Imported lazily so that
    # loading a spec never pays for torch-heavy codec modules unless they exist.
    try:
        from compression import get_codec  # type: ignore[attr-defined]
    except ImportError:
        return
    try:
        get_codec(value)
    except ValueError as e:  # compression.CodecError is a ValueError
        raise reject(path, value, f"the codec was rejected ({e})", "Pick a codec from `swarm codecs`.") from e


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """How each stage peer updates its weights. Every field has a default suitable for small runs."""

    _SECTION: ClassVar[str] = "optimizer"

    name: str = one_of(OPTIMIZERS, "muon")
    """``muon`` (the default: Muon on the 2-D weight matrices of the transformer blocks, AdamW on
    embeddings, head and norms, with the look-ahead on; see swarm/run/optimizer.py), ``adamw``, or
    ``nesterov`` (SGD with delay-aware Nesterov momentum). Muon is the default because it trains better
    per token than AdamW in one process and loses far less to the staleness of asynchronous pipelines
    (BENCHMARKS.md, "Convergence")."""
    lr: float = number(3e-3, gt=0.0, le=10.0, hint="Use a learning rate such as 3e-3 (adamw).")
    """Peak learning rate (reached after warmup); with ``muon``, that of the AdamW part."""
    muon_lr: float | None = number(
        None,
        gt=0.0,
        le=10.0,
        hint="Use a learning rate such as 0.01, or leave it out to use optimizer.lr.",
        optional=True,
        metadata=OMIT_NONE,
    )
    """Peak learning rate of Muon's matrices (``muon`` only; follows the same warmup and schedule as
    ``lr``); None = MUON_LR_RATIO (3) x ``lr``. Muon's update is scaled to the RMS of an AdamW update
    (0.2 per element), so the two lrs are comparable; at the demo's size 0.005-0.01 (with lr 3e-3)
    trained best in one process. Lower it if the loss spikes."""
    muon_momentum: float | None = number(
        None,
        ge=0.0,
        lt=1.0,
        hint=f"Use a value in [0, 1) such as {MUON_MOMENTUM}, or leave it out.",
        optional=True,
        metadata=OMIT_NONE,
    )
    """Muon's momentum (Nesterov form; ``muon`` only); None = MUON_MOMENTUM (0.8; the Muon paper's 0.95
    trained worse at the demo's size, in one process and async)."""
    lookahead: float | None = number(
        None,
        ge=0.0,
        le=4.0,
        hint="Use 1.0 (extrapolate by the measured staleness), 0 (off), or leave it out.",
        optional=True,
        metadata=OMIT_NONE,
    )
    """Delay compensation of ``adamw`` and ``muon`` (swarm/run/optimizer.py, note "extrapolated weights"):
    forwards run on ``params + lookahead * staleness * (the last step's change)``, so a gradient that
    lands ``staleness`` steps late was computed near the weights it is applied to. 0 = off (textbook
    AdamW/Muon); None = 1.0 with muon, 0 with adamw. No effect in sync mode (staleness 0)."""
    schedule: str = one_of(SCHEDULES, "constant")
    """``constant`` (after warmup) or ``cosine`` (decays to min_lr_ratio * lr at total_steps)."""
    warmup_steps: int = integer(0, lo=0, hint="Use 0 for no warmup, or a step count.")
    """Optimizer steps of linear warmup from ~0 to lr; use a few hundred if early loss spikes."""
    total_steps: int | None = integer(
        None, lo=1, hint="Give the schedule length in optimizer steps, or leave it out.", optional=True
    )
    """Length of the cosine schedule in optimizer steps; required for cosine, None = no end."""
    min_lr_ratio: float = number(0.1, ge=0.0, le=1.0, hint="Use a fraction of lr between 0 and 1, e.g. 0.1.")
    """Cosine floor as a fraction of lr."""
    weight_decay: float = number(0.0, ge=0.0, lt=1.0, hint="Use 0.0 (off) or a small value such as 0.1.")
    """Decoupled weight decay (adamw and both parts of muon, each times its own lr) or L2 decay
    (nesterov); 0 disables it."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (beta1, beta2); with ``muon``, those of the AdamW part."""
    momentum: float = number(0.9, ge=0.0, lt=1.0, hint="Use a value in [0, 1), e.g. 0.9.")
    """Momentum of ``nesterov``; ignored by adamw and muon (muon has ``muon_momentum``). Values near 0.99
    overshoot on tiny runs."""
    accumulate: int = integer(
        1,
        lo=1,
        hi=1 << 20,
        hint="Use 1 to step after every micro-batch, or the number of micro-batches per step.",
    )
    """Micro-batches whose gradients are summed into one optimizer step of a stage peer."""
    clip_norm: float | None = number(
        1.0, gt=0.0, hint="Use a positive norm such as 1.0, or null to disable clipping.", optional=True
    )
    """Clip the stage's gradient norm to this before each step; None disables clipping."""
    mode: str = one_of(MODES, "async")
    """``async``: apply updates as gradients arrive (weight stashing keeps backward exact);
    ``sync``: wait for all in-flight micro-batches of a step before updating."""
    max_versions: int = integer(
        3,
        lo=1,
        hi=MAX_VERSIONS_CAP,
        hint=f"Keep between 1 and {MAX_VERSIONS_CAP} weight versions; 3 suits most runs.",
    )
    """Weight versions a peer keeps for in-flight micro-batches; a micro-batch whose version was
    dropped is refused and retried. Raise it if you see many stale-version retries."""
    recompute: bool = flag(True)
    """Recompute the forward pass during backward instead of stashing activations (less memory)."""

    def __post_init__(self) -> None:
        s = self._SECTION
        check_fields(self, s)
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise reject(
                f"{s}.total_steps",
                self.total_steps,
                f"a cosine schedule needs total_steps > warmup_steps ({self.warmup_steps})",
                "Set optimizer.total_steps to the planned run length, or use schedule: constant.",
            )
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise reject(
                f"{s}.betas", betas, "it must be a pair [beta1, beta2]", "Use e.g. betas: [0.9, 0.95]."
            )
        set_field(
            self,
            "betas",
            tuple(
                check_float(f"{s}.betas[{i}]", b, ge=0.0, lt=1.0, hint="Use e.g. betas: [0.9, 0.95].")
                for i, b in enumerate(betas)
            ),
        )

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based): linear warmup, then constant or cosine."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        assert self.total_steps is not None  # enforced in __post_init__ for cosine
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def muon_lr_at(self, step: int) -> float:
        """Muon's learning rate for step ``step``: ``lr_at(step)`` scaled by ``muon_lr / lr``."""
        scale = MUON_LR_RATIO if self.muon_lr is None else self.muon_lr / self.lr
        return self.lr_at(step) * scale

    @property
    def lookahead_scale(self) -> float:
        """``lookahead`` in effect: as given, else 1.0 for muon and 0 otherwise (nesterov has its own)."""
        if self.name == "nesterov":
            return 0.0
        if self.lookahead is not None:
            return self.lookahead
        return 1.0 if self.name == "muon" else 0.0

    @property
    def muon_beta(self) -> float:
        """Muon's momentum in effect (``muon_momentum``, or MUON_MOMENTUM when left out)."""
        return MUON_MOMENTUM if self.muon_momentum is None else self.muon_momentum


@dataclass(frozen=True, kw_only=True)
class AveragingConfig:
    """Gradient rounds among the replicas of a stage (peer/replicas.py): with several online replicas
    a stage steps once per ``optimizer.accumulate`` micro-batches *of the whole stage*, on the mean
    gradient over all of them, so every replica holds the same weights and version."""

    _SECTION: ClassVar[str] = "averaging"

    timeout_s: float = number(5.0, gt=0.0, le=3600.0, hint="Use a few seconds, e.g. 5 (more on slow links).")
    """Seconds a gradient round waits for every online replica of the stage; after that the gradients
    are kept for the next round (a replica steps alone after a few failures, the others catch up by
    download). Raise it on slow links if peers report many failed rounds."""

    def __post_init__(self) -> None:
        check_fields(self, self._SECTION)
