"""swarm: everything about the swarm as a whole, in one-way layers (docs/ARCHITECTURE.md).

Subpackages, lowest first (each imports only those before it):
- ``errors``, ``version``, ``atomic`` (modules here): the exception hierarchy, the software version,
  atomic file writes; they import nothing of ours.
- ``run/``: the run spec, the staged model, its initialisation, subspace boundaries, the optimizer.
- ``wire/``: the data-plane protocol trainers and peers speak.
- ``dht/``: DHT start-up, records, membership, access, placement, snapshots, hivemind processes.
- (``peer/``, a top-level package: one stage peer; it uses ``run/``, ``wire/`` and ``dht/`` only.)
- ``client/``: a process's link into a run, routing and liveness.
- ``train/``: the trainer, its ledger, data, metrics and sinks, the one-process reference.
- ``tools/``: bootstrap, keeper, status, monitor, generate, export, demo.
- ``cli/``: the ``swarm`` command line.

Public names are re-exported lazily (importing ``swarm`` does not import torch or hivemind).
"""

from __future__ import annotations

import importlib
from typing import Any

from swarm.errors import (
    ConfigError,
    PeerFailure,
    RecordError,
    RequestError,
    StageUnavailableError,
    SwarmError,
)
from swarm.version import __version__

_LAZY = {
    "RunSpec": "swarm.run.spec",
    "ModelConfig": "swarm.run.spec",
    "build_stage": "swarm.run.model",
    "build_model": "swarm.run.model",
    "lm_loss": "swarm.run.model",
    "Membership": "swarm.dht.membership",
    "PeerRecord": "swarm.dht.records",
    "DHTConfig": "swarm.dht.network",
    "start_dht": "swarm.dht.network",
    "choose_stage": "swarm.dht.placement",
    "should_move": "swarm.dht.placement",
    "Trainer": "swarm.train.trainer",
    "TrainerConfig": "swarm.train.trainer",
    "load_model": "swarm.tools.export",
    "make_boundary": "swarm.run.subspace",
}

__all__ = [
    "__version__",
    "SwarmError",
    "ConfigError",
    "RecordError",
    "RequestError",
    "StageUnavailableError",
    "PeerFailure",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
