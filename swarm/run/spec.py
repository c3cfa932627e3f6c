"""The run spec: everything a peer needs to join a run, as typed, frozen, validated dataclasses.

A run is defined once by whoever starts it, in a YAML file (see ``examples/tiny.yaml`` for a fully
commented one), and then travels through the DHT as canonical JSON. Every peer rebuilds the same
``RunSpec`` from it and checks ``spec_hash``, so two peers agree on a run exactly when their hashes do.

Layout of a spec (YAML or dict)::

    run_id: tiny                     # 1-64 chars of [A-Za-z0-9_-]
    seed: 0                          # every weight is derived from it (see swarm/run/model.py)
    model: {vocab_size, d_model, n_layers, n_heads, seq_len, ffn_hidden?, rope_theta?, norm_eps?,
            subspace?: {rank: k} or {ratio: r},   # see swarm/run/subspace.py
            n_kv_heads?, rope_scaling?: {type, factor, ...}, tie_embeddings?}
    stages: 2                        # or explicit half-open layer ranges: [[0, 3], [3, 8]]
    codecs: {activations: blockwise8, gradients: blockwise8}
    optimizer: {name?, lr?, schedule?, warmup_steps?, total_steps?, min_lr_ratio?, weight_decay?,
                betas?, momentum?, accumulate?, clip_norm?, mode?, max_versions?, recompute?}
    averaging: {timeout_s?}
    micro_batch_size: 8
    autocast: auto                   # auto | none | bf16 | fp16
    stash_ttl_s: 120
    access?: {private, secret_check?, allow?, deny?}          # see swarm/dht/auth.py
    pretrained?: {source, stage_digests, tokenizer?}          # see swarm/run/pretrained.py

Keys marked ``?`` (and whole ``optimizer`` / ``averaging`` sections, ``seed``, ``autocast``,
``stash_ttl_s``) are optional. Unknown keys are rejected with the list of valid ones, so a typo never
silently falls back to a default. Each config validates itself once in ``__post_init__`` and raises
:class:`swarm.errors.ConfigError` naming the field path (``optimizer.lr``), the value, the rule and
the next step; a field's rule is declared with the field (``swarm/run/fields.py``).

The sections live in ``spec_model.py`` (model), ``spec_training.py`` (codecs, optimizer, averaging),
``spec_access.py`` (access, pretrained) and the file reader in ``spec_file.py``; this module holds
``RunSpec`` and re-exports them all, so ``from swarm.run.spec import ...`` is the one import to use.

Importing this module does not import torch; only the codec check (``compression.get_codec``) may.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import ConfigError
from swarm.run.fields import (
    OMIT_NONE,
    check_fields,
    check_int,
    integer,
    number,
    one_of,
    reject,
    set_field,
    take_keys,
    to_plain,
)
from swarm.run.fields import to_plain as _to_plain  # noqa: F401 (swarm.run.pretrained imports it from here)
from swarm.run.limits import MAX_SPEC_BYTES, RUN_ID_RE
from swarm.run.spec_access import MAX_ACCESS_LIST, AccessConfig, PretrainedConfig
from swarm.run.spec_file import MAX_YAML_FILE_BYTES, read_spec_yaml
from swarm.run.spec_model import (
    MAX_D_MODEL,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_VOCAB_SIZE,
    ROPE_SCALINGS,
    ModelConfig,
    RopeScalingConfig,
    SubspaceConfig,
)
from swarm.run.spec_training import (
    MAX_VERSIONS_CAP,
    MODES,
    MUON_LR_RATIO,
    MUON_MOMENTUM,
    OPTIMIZERS,
    SCHEDULES,
    AveragingConfig,
    CodecsConfig,
    OptimizerConfig,
)

__all__ = [
    "RunSpec",
    "ModelConfig",
    "SubspaceConfig",
    "CodecsConfig",
    "OptimizerConfig",
    "AveragingConfig",
    "AccessConfig",
    "RopeScalingConfig",
    "PretrainedConfig",
    "split_layers",
    "read_spec_yaml",
    "MAX_SPEC_BYTES",
    "MAX_YAML_FILE_BYTES",
    "MAX_MICRO_BATCH",
    "AUTOCAST_CHOICES",
    # re-exported from the section modules
    "MAX_ACCESS_LIST",
    "MAX_D_MODEL",
    "MAX_HEADS",
    "MAX_LAYERS",
    "MAX_SEQ_LEN",
    "MAX_VOCAB_SIZE",
    "MAX_VERSIONS_CAP",
    "MODES",
    "MUON_LR_RATIO",
    "MUON_MOMENTUM",
    "OPTIMIZERS",
    "ROPE_SCALINGS",
    "SCHEDULES",
]

MAX_MICRO_BATCH = 1 << 16  # sequences per micro-batch
AUTOCAST_CHOICES = ("auto", "none", "bf16", "fp16")


def _stages_hint(n_layers: int) -> str:
    half = max(1, n_layers // 2)
    example = f"[[0, {half}], [{half}, {n_layers}]]" if n_layers > 1 else "[[0, 1]]"
    return (
        f"Give `stages` either a number of stages between 1 and model.n_layers ({n_layers}), or explicit "
        f"half-open layer ranges that cover 0..{n_layers} in order, e.g. {example}."
    )


def split_layers(n_layers: int, n_stages: int) -> tuple[tuple[int, int], ...]:
    """Split ``n_layers`` into ``n_stages`` contiguous half-open ranges as evenly as possible.

    Earlier stages get the extra layers (8 layers in 3 stages: 3, 3, 2): the last stage also holds
    the LM head, which is the heaviest single matmul for large vocabularies.
    """
    check_int("stages", n_stages, lo=1, hi=max(1, n_layers), hint=_stages_hint(n_layers))
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return tuple(ranges)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One training run. Build it with :meth:`from_yaml` / :meth:`from_dict` or directly by keyword.

    ``stages`` may be given as a stage count (split as evenly as possible) or as explicit ranges;
    after construction it is always a tuple of half-open ``(first, end)`` layer ranges.
    """

    run_id: str
    """Name of the run in the DHT: 1-64 chars of [A-Za-z0-9_-] (averager prefixes forbid '.')."""
    model: ModelConfig
    stages: tuple[tuple[int, int], ...]
    """Half-open layer ranges, one per stage, covering 0..model.n_layers in order."""
    codecs: CodecsConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    micro_batch_size: int = integer(
        lo=1,
        hi=MAX_MICRO_BATCH,
        hint="Use the number of sequences per micro-batch that fits a peer's memory, e.g. 8.",
    )
    """Sequences per micro-batch (one request through the pipeline)."""
    seed: int = integer(0, lo=0, hi=(1 << 63) - 1, hint="Use a non-negative integer such as 0 or 1234.")
    """Root of every derived seed: the same seed gives the same initial weights on every machine."""
    autocast: str = one_of(AUTOCAST_CHOICES, "auto")
    """``auto`` (bf16 on CUDA when supported, else full precision), ``none``, ``bf16`` or ``fp16``."""
    stash_ttl_s: float = number(120.0, gt=0.0, le=86400.0, hint="Use a timeout in seconds such as 120.")
    """Seconds a stashed forward waits for its backward before it is dropped (its micro-batch fails)."""
    access: AccessConfig | None = field(default=None, metadata=OMIT_NONE)
    """Private run / allow / deny lists (swarm/dht/auth.py); None = open to everyone (hash unchanged)."""
    pretrained: PretrainedConfig | None = field(default=None, metadata=OMIT_NONE)
    """The checkpoint the run continues (swarm/run/pretrained.py); None = initial weights from ``seed``."""

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str):
            raise reject(
                "run_id",
                self.run_id,
                f"it must be a string, not {type(self.run_id).__name__}",
                'Quote it in YAML, e.g. run_id: "2024".',
            )
        if not RUN_ID_RE.fullmatch(self.run_id):
            raise reject(
                "run_id",
                self.run_id,
                "it must be 1-64 characters of letters, digits, '_' or '-' (no '.', no spaces)",
                "Rename the run, e.g. run_id: my-run_1.",
            )
        for name, cls in (
            ("model", ModelConfig),
            ("codecs", CodecsConfig),
            ("optimizer", OptimizerConfig),
            ("averaging", AveragingConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise reject(
                    name,
                    getattr(self, name),
                    f"it must be a {cls.__name__}",
                    f"Build it with {cls.__name__}(...) or load the spec with RunSpec.from_dict.",
                )
        set_field(self, "stages", _normalise_stages(self.stages, self.model.n_layers))
        if self.model.subspace is not None and len(self.stages) < 2:
            raise reject(
                "model.subspace",
                to_plain(self.model.subspace),
                "a subspace-constrained model needs at least 2 stages: it compresses what crosses stage "
                "boundaries, and a single-stage run has none",
                "Split the model into stages (e.g. stages: 2), or leave model.subspace out.",
            )
        check_fields(self, only=("micro_batch_size", "seed", "autocast", "stash_ttl_s"))
        if self.access is not None and not isinstance(self.access, AccessConfig):
            raise reject(
                "access", self.access, "it must be an AccessConfig", "Load the spec with RunSpec.from_dict."
            )
        self._check_pretrained()

    def _check_pretrained(self) -> None:
        """One initial-weights digest per stage; a checkpoint's layers cannot be subspace-constrained."""
        pre = self.pretrained
        if pre is None:
            return
        if not isinstance(pre, PretrainedConfig):
            raise reject(
                "pretrained", pre, "it must be a PretrainedConfig", "Load the spec with RunSpec.from_dict."
            )
        if len(pre.stage_digests) != self.num_stages:
            raise reject(
                "pretrained.stage_digests",
                f"{len(pre.stage_digests)} digests",
                f"there must be one per stage ({self.num_stages})",
                "Digests belong to one stage split: run `swarm init --from-pretrained DIR --stages N` again "
                "to change the split.",
            )
        if self.model.subspace is not None:
            raise reject(
                "model.subspace",
                to_plain(self.model.subspace),
                "a run that continues a checkpoint cannot constrain its layers to a subspace (the "
                "checkpoint's weights are not in one)",
                "Leave model.subspace out of a --from-pretrained run.",
            )

    # ---- derived quantities -------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_layers(self, stage: int) -> tuple[int, int]:
        """Half-open range ``(first, end)`` of the layers that ``stage`` holds."""
        check_int(
            "stage",
            stage,
            lo=0,
            hi=self.num_stages - 1,
            hint=f"Run {self.run_id!r} has {self.num_stages} stages, numbered 0..{self.num_stages - 1}.",
        )
        return self.stages[stage]

    @property
    def constrained_layers(self) -> tuple[int, int]:
        """Half-open range of the layers that write only into the subspace: every layer before the last
        stage boundary (the last stage's layers, final norm and head stay free). ``(0, 0)`` when the
        model has no ``subspace``."""
        if self.model.subspace is None:
            return (0, 0)
        return (0, self.stages[-1][0])

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens in one full micro-batch (micro_batch_size * seq_len)."""
        return self.micro_batch_size * self.model.seq_len

    def n_params(self, stage: int | None = None) -> int:
        """Parameters of one stage, or of the whole model when ``stage`` is None (no tied weights)."""
        m = self.model
        if stage is None:
            first, end, is_first, is_last = 0, m.n_layers, True, True
        else:
            first, end = self.stage_layers(stage)
            is_first, is_last = stage == 0, stage == self.num_stages - 1
        c_first, c_end = self.constrained_layers
        n_constrained = max(0, min(end, c_end) - max(first, c_first))
        total = (end - first - n_constrained) * m.layer_params()
        total += n_constrained * m.layer_params(constrained=True)
        if is_first:
            k = m.subspace_rank
            # token embedding (only its k-dim part is trained when the model is constrained)
            total += m.vocab_size * (m.d_model if k is None else k)
        if is_last:
            total += m.d_model + m.d_model * m.vocab_size  # final RMSNorm + LM head
        return total

    # ---- serialisation ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict of every field (defaults included, stages as explicit ranges)."""
        return to_plain(self)

    def canonical_bytes(self) -> bytes:
        """Compact sorted-key JSON of :meth:`to_dict`: the bytes that are hashed and published."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @functools.cached_property
    def spec_hash(self) -> str:
        """First 16 hex chars of sha256 of the canonical bytes: equal hashes = the same run."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        """Build and validate a spec from a plain dict (parsed YAML or JSON); unknown keys are rejected."""
        if not isinstance(data, Mapping):
            raise reject(
                "spec", data, "a run spec must be a mapping of keys to values", "Check the spec file."
            )
        try:
            size = len(json.dumps(data, default=repr))
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError(f"the run spec could not be measured ({e}); it must be plain data") from e
        if size > MAX_SPEC_BYTES:
            raise ConfigError(
                f"the run spec is {size} bytes as JSON, above the {MAX_SPEC_BYTES}-byte cap (a DHT value "
                "near 45 KB crashes hivemind). Real specs take 1-2 KB: look for a runaway list, e.g. "
                "`stages`, and give a stage count instead of explicit ranges."
            )
        top = take_keys("", data, cls)
        sections = {
            "model": ModelConfig,
            "codecs": CodecsConfig,
            "optimizer": OptimizerConfig,
            "averaging": AveragingConfig,
            "access": AccessConfig,
            "pretrained": PretrainedConfig,
        }
        for name, section_cls in sections.items():
            if name in ("access", "pretrained") and top.get(name, {}) is None:
                continue  # `access:` with nothing under it: an open run
            if name in top:
                # `optimizer:` with every key commented out parses as None: treat it as "all defaults".
                value = {} if top[name] is None and name in ("optimizer", "averaging") else top[name]
                top[name] = section_cls(**take_keys(name, value, section_cls))
        return cls(**top)

    @classmethod
    def from_json(cls, data: bytes | str) -> RunSpec:
        """Parse canonical (or any) JSON bytes, e.g. fetched from the DHT; the size is checked first."""
        if len(data) > MAX_SPEC_BYTES:
            raise ConfigError(
                f"the run spec is {len(data)} bytes, above the {MAX_SPEC_BYTES}-byte cap; refusing to "
                "parse it. Whoever published it must shrink it (give `stages` as a count)."
            )
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"the run spec is not valid JSON ({e}); re-publish it with `swarm init`") from e
        return cls.from_dict(parsed)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> RunSpec:
        """Load a run spec file (see examples/tiny.yaml). ``3e-3`` parses as a number, as in YAML 1.2."""
        return cls.from_dict(read_spec_yaml(path))


# ---------------------------------------------------------------------------------------------
# Internals of (de)serialisation
# ---------------------------------------------------------------------------------------------


def _normalise_stages(stages: Any, n_layers: int) -> tuple[tuple[int, int], ...]:
    hint = _stages_hint(n_layers)
    if isinstance(stages, int) and not isinstance(stages, bool):
        return split_layers(n_layers, stages)
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise reject("stages", stages, "it must be a stage count or a non-empty list of ranges", hint)
    ranges = []
    expected_start = 0
    for i, r in enumerate(stages):
        if isinstance(r, (str, bytes)) or not isinstance(r, Sequence) or len(r) != 2:
            raise reject(f"stages[{i}]", r, "each stage must be a [first, end) pair of layer indices", hint)
        first = check_int(f"stages[{i}][0]", r[0], lo=0, hint=hint)
        end = check_int(f"stages[{i}][1]", r[1], lo=0, hint=hint)
        if first != expected_start:
            raise reject(
                f"stages[{i}]",
                list(r),
                f"it must start at layer {expected_start}, where the previous stage ended "
                "(ranges are half-open, contiguous and in order)",
                hint,
            )
        if end <= first:
            raise reject(
                f"stages[{i}]", list(r), "each stage must hold at least one layer (end > first)", hint
            )
        ranges.append((first, end))
        expected_start = end
    if expected_start != n_layers:
        raise reject(
            "stages",
            [list(r) for r in ranges],
            f"the ranges end at layer {expected_start} but model.n_layers is {n_layers}",
            hint,
        )
    return tuple(ranges)
