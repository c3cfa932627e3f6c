"""The stages' states an export is assembled from: what one download gave, checked, made dense.

A download is checked against this software's layout of the stage (names, shapes, finite values),
the stages against each other (their optimizer step counts differ by at most ``max_step_lag``), and
subspace-constrained layers become the ordinary dense matrices they compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm.errors import RecordError, StageUnavailableError

if TYPE_CHECKING:
    import torch

    from swarm.run.model import StageModule
    from swarm.run.spec import RunSpec


@dataclass(frozen=True)
class StageState:
    """What one stage's download gave (parameters by the stage's own names, on CPU, float32)."""

    stage: int
    version: int  # the donor's weight version (optimizer steps + averaging rounds)
    step_count: int  # the donor's optimizer steps
    params: dict[str, torch.Tensor]  # after download_stage_states: the dense weights (global names)
    optimizer: str | None = None
    announced_versions: tuple[int, ...] = ()  # versions the stage's online peers announce in the DHT


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
