"""swarm: everything about the swarm as a whole.

Map of modules:
- ``spec``: the run spec (typed, validated config dataclasses, canonical bytes and hash).
- ``model``: the GPT/Llama-style decoder split into pipeline stages (``build_stage``, ``build_model``).
- ``records``, ``membership``, ``network``: DHT records, the one DHT owner per process, DHT start-up.
- ``placement``: which stage a peer claims and when it moves (pure functions).
- ``bootstrap``, ``status``: the node behind ``swarm init`` and the per-stage status view.
- ``routing``, ``data``, ``trainer``, ``metrics``: the trainer that drives micro-batches through routes.
- ``demo``: the local swarm behind ``swarm demo`` / ``make demo``.
- ``export``, ``monitor``, ``logging_sinks``: getting the model out, a live web page, TensorBoard/W&B.
- ``subspace``: subspace-constrained models and their exact stage-boundary coding.
- ``errors``: the exception hierarchy for user and peer input; ``version``: the software version.
- ``cli`` and ``commands/``: the ``swarm`` command line.

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
    "RunSpec": "swarm.spec",
    "ModelConfig": "swarm.spec",
    "build_stage": "swarm.model",
    "build_model": "swarm.model",
    "lm_loss": "swarm.model",
    "Membership": "swarm.membership",
    "PeerRecord": "swarm.records",
    "DHTConfig": "swarm.network",
    "start_dht": "swarm.network",
    "choose_stage": "swarm.placement",
    "should_move": "swarm.placement",
    "Trainer": "swarm.trainer",
    "TrainerConfig": "swarm.trainer",
    "load_model": "swarm.export",
    "make_boundary": "swarm.subspace",
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
