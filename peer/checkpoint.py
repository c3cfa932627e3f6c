"""Checkpoints of one stage peer: parameters, optimizer state, version, spec hash and stage.

One file per checkpoint directory (``<dir>/peer_checkpoint.pt``): a directory belongs to one peer.
Writes are atomic (a temporary file in the same directory, then ``os.replace``), so a crash while
saving leaves the previous checkpoint intact. Loading refuses a checkpoint of another run spec
(another ``spec_hash``) with a clear error rather than loading weights of the wrong shapes or
semantics; a checkpoint of another stage is reported as such so the caller can decide.

The payload is a plain dict of tensors and numbers read with ``torch.load(weights_only=True)``,
so a tampered file cannot execute code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarm.atomic import atomic_torch_save
from swarm.errors import ConfigError

__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint", "checkpoint_path", "FILE_NAME"]

FILE_NAME = "peer_checkpoint.pt"
_FORMAT = 1


@dataclass(frozen=True)
class Checkpoint:
    """What a peer needs to resume: ``tensors`` in ``names`` order (see ``StageOptimizer.state_names``)."""

    spec_hash: str
    run_id: str
    stage: int
    version: int
    names: list[str]
    tensors: list[torch.Tensor]
    meta: dict[str, Any]


def checkpoint_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / FILE_NAME


def save_checkpoint(directory: str | os.PathLike[str], ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` atomically to ``<directory>/peer_checkpoint.pt`` (creating the directory)."""
    path = checkpoint_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": _FORMAT,
        "spec_hash": ckpt.spec_hash,
        "run_id": ckpt.run_id,
        "stage": int(ckpt.stage),
        "version": int(ckpt.version),
        "names": list(ckpt.names),
        "tensors": [t.detach().to("cpu").contiguous() for t in ckpt.tensors],
        "meta": dict(ckpt.meta),
    }
    atomic_torch_save(payload, path, prefix=".tmp-ckpt-")
    return path


def load_checkpoint(directory: str | os.PathLike[str], *, spec_hash: str) -> Checkpoint | None:
    """Read the checkpoint in ``directory``; None when there is none.

    Raises ``ConfigError`` when the file is unreadable or belongs to another run spec.
    """
    path = checkpoint_path(directory)
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types on a corrupt file  # noqa: BLE001
        raise ConfigError(
            f"checkpoint {str(path)!r} cannot be read ({type(e).__name__}: {e}); move it away to start "
            "this stage from the swarm's current weights"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ConfigError(f"checkpoint {str(path)!r} is not a swarmpipe peer checkpoint (format {_FORMAT})")
    if payload["spec_hash"] != spec_hash:
        raise ConfigError(
            f"checkpoint {str(path)!r} was saved for run spec {payload['spec_hash']} (run "
            f"{payload.get('run_id')!r}), but this run's spec hash is {spec_hash}; use another "
            "--checkpoint-dir for this run, or delete the old checkpoint"
        )
    names, tensors = payload["names"], payload["tensors"]
    if len(names) != len(tensors):
        raise ConfigError(
            f"checkpoint {str(path)!r} is corrupt: {len(names)} names for {len(tensors)} tensors"
        )
    return Checkpoint(
        spec_hash=payload["spec_hash"],
        run_id=payload["run_id"],
        stage=int(payload["stage"]),
        version=int(payload["version"]),
        names=list(names),
        tensors=list(tensors),
        meta=dict(payload["meta"]),
    )
