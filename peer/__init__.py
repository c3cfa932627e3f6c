"""peer: everything one stage peer does.

It builds on ``swarm.run`` (spec, model, optimizer), ``swarm.wire`` (the protocol) and ``swarm.dht``
(records, membership, access) only, never on the trainer or the tools (docs/ARCHITECTURE.md).

Map of modules:
- ``stash``: weight versions and the per-micro-batch stash (weight stashing, TTL expiry).
- ``compute``: the stage's forward/backward with stashed versions and local steps (no network).
- ``runtime``: the bounded compute queue and its single worker thread.
- ``checkpoint``: atomic save/load of a stage's state.
- ``throughput``: the short, cached self-benchmark a peer announces.
- ``averaging``: same-stage state download and parameter averaging (hivemind DecentralizedAverager).
- ``config``: ``PeerConfig``, the typed options of a peer.
- ``server``: ``StagePeer``, the lifecycle and data-plane handlers.
- ``runner``: ``run_peer``, the blocking entry point behind ``swarm peer``.
"""

from peer.averaging import StageAverager, averager_prefix
from peer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from peer.compute import BackwardResult, ForwardResult, StageCompute
from peer.config import PeerConfig, resolve_device
from peer.runner import run_peer, serve_until_stopped
from peer.runtime import ComputeQueue, QueueStats
from peer.server import StagePeer
from peer.stash import MicroBatchStash, StashEntry, VersionEvicted, WeightVersions
from peer.throughput import measure_throughput

__all__ = [
    "PeerConfig",
    "StagePeer",
    "run_peer",
    "serve_until_stopped",
    "resolve_device",
    "measure_throughput",
    "StageAverager",
    "averager_prefix",
    "Checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "StageCompute",
    "ForwardResult",
    "BackwardResult",
    "ComputeQueue",
    "QueueStats",
    "MicroBatchStash",
    "StashEntry",
    "VersionEvicted",
    "WeightVersions",
]
