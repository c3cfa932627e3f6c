"""``swarm export``: download every stage's current weights from the swarm and write one model.

Run it::

    swarm export --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEERID --run tiny --out exports/tiny
    swarm export ... --format hf      # also loadable by transformers.AutoModelForCausalLM

and load it back::

    from swarm.tools.export import load_model            # also swarm.load_model
    model = load_model("exports/tiny")             # a SwarmModel; model(tokens) -> logits

How (``export_run``):

1. Join the DHT as a client, fetch the run's spec (hash-checked) and the stages' peer records; a
   stage without an online peer stops the export before anything is downloaded.
2. For each stage, download the state of one peer with the path joining peers use:
   ``peer.averaging.StageAverager.load_state`` (hivemind's ``load_state_from_peers`` with the prefix
   ``<run>_<spec_hash>_stage<i>``; among the stage's donors it picks the highest weight version). The state is
   the peer's *base* parameters and optimizer slots (``StageCompute.export_state``); the export keeps
   the parameters. For ``nesterov`` these are the parameters proper, not the look-ahead weights the
   peer runs forwards with (note "served weights" in swarm/run/optimizer.py).
3. Check that every stage runs this spec (``spec_hash``), sent the parameter names and shapes of its
   layers, and that the stages are at about the same point of training: their optimizer step counts
   differ by at most ``max_step_lag``. A stage steps once per ``accumulate`` micro-batches of the
   whole stage however many replicas it has (peer/replicas.py), so step counts of stages with
   different replica counts compare directly. Asynchronous training keeps stages a few steps apart
   (up to the micro-batches in flight divided by ``accumulate``), so a small lag is normal; a stage
   far behind (its peers restarted from an old checkpoint or from the seed) is named.
4. Assemble dense weights and write them. Subspace-constrained layers (swarm/run/subspace.py) are
   written as ordinary dense matrices: ``W = U A`` for the attention output and SwiGLU down
   projections, ``E_fix + A U^T`` for the token embedding; the result is an ordinary model with the
   same outputs (``load_model`` returns it as such).

What an export directory holds:

- ``model.safetensors``: the weights. Format ``safetensors``: the project's own parameter names, which
  use the global layer index and so do not depend on the stage split (``embed.weight``,
  ``layers.3.attn.qkv.weight``, ..., ``norm.weight``, ``head.weight``). Format ``hf``: the names of
  transformers' ``LlamaForCausalLM`` (``model.layers.3.self_attn.q_proj.weight``, ...), with
  ``config.json`` beside it. The model maps onto Llama exactly (pre-norm RMSNorm, SwiGLU, no biases,
  RoPE with the rotate-half pairing ``(x[i], x[i + D/2])`` that transformers uses, so q/k need no
  permutation; ``tests/test_export.py`` checks logits against transformers).
- ``run_spec.json``: the run spec (``RunSpec.to_dict()``); its hash is the run's.
- ``export.json``: what was exported when: format, run id, spec hash, per-stage versions and step
  counts, notes.

Memory: a stage is downloaded into the averager's flat buffer (parameters plus optimizer slots,
about 3x the stage's parameters for AdamW) and copied out, one stage at a time; the assembled
weights of the whole model are held until written.

Where it lives: this module holds the options and the sequence (``export_run``); the steps are
``export_download`` (stage states from the swarm), ``export_states`` (checking them, step lag, dense
weights), ``export_files`` (the export directory, ``load_model``) and ``export_hf`` (the Llama layout).
Their public names are importable from here too.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.dht.keys import check_run_id
from swarm.dht.network import DHTConfig
from swarm.errors import ConfigError
from swarm.tools.export_download import _ReaderRecords, download_stage_states
from swarm.tools.export_files import (
    FORMATS,
    INFO_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    _check_format,
    _safetensors,
    check_no_export,
    dense_spec,
    load_model,
    write_export,
)
from swarm.tools.export_hf import _require_transformers, from_hf_state_dict, hf_config_dict, to_hf_state_dict
from swarm.tools.export_states import (
    StageState,
    check_stage_states,
    dense_stage_weights,
    stage_state_from_download,
)

if TYPE_CHECKING:
    import hivemind
    import torch

    from swarm.run.spec import RunSpec

__all__ = [
    "FORMATS",
    "WEIGHTS_FILE",
    "SPEC_FILE",
    "INFO_FILE",
    "ExportConfig",
    "ExportResult",
    "StageState",
    "export_run",
    "download_stage_states",
    "stage_state_from_download",
    "check_stage_states",
    "dense_stage_weights",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "hf_config_dict",
    "write_export",
    "load_model",
    "dense_spec",
]


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Options of ``swarm export`` (checked once here; the CLI maps its flags 1:1)."""

    dht: DHTConfig = field(default_factory=lambda: DHTConfig(client_mode=True))
    """How the exporter joins the swarm; a client is enough: it only reads and downloads."""
    run_id: str
    out_dir: str
    """Directory to write (created if missing)."""
    format: str = "safetensors"
    """``safetensors`` (the project's names) or ``hf`` (transformers' Llama names + config.json)."""
    spec_hash: str | None = None
    """Expected spec hash (16 hex chars); None = the one spec the run publishes."""
    max_step_lag: int = 16
    """Most optimizer steps a stage may be behind the most advanced one. Raise it if training runs
    with many micro-batches in flight; 0 demands identical step counts (e.g. a stopped sync run)."""
    spec_timeout_s: float = 30.0
    """Seconds to wait for the run's spec to appear in the DHT."""
    state_timeout_s: float = 60.0
    """Seconds one stage's download may take (raise it for large stages on slow links)."""
    overwrite: bool = False
    """Replace an existing export in ``out_dir`` (otherwise refuse to touch it)."""
    secret: bytes | None = field(default=None, repr=False)
    """Join secret of a private run (``swarm.dht.auth.load_secret``). In a gated run (private, or with an
    allow/deny list) peers share state only with ids in the stage lists, so the exporter announces itself
    there in state ``reading`` (never routed to, not counted by placement) while it downloads."""

    def __post_init__(self) -> None:
        if not isinstance(self.dht, DHTConfig):
            raise ConfigError(f"dht={self.dht!r} must be a DHTConfig")
        check_run_id(self.run_id)
        if not isinstance(self.out_dir, str | os.PathLike) or not os.fspath(self.out_dir):
            raise ConfigError(
                f"out_dir={self.out_dir!r} must be a directory path, e.g. exports/{self.run_id}"
            )
        object.__setattr__(self, "out_dir", os.fspath(self.out_dir))
        _check_format(self.format)
        if self.spec_hash is not None and (
            not isinstance(self.spec_hash, str)
            or len(self.spec_hash) != 16
            or any(c not in "0123456789abcdef" for c in self.spec_hash)
        ):
            raise ConfigError(
                f"spec_hash={self.spec_hash!r} must be 16 lowercase hex characters, as `swarm status` shows"
            )
        if (
            isinstance(self.max_step_lag, bool)
            or not isinstance(self.max_step_lag, int)
            or self.max_step_lag < 0
        ):
            raise ConfigError(f"max_step_lag={self.max_step_lag!r} must be a non-negative number of steps")
        for name in ("spec_timeout_s", "state_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(f"{name}={value!r} must be a positive number of seconds")


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    spec: RunSpec
    stages: tuple[StageState, ...]
    notes: tuple[str, ...]
    seconds: float


def export_run(cfg: ExportConfig, *, say: Callable[[str], None] | None = None) -> ExportResult:
    """Download, check, assemble and write the run's model (see the module docstring)."""
    from swarm.dht.network import start_dht

    say = say or (lambda line: None)
    t0 = time.monotonic()
    _check_format(cfg.format)
    _safetensors()  # fail before joining the swarm when a needed package is missing
    if cfg.format == "hf":
        _require_transformers()
    out = Path(cfg.out_dir)
    check_no_export(out, overwrite=cfg.overwrite)
    dht = start_dht(cfg.dht)
    try:
        spec, states = _fetch(dht, cfg, say)
    finally:
        dht.shutdown()
    notes = check_stage_states(states, max_step_lag=cfg.max_step_lag)
    dense: dict[str, torch.Tensor] = {}
    for s in states:
        dense.update(s.params)
    info = {"stages": [_stage_info(spec, s) for s in states], "notes": notes}
    written = write_export(out, spec, dense, format=cfg.format, info=info, overwrite=cfg.overwrite)
    return ExportResult(
        out_dir=written, spec=spec, stages=tuple(states), notes=tuple(notes), seconds=time.monotonic() - t0
    )


def _fetch(
    dht: hivemind.DHT, cfg: ExportConfig, say: Callable[[str], None]
) -> tuple[RunSpec, list[StageState]]:
    """The run's spec and every stage's state, fetched through ``dht`` (announced as a reader if gated)."""
    from swarm.dht.auth import RunAuth
    from swarm.dht.membership import Membership

    membership = Membership(dht, cfg.run_id, cfg.spec_hash)
    spec = membership.fetch_spec(timeout_s=cfg.spec_timeout_s)
    say(f"run {spec.run_id}: spec {spec.spec_hash}, {spec.num_stages} stages, {spec.n_params():,} parameters")

    def progress(state: StageState) -> None:
        say(f"  stage {state.stage}: version {state.version}, step {state.step_count}")

    auth = RunAuth.from_spec(spec, cfg.secret)  # ConfigError: a private run without its secret
    membership.set_auth(auth)
    reader = _ReaderRecords(membership, spec).start() if auth.gated else None
    try:
        states = download_stage_states(
            dht, membership, spec, state_timeout_s=cfg.state_timeout_s, on_stage=progress
        )
    finally:
        if reader is not None:
            reader.stop()
    return spec, states


def _stage_info(spec: RunSpec, s: StageState) -> dict[str, Any]:
    """One stage's entry in ``export.json``."""
    return {
        "stage": s.stage,
        "layers": list(spec.stage_layers(s.stage)),
        "version": s.version,
        "step_count": s.step_count,
        "optimizer": s.optimizer,
        "announced_versions": list(s.announced_versions),
    }
