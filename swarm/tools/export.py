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
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.dht.network import DHTConfig
from swarm.dht.records import PeerRecord, check_run_id
from swarm.errors import ConfigError, PeerFailure, RecordError, StageUnavailableError, SwarmError
from swarm.run.pretrained import _HF_TOP, _hf_layer_names

if TYPE_CHECKING:
    import hivemind
    import torch

    from swarm.dht.membership import Membership
    from swarm.run.model import StageModule, SwarmModel
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

logger = logging.getLogger(__name__)

FORMATS = ("safetensors", "hf")
WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "run_spec.json"
INFO_FILE = "export.json"
HF_CONFIG_FILE = "config.json"
EXPORT_VERSION = 1


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


def _check_format(fmt: object) -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt  # type: ignore[return-value]


@dataclass(frozen=True)
class StageState:
    """What one stage's download gave (parameters by the stage's own names, on CPU, float32)."""

    stage: int
    version: int  # the donor's weight version (optimizer steps + averaging rounds)
    step_count: int  # the donor's optimizer steps
    params: dict[str, torch.Tensor]  # after download_stage_states: the dense weights (global names)
    optimizer: str | None = None
    announced_versions: tuple[int, ...] = ()  # versions the stage's online peers announce in the DHT


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    spec: RunSpec
    stages: tuple[StageState, ...]
    notes: tuple[str, ...]
    seconds: float


# --------------------------------------------------------------------------- checks (pure parts)


def stage_state_from_download(
    spec: RunSpec,
    stage: int,
    meta: Mapping[str, Any],
    tensors: list[torch.Tensor],
    *,
    expected: Mapping[str, tuple[int, ...]],
    state_names: list[str],
) -> StageState:
    """Validate one downloaded state against the spec and the stage's parameters; keep the parameters.

    ``expected`` maps the stage's parameter names to shapes; ``state_names`` is the order of the
    state tensors (``param/<name>`` then optimizer slots, as ``StageOptimizer.state_names``).
    Raises ``RecordError`` naming the stage and what is wrong (a peer of another spec, a garbled state).
    """
    import torch

    where = f"the state a peer of stage {stage} sent"
    if meta.get("spec_hash") != spec.spec_hash:
        raise RecordError(
            f"{where} is for run spec {meta.get('spec_hash')!r}, not {spec.spec_hash}; a peer serving another "
            "spec of this run id answered. Pass --spec-hash to pick the spec, or stop the stray peer"
        )
    if meta.get("stage") != stage:
        raise RecordError(f"{where} claims to be stage {meta.get('stage')!r}; the peer is misconfigured")
    names = meta.get("names")
    if not isinstance(names, list | tuple) or list(names) != list(state_names) or len(tensors) != len(names):
        raise RecordError(
            f"{where} holds {len(tensors)} tensors named differently from this software's stage "
            f"{stage} ({len(state_names)} expected); the peer runs another swarmpipe version"
        )
    version, steps = meta.get("version"), meta.get("step_count", 0)
    for label, value in (("version", version), ("step_count", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RecordError(f"{where} has {label} {value!r}; it must be a non-negative integer")
    params: dict[str, torch.Tensor] = {}
    for name, tensor in zip(names, tensors, strict=True):
        if not name.startswith("param/"):
            continue  # optimizer slots: not part of the model
        pname = name[len("param/") :]
        if tuple(tensor.shape) != tuple(expected[pname]):
            raise RecordError(
                f"{where}: {pname} has shape {tuple(tensor.shape)}, expected {tuple(expected[pname])}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise RecordError(f"{where}: {pname} holds NaN or Inf; that replica diverged, try again later")
        params[pname] = tensor.detach().to("cpu", torch.float32)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise RecordError(f"{where} lacks parameters {missing[:4]}; the peer runs another swarmpipe version")
    optimizer = meta.get("optimizer")
    return StageState(
        stage=stage,
        version=version,
        step_count=steps,
        params=params,
        optimizer=optimizer if isinstance(optimizer, str) else None,
    )


def check_stage_states(states: list[StageState], *, max_step_lag: int) -> list[str]:
    """Refuse stages that are too far behind (``StageUnavailableError`` naming them); return notes.

    Notes say when a stage's donor was not the most advanced replica the DHT announces.
    """
    if not states:
        raise StageUnavailableError("no stage states to check")
    lead = max(states, key=lambda s: s.step_count)
    behind = [s for s in states if lead.step_count - s.step_count > max_step_lag]
    if behind:
        described = ", ".join(f"stage {s.stage} at step {s.step_count} (version {s.version})" for s in behind)
        raise StageUnavailableError(
            f"{described} {'is' if len(behind) == 1 else 'are'} more than {max_step_lag} optimizer steps behind "
            f"stage {lead.stage} (step {lead.step_count}); the assembled model would mix weights from different "
            "points of training. Wait for the stage to catch up (`swarm status` shows its peers; a peer that "
            "restarted from an old checkpoint catches up only by training), or pass --max-step-lag "
            f"{lead.step_count - min(s.step_count for s in behind)} to export anyway"
        )
    notes = []
    for s in states:
        best = max(s.announced_versions, default=s.version)
        if best > s.version:
            notes.append(
                f"stage {s.stage}: downloaded version {s.version}, but a peer of the stage announces version "
                f"{best} (it may not be sharing its state yet)"
            )
    return notes


# ------------------------------------------------------------------------------ weight layouts


def dense_stage_weights(module: StageModule) -> dict[str, torch.Tensor]:
    """The stage's weights as an ordinary (dense) model's state dict, by global parameter names.

    Subspace modules (swarm/run/model.py, Note [subspace reparametrisation]) become the dense matrices
    they compute: ``SubspaceLinear`` -> ``U A``; ``SubspaceEmbedding`` -> ``E_fix + A U^T``.
    """
    import torch

    from swarm.run.model import SubspaceEmbedding, SubspaceLinear

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            owner_name = name.rpartition(".")[0]
            owner = module.get_submodule(owner_name)
            if isinstance(owner, SubspaceLinear):
                out[f"{owner_name}.weight"] = (
                    owner.basis.float() @ owner.coef.float()
                ).contiguous()  # (d, in)
            elif isinstance(owner, SubspaceEmbedding):
                trained = owner.coef.float() @ owner.basis.float().T  # (V, k) @ (k, d) -> (V, d)
                out[f"{owner_name}.weight"] = (owner.fixed.float() + trained).contiguous()
            else:
                out[name] = p.detach().float().contiguous()
    return out


def to_hf_state_dict(spec: RunSpec, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense weights under transformers' ``LlamaForCausalLM`` names.

    The fused ``qkv`` (C + 2 KV, C) splits row-wise into q (C, C), k and v (KV, C) (KV = n_kv_heads *
    head_dim; C without grouped-query attention) with heads in row blocks of ``head_dim``, which is
    Llama's layout; RoPE pairs match (module docstring), so no permutation.
    """
    sizes = qkv_sizes(spec)
    out = {_HF_TOP[name]: dense[name] for name in _HF_TOP}
    for i in range(spec.model.n_layers):
        for ours, theirs in _hf_layer_names(i).items():
            out[theirs] = dense[ours]
        q, k, v = dense[f"layers.{i}.attn.qkv.weight"].split(sizes, dim=0)
        prefix = f"model.layers.{i}.self_attn."
        out[prefix + "q_proj.weight"], out[prefix + "k_proj.weight"], out[prefix + "v_proj.weight"] = (
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
        )
    return out


def qkv_sizes(spec: RunSpec) -> list[int]:
    """Rows of q, k and v in the fused ``qkv`` weight of every layer."""
    m = spec.model
    kv = m.kv_heads * m.head_dim
    return [m.d_model, kv, kv]


def from_hf_state_dict(spec: RunSpec, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_hf_state_dict` (raises ``ConfigError`` naming a missing tensor)."""
    import torch

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConfigError(f"the export lacks tensor {name!r}; it is incomplete or not a swarm export")
        return hf[name]

    out = {ours: get(theirs) for ours, theirs in _HF_TOP.items()}
    for i in range(spec.model.n_layers):
        for ours, theirs in _hf_layer_names(i).items():
            out[ours] = get(theirs)
        prefix = f"model.layers.{i}.self_attn."
        out[f"layers.{i}.attn.qkv.weight"] = torch.cat(
            [get(prefix + f"{p}_proj.weight") for p in ("q", "k", "v")], dim=0
        )
    return out


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--format hf needs the `transformers` package, which is not installed; install it with "
            "`pip install transformers` (or export with --format safetensors)"
        ) from None
    return transformers


def hf_config_dict(spec: RunSpec) -> dict[str, Any]:
    """``config.json`` of the equivalent ``LlamaForCausalLM``, made by transformers' own ``LlamaConfig``.

    Raises ``ConfigError`` naming the pip package when transformers is missing.
    """
    import inspect

    LlamaConfig = _require_transformers().LlamaConfig  # noqa: N806 (a class)
    m = spec.model
    params = inspect.signature(LlamaConfig.__init__).parameters
    kwargs: dict[str, Any] = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim,
        hidden_act="silu",
        max_position_embeddings=_max_positions(spec),
        rms_norm_eps=m.norm_eps,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    rope = hf_rope_parameters(spec)
    if "rope_parameters" in params:  # transformers >= 5
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope.pop("rope_theta")
        if rope["rope_type"] != "default":
            kwargs["rope_scaling"] = rope
    kwargs["dtype" if "dtype" in params else "torch_dtype"] = "float32"
    return LlamaConfig(**kwargs).to_dict()


def _max_positions(spec: RunSpec) -> int:
    """``max_position_embeddings`` of the export: the run's ``seq_len``, or for llama3 RoPE scaling at
    least the scaled context (transformers expects it above ``original_max_position_embeddings``)."""
    m = spec.model
    scaling = m.rope_scaling
    if scaling is None or scaling.type != "llama3":
        return m.seq_len
    assert scaling.original_max_position_embeddings is not None  # checked by the spec
    return max(m.seq_len, int(scaling.original_max_position_embeddings * scaling.factor))


def hf_rope_parameters(spec: RunSpec) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for the run's RoPE (base and scaling)."""
    m = spec.model
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    scaling = m.rope_scaling
    if scaling is not None:
        rope["rope_type"] = scaling.type
        rope["factor"] = float(scaling.factor)
        if scaling.type == "llama3":
            rope["low_freq_factor"] = float(scaling.low_freq_factor)  # type: ignore[arg-type]
            rope["high_freq_factor"] = float(scaling.high_freq_factor)  # type: ignore[arg-type]
            rope["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    return rope


# ------------------------------------------------------------------------------ files


def dense_spec(spec: RunSpec) -> RunSpec:
    """The spec of the ordinary model with the same outputs: ``spec`` without ``model.subspace``."""
    from swarm.run.spec import RunSpec

    if spec.model.subspace is None:
        return spec
    d = spec.to_dict()
    d["model"].pop("subspace", None)
    return RunSpec.from_dict(d)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError(
            "exporting and loading models needs the `safetensors` package; install it with "
            "`pip install safetensors`"
        ) from None
    return safetensors.torch


def write_export(
    out_dir: str | os.PathLike[str],
    spec: RunSpec,
    dense: Mapping[str, torch.Tensor],
    *,
    format: str = "safetensors",  # noqa: A002 (the CLI flag's name)
    info: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``dense`` (the whole model's dense weights, our names) to ``out_dir`` in ``format``.

    Everything is checked (format, packages, completeness, existing files) before the first write;
    each file is written under a temporary name and renamed, so a crash leaves no half file.
    """
    import torch

    _check_format(format)
    st = _safetensors()
    hf_config = hf_config_dict(spec) if format == "hf" else None
    expected = set(dense_stage_names(spec))
    if set(dense) != expected:
        missing, extra = sorted(expected - set(dense)), sorted(set(dense) - expected)
        raise ConfigError(
            f"the weights do not match run {spec.run_id!r}: missing {missing[:4]}, extra {extra[:4]}"
        )
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory")
    existing = [name for name in (WEIGHTS_FILE, SPEC_FILE, INFO_FILE) if (out / name).exists()]
    if existing and not overwrite:
        raise ConfigError(
            f"{out} already holds an export ({', '.join(existing)}); pass --force to replace it"
        )
    tensors = to_hf_state_dict(spec, dense) if format == "hf" else dict(dense)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    record = {
        "export_version": EXPORT_VERSION,
        "format": format,
        "run_id": spec.run_id,
        "spec_hash": spec.spec_hash,
        "dense": True,
        "subspace": spec.model.subspace is not None,
        "n_params": sum(t.numel() for t in dense.values()),
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **dict(info or {}),
    }
    out.mkdir(parents=True, exist_ok=True)

    def atomic(name: str, write: Callable[[Path], None]) -> None:
        tmp = out / f".{name}.tmp"
        write(tmp)
        os.replace(tmp, out / name)

    metadata = {
        "format": "pt",
        "swarmpipe_format": format,
        "run_id": spec.run_id,
        "spec_hash": spec.spec_hash,
    }
    atomic(WEIGHTS_FILE, lambda p: st.save_file(tensors, str(p), metadata=metadata))
    atomic(SPEC_FILE, lambda p: p.write_text(json.dumps(spec.to_dict(), indent=2, sort_keys=True) + "\n"))
    if hf_config is not None:
        atomic(HF_CONFIG_FILE, lambda p: p.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n"))
    atomic(INFO_FILE, lambda p: p.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n"))
    return out


def dense_stage_names(spec: RunSpec) -> list[str]:
    """Parameter names of the whole ordinary (dense) model, in order."""
    m = spec.model
    names = ["embed.weight"]
    for i in range(m.n_layers):
        p = f"layers.{i}."
        names += [
            p + n
            for n in (
                "attn_norm.weight",
                "attn.qkv.weight",
                "attn.proj.weight",
                "ffn_norm.weight",
                "ffn.gate.weight",
                "ffn.up.weight",
                "ffn.down.weight",
            )
        ]
    return names + ["norm.weight", "head.weight"]


def load_model(path: str | os.PathLike[str], *, device: torch.device | str | None = None) -> SwarmModel:
    """Load an export (either format) into the project's own model class, in eval mode.

    Returns an ordinary (dense) ``SwarmModel`` split into the run's stages; for a subspace-constrained
    run it is the dense model with the same outputs (its spec is :func:`dense_spec` of the run's).
    Raises ``ConfigError`` when the directory is not a complete export of a spec it holds.
    """
    from swarm.run.model import build_model
    from swarm.run.spec import RunSpec

    root = Path(path)
    try:
        info = json.loads((root / INFO_FILE).read_text())
        spec = RunSpec.from_dict(json.loads((root / SPEC_FILE).read_text()))
    except FileNotFoundError as e:
        raise ConfigError(
            f"{root} is not a swarm export: {Path(e.filename).name} is missing (make one with `swarm export`)"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{root}: a file of the export is not valid JSON ({e}); re-export it") from None
    if info.get("spec_hash") != spec.spec_hash:
        raise ConfigError(
            f"{root}: {SPEC_FILE} hashes to {spec.spec_hash} but {INFO_FILE} says {info.get('spec_hash')}; "
            "the files come from different exports"
        )
    fmt = _check_format(info.get("format"))
    tensors = _safetensors().load_file(str(root / WEIGHTS_FILE))
    dense = from_hf_state_dict(spec, tensors) if fmt == "hf" else tensors
    model = build_model(dense_spec(spec))
    for stage in model.stages:
        wanted = stage.state_dict().keys()
        missing = [k for k in wanted if k not in dense]
        if missing:
            raise ConfigError(
                f"{root}/{WEIGHTS_FILE} lacks {missing[:4]}; the export is incomplete, re-export it"
            )
        try:
            stage.load_state_dict({k: dense[k] for k in wanted}, strict=True)
        except RuntimeError as e:  # shape mismatch
            raise ConfigError(f"{root}/{WEIGHTS_FILE} does not fit run spec {spec.spec_hash}: {e}") from None
    model.eval()
    return model.to(device) if device is not None else model


# ------------------------------------------------------------------------------ download


def _state_layout(spec: RunSpec, module: StageModule) -> tuple[dict[str, tuple[int, ...]], list[str], list]:
    """(param shapes, state names, meta-device state tensors) of a stage, as its peers lay them out."""
    import torch

    from swarm.run.optimizer import StageOptimizer

    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    # The peer's own optimizer class decides the order and slots of its state (swarm/run/optimizer.py);
    # built on the meta device it allocates nothing.
    meta_params = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    opt = StageOptimizer(meta_params, spec.optimizer)
    return shapes, opt.state_names(), opt.state_tensors()


def _no_state() -> tuple[dict[str, Any], list]:
    raise PeerFailure("an exporter holds no stage state to share")


def download_stage_states(
    dht: hivemind.DHT,
    membership: Membership,
    spec: RunSpec,
    *,
    state_timeout_s: float,
    on_stage: Callable[[StageState], None] | None = None,
) -> list[StageState]:
    """Download one peer's state of every stage (``StageAverager.load_state``, as joining peers do).

    Checks first that every stage has an online peer (``StageUnavailableError`` naming the others).
    Each returned ``StageState.params`` holds the stage's *dense* weights (:func:`dense_stage_weights`);
    ``on_stage(state)`` is called as each stage arrives.
    """
    from peer.averaging import StageAverager
    from swarm.run.model import StageModule, build_stage

    records = membership.all_stage_records(spec.num_stages)
    online: list[list[PeerRecord]] = [[r for r in recs.values() if r.state == "online"] for recs in records]
    empty = [s for s, peers in enumerate(online) if not peers]
    if empty:
        raise StageUnavailableError(
            f"stage{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of run {spec.run_id!r} "
            f"{'have' if len(empty) > 1 else 'has'} no online peer to download from; start one with "
            f"`swarm peer --initial-peers ... --run {spec.run_id}` (or wait: `swarm status` shows joining peers)"
        )
    states = []
    for stage in range(spec.num_stages):
        # shapes only (nothing drawn: the weights come from the download)
        shapes, state_names, layout = _state_layout(spec, StageModule(spec, stage, draw=False))
        t0 = time.monotonic()
        averager = StageAverager.create(
            dht,
            run_id=spec.run_id,
            spec_hash=spec.spec_hash,
            stage=stage,
            shapes=layout,
            grad_shapes=[],  # an exporter only downloads: it never joins a gradient round
            state_fn=_no_state,
        )
        try:
            averager.wait_ready(min(30.0, state_timeout_s))
            loaded = None
            deadline = t0 + state_timeout_s
            # A donor declares itself in the DHT a moment after it goes online; retry until the deadline.
            while loaded is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    loaded = averager.load_state(timeout_s=left)
                except TimeoutError:
                    loaded = None
                if loaded is None and deadline - time.monotonic() > 1.0:
                    time.sleep(1.0)
        finally:
            averager.shutdown()
        if loaded is None:
            raise StageUnavailableError(
                f"no peer of stage {stage} sent its state within {state_timeout_s:.0f} s although "
                f"{len(online[stage])} announce{'s' if len(online[stage]) == 1 else ''} being online; they "
                "may be busy or unreachable from here. Try again, or raise --state-timeout-s"
            )
        meta, tensors = loaded
        raw = stage_state_from_download(spec, stage, meta, tensors, expected=shapes, state_names=state_names)
        del meta, tensors, loaded  # optimizer slots: not part of the model
        module = build_stage(spec, stage, weights=raw.params)
        # Keep only the dense weights: the raw parameters are not needed once converted.
        state = dataclasses.replace(
            raw,
            params=dense_stage_weights(module),
            announced_versions=tuple(sorted(r.version for r in online[stage])),
        )
        del raw, module
        logger.info(
            "stage %d: version %d (step %d) downloaded and converted in %.1f s",
            stage,
            state.version,
            state.step_count,
            time.monotonic() - t0,
        )
        if on_stage is not None:
            on_stage(state)
        states.append(state)
    return states


class _ReaderRecords:
    """Keeps a ``reading`` record of this exporter in every stage list while it downloads (see
    ``ExportConfig.secret``); :meth:`stop` replaces them with short-lived ``leaving`` records."""

    PERIOD_S = 5.0

    def __init__(self, membership: Membership, spec: RunSpec):
        self.membership = membership
        self.records = [
            PeerRecord(
                peer_id=membership.peer_id,
                run_id=spec.run_id,
                stage=s,
                state="reading",
                throughput=0.0,
                queue=0,
                version=0,
                codecs=(),
                spec_hash=spec.spec_hash,
            )
            for s in range(spec.num_stages)
        ]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="export-reader-records", daemon=True)

    def _announce(self) -> None:
        for record in self.records:
            try:
                self.membership.announce(record)
            except SwarmError as e:  # a DHT hiccup: the next period tries again
                logger.warning("could not announce the exporter's record for stage %d: %s", record.stage, e)

    def start(self) -> _ReaderRecords:
        self._announce()  # before the first download: peers refresh their authorized ids every second
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            self._announce()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)
        for record in self.records:
            with contextlib.suppress(SwarmError):
                self.membership.announce_leaving(record, expiration_s=self.PERIOD_S)


def export_run(cfg: ExportConfig, *, say: Callable[[str], None] | None = None) -> ExportResult:
    """Download, check, assemble and write the run's model (see the module docstring)."""
    from swarm.dht.membership import Membership
    from swarm.dht.network import start_dht

    say = say or (lambda line: None)
    t0 = time.monotonic()
    _check_format(cfg.format)
    _safetensors()  # fail before joining the swarm when a needed package is missing
    if cfg.format == "hf":
        _require_transformers()
    out = Path(cfg.out_dir)
    existing = [n for n in (WEIGHTS_FILE, SPEC_FILE, INFO_FILE) if (out / n).exists()]
    if existing and not cfg.overwrite:
        raise ConfigError(
            f"{out} already holds an export ({', '.join(existing)}); pass --force to replace it"
        )
    dht = start_dht(cfg.dht)
    try:
        membership = Membership(dht, cfg.run_id, cfg.spec_hash)
        spec = membership.fetch_spec(timeout_s=cfg.spec_timeout_s)
        say(
            f"run {spec.run_id}: spec {spec.spec_hash}, {spec.num_stages} stages, {spec.n_params():,} parameters"
        )

        def progress(state: StageState) -> None:
            say(f"  stage {state.stage}: version {state.version}, step {state.step_count}")

        from swarm.dht.auth import RunAuth

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
    finally:
        dht.shutdown()
    notes = check_stage_states(states, max_step_lag=cfg.max_step_lag)
    dense: dict[str, torch.Tensor] = {}
    for s in states:
        dense.update(s.params)
    info = {
        "stages": [
            {
                "stage": s.stage,
                "layers": list(spec.stage_layers(s.stage)),
                "version": s.version,
                "step_count": s.step_count,
                "optimizer": s.optimizer,
                "announced_versions": list(s.announced_versions),
            }
            for s in states
        ],
        "notes": notes,
    }
    written = write_export(out, spec, dense, format=cfg.format, info=info, overwrite=cfg.overwrite)
    return ExportResult(
        out_dir=written, spec=spec, stages=tuple(states), notes=tuple(notes), seconds=time.monotonic() - t0
    )
