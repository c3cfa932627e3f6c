"""peer: everything one stage peer does.

Map of modules:
- ``protocol``: the data-plane messages (FORWARD, BACKWARD, INFO, REPORT) over hivemind P2P.
- ``stash``: weight versions and the per-micro-batch stash (weight stashing, TTL expiry).
- ``optimizer``: the local out-of-place optimizer (AdamW, delay-aware Nesterov), accumulation, clipping.
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
from peer.optimizer import StageOptimizer, lookahead_coefficient
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
    "StageOptimizer",
    "lookahead_coefficient",
    "ComputeQueue",
    "QueueStats",
    "MicroBatchStash",
    "StashEntry",
    "VersionEvicted",
    "WeightVersions",
]
