"""Runs that continue an existing checkpoint: a local Hugging Face Llama directory in, a run spec out.

(Over 400 lines on purpose: the readers of one Llama directory (config, weights, tokenizer) each
fill one part of the spec ``spec_from_pretrained`` builds, and refuse what the model cannot represent.)

    swarm init --from-pretrained DIR --stages 4          # DIR: config.json, *.safetensors, tokenizer.json
    swarm peer --initial-peers ... --run RUN --weights DIR   # a peer with its own copy of DIR

What this module does (no networking, no download: DIR is a local directory):

- ``model_config_from_hf(config)``: the spec's ``model`` section from ``config.json`` (width, layers,
  heads, key/value heads of grouped-query attention, SwiGLU width, RoPE base and ``linear``/``llama3``
  scaling, norm epsilon, vocabulary, tied embeddings). What the model code (swarm/run/model.py) cannot
  represent is refused with a ``ConfigError`` naming the feature: another architecture, biases, an
  activation other than SiLU, a head size other than ``hidden_size / num_attention_heads``, other
  RoPE scalings, sliding windows, quantized weights.
- ``read_stage_weights(DIR, spec, stage)``: one stage's tensors, under this project's names, read
  from the (possibly sharded) safetensors files with ``safetensors.safe_open`` (memory-mapped): only
  the stage's own tensors are ever read, never the whole model. The mapping is the inverse of
  ``swarm export --format hf`` (``swarm.tools.export.from_hf_state_dict``): q, k and v fuse into ``qkv``; a
  tied head is read from ``model.embed_tokens.weight``.
- ``stage_digest(weights)``: sha256 of a stage's weights in float32 (names, shapes, bytes, sorted by
  name). ``swarm init`` records one per stage in ``spec.pretrained.stage_digests``; a peer checks the
  weights it starts from against it (``check_stage_weights``), whichever source they came from.
- ``spec_from_pretrained(DIR, ...)``: the whole run spec (model from the config, stages split as
  usual, digests, tokenizer digest; other sections from an optional base spec or fine-tuning defaults).

Tensors are read in the checkpoint's dtype and converted to float32 (exact from bf16/fp16), the
precision peers train in.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from swarm.run.spec import ModelConfig, RunSpec

__all__ = [
    "CONFIG_FILE",
    "TOKENIZER_FILE",
    "read_hf_config",
    "model_config_from_hf",
    "tensor_files",
    "stage_tensor_names",
    "read_stage_weights",
    "stage_digest",
    "placeholder_weights",
    "check_stage_weights",
    "check_initial_state",
    "file_digest",
    "find_tokenizer",
    "tokenizer_cache",
    "remember_tokenizer",
    "run_tokenizer_file",
    "spec_from_pretrained",
    "FINE_TUNE_DEFAULTS",
]

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SEQ_LEN = 1024
"""Training context of a --from-pretrained run when neither --seq-len nor the base spec gives one
(capped at the checkpoint's ``max_position_embeddings``)."""
FINE_TUNE_DEFAULTS: dict[str, Any] = {
    "codecs": {"activations": "blockwise8", "gradients": "blockwise8"},
    "optimizer": {"name": "adamw", "lr": 1e-4, "warmup_steps": 10},
    "micro_batch_size": 4,
}
"""Sections of a --from-pretrained spec that no base spec gives: AdamW at a fine-tuning learning rate
(Muon, the default for training from scratch, is not what these checkpoints were trained with)."""
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # older checkpoints store it
_ARCHITECTURES = ("LlamaForCausalLM",)


def _refuse(feature: str, value: Any, rule: str, next_step: str) -> ConfigError:
    """The error for a checkpoint feature the model code cannot represent (the project's error shape)."""
    return ConfigError(f"{feature} = {value!r} is not supported: {rule}. {next_step}")


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """``DIR/config.json`` as a dict (``ConfigError`` naming the path when missing or not JSON)."""
    path = Path(directory) / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist: --from-pretrained needs a local Hugging Face model directory with "
            "config.json, *.safetensors and tokenizer.json (e.g. one saved with save_pretrained)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e}); check the checkpoint") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------------- the config


def _check_architecture(cfg: Mapping[str, Any]) -> None:
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if cfg.get("model_type", "llama") != "llama" or any(a not in _ARCHITECTURES for a in archs):
        raise _refuse(
            "architecture",
            cfg.get("model_type", archs),
            "the model code represents Llama-architecture decoders (LlamaForCausalLM) only",
            "Use a Llama checkpoint, or convert yours to Llama's layout first",
        )
    checks: list[tuple[str, Callable[[Any], bool], str]] = [
        ("hidden_act", lambda v: v in (None, "silu"), "the SwiGLU blocks use SiLU"),
        ("attention_bias", lambda v: not v, "attention projections have no biases"),
        ("mlp_bias", lambda v: not v, "SwiGLU projections have no biases"),
        (
            "pretraining_tp",
            lambda v: v in (None, 1),
            "tensor-parallel slicing of the matmuls is not modelled",
        ),
        ("sliding_window", lambda v: v is None, "attention is full causal attention"),
        ("quantization_config", lambda v: v is None, "weights must be plain float tensors"),
    ]
    for key, ok, rule in checks:
        if key in cfg and not ok(cfg[key]):
            raise _refuse(key, cfg[key], rule, "Use a checkpoint without it (or dequantize/convert it first)")


def _rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the spec's rope_scaling or None) from either transformers 4 or 5 config keys."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(
            "partial_rotary_factor",
            params.get("partial_rotary_factor", cfg.get("partial_rotary_factor")),
            "RoPE rotates the whole head",
            "Use a checkpoint with full rotary embeddings",
        )
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, {"type": "llama3", **{k: params.get(k) for k in keys}}
    raise _refuse(
        "rope scaling",
        kind,
        "the model code implements plain RoPE and the 'linear' and 'llama3' scalings",
        "Use a checkpoint with one of those (or implement the scaling in swarm/run/model.py, Rotary)",
    )


def model_config_from_hf(cfg: Mapping[str, Any], *, seq_len: int | None = None) -> ModelConfig:
    """The spec's ``model`` section for a Llama ``config.json`` (see the module docstring for refusals)."""
    from swarm.run.spec import ModelConfig

    _check_architecture(cfg)
    d_model, n_heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg
    ]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}; it is not a complete Llama config")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and isinstance(d_model, int) and isinstance(n_heads, int) and n_heads:
        if head_dim * n_heads != d_model:
            raise _refuse(
                "head_dim",
                head_dim,
                f"the head size must be hidden_size / num_attention_heads = {d_model // n_heads}",
                "Use a checkpoint whose heads tile the hidden size",
            )
    theta, scaling = _rope(cfg)
    max_pos = int(cfg.get("max_position_embeddings", DEFAULT_SEQ_LEN))
    kv = cfg.get("num_key_value_heads")
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        d_model=d_model,
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=None if kv in (None, n_heads) else kv,
        seq_len=seq_len if seq_len is not None else min(max_pos, DEFAULT_SEQ_LEN),
        ffn_hidden=cfg.get("intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


# ----------------------------------------------------------------------------------- the weights


def tensor_files(directory: str | Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor (the shard index when there is one, else the files' headers)."""
    root = Path(directory)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{index} is not a safetensors shard index ({e}); check the checkpoint"
            ) from None
        return {name: root / file for name, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{root} holds no *.safetensors files; save the model with safe_serialization (the default "
            "of save_pretrained), or convert its .bin weights first"
        )
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def _hf_layer_names(i: int) -> dict[str, str]:
    """Our names -> transformers' Llama names for layer ``i`` (qkv is split, see ``to_hf_state_dict``)."""
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    return {
        ours + "attn_norm.weight": theirs + "input_layernorm.weight",
        ours + "attn.proj.weight": theirs + "self_attn.o_proj.weight",
        ours + "ffn_norm.weight": theirs + "post_attention_layernorm.weight",
        ours + "ffn.gate.weight": theirs + "mlp.gate_proj.weight",
        ours + "ffn.up.weight": theirs + "mlp.up_proj.weight",
        ours + "ffn.down.weight": theirs + "mlp.down_proj.weight",
    }


_HF_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def _hf_sources(spec: RunSpec, stage: int) -> dict[str, list[str]]:
    """Our parameter names of ``stage`` -> the checkpoint tensors they are made of (qkv: three)."""
    first, end = spec.stage_layers(stage)
    out: dict[str, list[str]] = {}
    if stage == 0:
        out["embed.weight"] = [_HF_TOP["embed.weight"]]
    for i in range(first, end):
        out.update({ours: [theirs] for ours, theirs in _hf_layer_names(i).items()})
        attn = f"model.layers.{i}.self_attn."
        out[f"layers.{i}.attn.qkv.weight"] = [attn + f"{p}_proj.weight" for p in ("q", "k", "v")]
    if stage == spec.num_stages - 1:
        out["norm.weight"] = [_HF_TOP["norm.weight"]]
        out["head.weight"] = [_HF_TOP["embed.weight" if spec.model.tie_embeddings else "head.weight"]]
    return out


def stage_tensor_names(spec: RunSpec, stage: int) -> list[str]:
    """The checkpoint tensors ``stage`` reads (sorted)."""
    return sorted({name for parts in _hf_sources(spec, stage).values() for name in parts})


def check_tensor_names(spec: RunSpec, names: Iterable[str]) -> None:
    """Every tensor of the checkpoint is one the model uses (a bias or an extra module is refused)."""
    used = {n for stage in range(spec.num_stages) for n in stage_tensor_names(spec, stage)}
    present = {n for n in names if not _IGNORED.fullmatch(n)}
    if spec.model.tie_embeddings:
        present.discard("lm_head.weight")  # a tied copy some checkpoints store anyway
    extra, missing = sorted(present - used), sorted(used - present)
    if extra:
        raise _refuse(
            "tensor",
            extra[0],
            f"the model has no such weight ({len(extra)} unused tensor(s), e.g. {', '.join(extra[:3])})",
            "Use a plain Llama checkpoint (no biases or extra modules)",
        )
    if missing:
        raise ConfigError(
            f"the checkpoint lacks {len(missing)} tensor(s) of the model, e.g. {', '.join(missing[:3])}; "
            "it is incomplete (a shard is missing?)"
        )


def read_stage_weights(directory: str | Path, spec: RunSpec, stage: int) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s weights (our names, float32) read memory-mapped from DIR's safetensors files."""
    import torch
    from safetensors import safe_open

    sources = _hf_sources(spec, stage)
    where = tensor_files(directory)
    wanted = sorted({n for parts in sources.values() for n in parts})
    absent = [n for n in wanted if n not in where]
    if absent:
        raise ConfigError(
            f"{directory} lacks tensor(s) {', '.join(absent[:3])} of stage {stage}; is it the checkpoint "
            f"run {spec.run_id!r} was made from?"
        )
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(where[name], []).append(name)
    raw: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                raw[name] = f.get_tensor(name).to(torch.float32)
    return {
        ours: torch.cat([raw[n] for n in parts], dim=0) if len(parts) > 1 else raw[parts[0]]
        for ours, parts in sources.items()
    }


def placeholder_weights(spec: RunSpec, stage: int) -> dict[str, torch.Tensor]:
    """Zeros shaped like ``stage``'s weights: what a peer of a --from-pretrained run builds its stage with
    when it has no ``--weights`` (a donor's state replaces them before it serves; it never serves them)
    and what its throughput benchmark runs on. Drawing the seed's weights instead would take minutes
    for a large stage, only to be thrown away."""
    import torch

    from swarm.run.model import stage_shapes

    return {name: torch.zeros(shape) for name, shape in stage_shapes(spec, stage).items()}


def stage_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, shape, float32 bytes) of every tensor, sorted by name: 64 hex chars."""
    import torch

    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy())  # little-endian float32 on every platform torch runs on
    return h.hexdigest()


def check_stage_weights(
    spec: RunSpec, stage: int, weights: Mapping[str, torch.Tensor], *, source: str
) -> None:
    """``ConfigError`` unless ``weights`` are the initial weights the spec records for ``stage``."""
    assert spec.pretrained is not None, "only a --from-pretrained run records initial weights"
    expected = spec.pretrained.stage_digests[stage]
    got = stage_digest(weights)
    if got != expected:
        raise ConfigError(
            f"the initial weights of stage {stage} from {source} have digest {got[:16]}..., but run "
            f"{spec.run_id!r} was started from {spec.pretrained.source!r} with digest {expected[:16]}...; "
            "they are not the checkpoint the run was made from (another version or a damaged copy). Pass "
            "--weights with the same checkpoint `swarm init --from-pretrained` read, or join without "
            "--weights to get the weights from a live replica or the run's keeper"
        )


def check_initial_state(
    spec: RunSpec, stage: int, meta: Mapping[str, Any], tensors: list, *, source: str
) -> None:
    """For a shared state at version 0 (the initial weights, e.g. a keeper's): its parameters must match
    the spec's digest. Later versions have trained away from it and are not checked."""
    if spec.pretrained is None or meta.get("version") != 0:
        return
    names = list(meta.get("names", []))
    params = {n[len("param/") :]: t for n, t in zip(names, tensors, strict=False) if n.startswith("param/")}
    check_stage_weights(spec, stage, params, source=source)


# ----------------------------------------------------------------------------------- tokenizer


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (64 hex chars)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_tokenizer(path: str | Path) -> Path:
    """``path`` itself, or ``path/tokenizer.json`` when it is a directory (a checkpoint)."""
    p = Path(path)
    return p / TOKENIZER_FILE if p.is_dir() else p


def tokenizer_cache(digest: str) -> Path:
    """Where this machine keeps a run's tokenizer by its sha256 (``~/.cache/swarmpipe/tokenizers/``)."""
    from swarm.run.cache import default_cache_dir

    return default_cache_dir() / "tokenizers" / f"{digest}.json"


def remember_tokenizer(path: str | Path) -> Path | None:
    """Copy a checkpoint's tokenizer into the cache (``swarm init --from-pretrained`` does), so trainers
    and ``swarm generate`` on this machine find it without ``--tokenizer``. Returns the cached path."""
    import shutil

    source = find_tokenizer(path)
    if not source.is_file():
        return None
    target = tokenizer_cache(file_digest(source))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(source, tmp)
    tmp.replace(target)
    return target


def run_tokenizer_file(path: str | Path | None, digest: str, *, source: str) -> Path:
    """The tokenizer.json of a run that records ``digest``: ``path`` (a file or checkpoint directory)
    if given, else this machine's cache. ``ConfigError`` when none is found or the file differs."""
    if path is None:
        cached = tokenizer_cache(digest)
        if cached.is_file() and file_digest(cached) == digest:
            return cached
        raise ConfigError(
            f"this run continues the checkpoint {source!r} and trains with its tokenizer (sha256 "
            f"{digest[:16]}...), which this machine does not have yet: pass --tokenizer DIR (a copy of the "
            "checkpoint) or DIR/tokenizer.json; it is then remembered for later runs"
        )
    file = find_tokenizer(path)
    if not file.is_file():
        raise ConfigError(
            f"--tokenizer {str(path)!r}: {file} does not exist; give the checkpoint's tokenizer.json"
        )
    got = file_digest(file)
    if got != digest:
        raise ConfigError(
            f"--tokenizer {str(file)!r} has sha256 {got[:16]}..., but the run was made with the tokenizer of "
            f"{source!r} ({digest[:16]}...); pass that checkpoint's tokenizer.json"
        )
    remember_tokenizer(file)
    return file


# ----------------------------------------------------------------------------------- the spec


def spec_from_pretrained(
    directory: str | Path,
    *,
    base: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    stages: int | None = None,
    seq_len: int | None = None,
    on_stage: Callable[[int, str], None] | None = None,
) -> RunSpec:
    """The run spec that continues the checkpoint in ``directory`` (see the module docstring).

    ``base``: a parsed spec file for everything but the model (its ``model`` section may give only
    ``seq_len``); otherwise ``FINE_TUNE_DEFAULTS``. Reads one stage's tensors at a time to digest them;
    ``on_stage(stage, digest)`` is called after each.
    """
    from swarm.run.spec import RunSpec

    root = Path(directory)
    base = dict(base or {})
    base_model = dict(base.pop("model", None) or {})
    unknown = sorted(set(base_model) - {"seq_len"})
    if unknown:
        raise ConfigError(
            f"the base spec's model section sets {', '.join(unknown)}; with --from-pretrained the model comes "
            "from the checkpoint's config.json (only model.seq_len may be given)"
        )
    model = model_config_from_hf(read_hf_config(root), seq_len=seq_len or base_model.get("seq_len"))
    data = {**FINE_TUNE_DEFAULTS, **base}
    data["run_id"] = run_id or base.get("run_id") or _run_id_for(root)
    data["stages"] = stages or base.get("stages") or min(2, model.n_layers)
    data["model"] = _to_plain(model)
    data.pop("pretrained", None)
    shape = RunSpec.from_dict(data)  # the split, validated, before any tensor is read
    check_tensor_names(shape, tensor_files(root))
    digests = []
    for stage in range(shape.num_stages):
        digests.append(stage_digest(read_stage_weights(root, shape, stage)))
        if on_stage is not None:
            on_stage(stage, digests[-1])
    tokenizer = find_tokenizer(root)
    data["pretrained"] = {"source": root.resolve().name or "checkpoint", "stage_digests": digests}
    if tokenizer.is_file():
        data["pretrained"]["tokenizer"] = file_digest(tokenizer)
    return RunSpec.from_dict(data)


def _run_id_for(root: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", root.resolve().name).strip("-")[:64]
    return name or "pretrained"


def _to_plain(model: ModelConfig) -> dict[str, Any]:
    from swarm.run.spec import _to_plain as plain

    return plain(model)
