"""An export directory: writing the assembled weights in one of ``FORMATS``, and loading them back.

``model.safetensors`` holds the weights (the project's names, or transformers' for ``hf`` with
``config.json`` beside it), ``run_spec.json`` the run spec and ``export.json`` what was exported when.
Each file is written under a temporary name and renamed, so a crash leaves no half file.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.errors import ConfigError
from swarm.tools.export_hf import from_hf_state_dict, hf_config_dict, to_hf_state_dict

if TYPE_CHECKING:
    import torch

    from swarm.run.model import SwarmModel
    from swarm.run.spec import RunSpec

FORMATS = ("safetensors", "hf")
WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "run_spec.json"
INFO_FILE = "export.json"
HF_CONFIG_FILE = "config.json"
EXPORT_VERSION = 1


def _check_format(fmt: object) -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt  # type: ignore[return-value]


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
    check_no_export(out, overwrite=overwrite)
    tensors = to_hf_state_dict(spec, dense) if format == "hf" else dict(dense)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    record = _export_record(spec, dense, format, info)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": "pt",
        "swarmpipe_format": format,
        "run_id": spec.run_id,
        "spec_hash": spec.spec_hash,
    }
    _atomic(out, WEIGHTS_FILE, lambda p: st.save_file(tensors, str(p), metadata=metadata))
    _atomic(out, SPEC_FILE, lambda p: _write_json(p, spec.to_dict()))
    if hf_config is not None:
        _atomic(out, HF_CONFIG_FILE, lambda p: _write_json(p, hf_config))
    _atomic(out, INFO_FILE, lambda p: _write_json(p, record))
    return out


def check_no_export(out: Path, *, overwrite: bool) -> None:
    """Refuse (``ConfigError``) to replace an export already in ``out`` unless ``overwrite``."""
    existing = [name for name in (WEIGHTS_FILE, SPEC_FILE, INFO_FILE) if (out / name).exists()]
    if existing and not overwrite:
        raise ConfigError(
            f"{out} already holds an export ({', '.join(existing)}); pass --force to replace it"
        )


def _export_record(
    spec: RunSpec, dense: Mapping[str, torch.Tensor], fmt: str, info: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The contents of ``export.json``: what was exported, when, plus the caller's ``info``."""
    return {
        "export_version": EXPORT_VERSION,
        "format": fmt,
        "run_id": spec.run_id,
        "spec_hash": spec.spec_hash,
        "dense": True,
        "subspace": spec.model.subspace is not None,
        "n_params": sum(t.numel() for t in dense.values()),
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **dict(info or {}),
    }


def _atomic(out: Path, name: str, write: Callable[[Path], None]) -> None:
    tmp = out / f".{name}.tmp"
    write(tmp)
    os.replace(tmp, out / name)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


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
