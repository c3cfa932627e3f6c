"""peer: everything one stage peer does.

It builds on ``swarm.run`` (spec, model, optimizer), ``swarm.wire`` (the protocol) and ``swarm.dht``
(records, membership, access) only, never on the trainer or the tools (docs/ARCHITECTURE.md).

Map of modules:
- ``stash``: weight versions and the per-micro-batch stash (weight stashing, TTL expiry).
- ``compute``: the stage's forward/backward with stashed versions and local steps (no network).
- ``stage_math``: ``StageModule``, the stage's module run functionally on one weight version, and its boundary.
- ``runtime``: the bounded compute queue and its single worker thread.
- ``checkpoint``: atomic save/load of a stage's state.
- ``throughput``: the short, cached self-benchmark a peer announces.
- ``averaging``: same-stage state download and parameter averaging (hivemind DecentralizedAverager).
- ``config``: ``PeerConfig``, the typed options of a peer.
- ``policy``: ``SyncPolicy``/``AsyncPolicy``, what differs between ``optimizer.mode`` sync and async.
- ``server``: ``StagePeer``, put together from the parts below, and its lifecycle (start, move, shutdown).
- ``joining``: which stage a peer serves and where its state comes from (donor, keeper, checkpoint, seed).
- ``loops``: the background loops (announce + rebalance, expiry, authorized set, checkpoints, replica rounds).
- ``tasks``: ``TaskOwner``, which starts every background loop and restarts it or stops the peer on a crash.
- ``handlers``: the FORWARD/BACKWARD/INFO/CANCEL handlers (where a FORWARD is validated).
- ``admission``: the access gate and the queue caps (per sender, global).
- ``work``: the forward/backward tasks of the compute worker thread.
- ``sends``: ``Outbox``, sends to the next hop and reports to trainers; micro-batches held here.
- ``trainers``: ``TrainerWatch``, trainers that cancelled or vanished (their micro-batches are dropped).
- ``runner``: ``run_peer``, the blocking entry point behind ``swarm peer``.
- ``allocator``: ``keep_freed_memory``, glibc's thresholds set once per peer process (note "allocator").
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
