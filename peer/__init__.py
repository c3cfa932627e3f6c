"""peer: everything one stage peer does.

Map of modules:
- ``protocol``: the data-plane messages (FORWARD, BACKWARD, INFO, REPORT) over hivemind P2P.
- ``stash``: weight versions and the per-micro-batch stash (weight stashing, TTL expiry).
- ``optimizer``: the local out-of-place optimizer (AdamW, delay-aware Nesterov), accumulation, clipping.
- ``compute``: the stage's forward/backward with stashed versions and local steps (no network).
- ``runtime``: the bounded compute queue and its single worker thread.
- ``checkpoint``: atomic save/load of a stage's state.
"""

from peer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from peer.compute import BackwardResult, ForwardResult, StageCompute
from peer.optimizer import StageOptimizer, lookahead_coefficient
from peer.runtime import ComputeQueue, QueueStats
from peer.stash import MicroBatchStash, StashEntry, VersionEvicted, WeightVersions

__all__ = [
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
