"""Same-stage synchronisation over hivemind: state download for joining peers, and gradient rounds.

(Over 400 lines on purpose: the hivemind averager subclass, its process-shared authorized set and its
log filter only make sense together with the ``StageAverager`` that drives them.)

Both use one ``hivemind.averaging.DecentralizedAverager`` per (run, stage), with the prefix
``<run_id>_<spec_hash>_stage<i>`` (averager prefixes must not contain '.'; run ids and hashes
cannot). The spec hash is in the prefix so that two specs published under one run id (a mistake,
but a possible one) never combine their gradients.

State download (``load_state``): hivemind's ``load_state_from_peers`` asks a donor that declared
itself in the DHT for its ``get_current_state()``. We override that to return the stage's
*base* parameters, optimizer slots and version (``StageCompute.export_state``), so a joining peer
continues exactly where the donor is. A peer declares itself as a donor only once it holds real
state (``allow_state_sharing`` starts False), and its priority is its version, so joiners prefer
the most advanced replica. State downloads travel as one flat tensor, unflattened with the
receiver's own shapes (which also checks their total size).

Note "state in shared memory": ``get_current_state`` runs in the peer's process, and hivemind pickles
what it returns through a pipe to its averager process, where torch moves any tensor not yet in shared
memory into shared memory (a copy of a stage's whole state: 77 MB for the benchmark model). So the
donor state is copied once, straight from the live tensors into one flat tensor allocated in shared
memory (``shared_empty``, ``flatten_into``; ``StageCompute.export_state(copy=...)``), and the pipe passes its handle; a
keeper's snapshot, moved into shared memory by its first download, is passed as it is. Each download
gets a fresh buffer: the averager process reads it after the host has returned, so one buffer reused
across downloads could change under a download still being sent. On the wire, both averager processes
use our own ``rpc_download_state`` and ``_load_state_from_peers`` in place of hivemind's: the same
messages, built and read with fewer copies, the receiver writing straight into shared memory (note
"state stream" in peer/state_stream.py; ``python -m benchmarks.state_download``).

Gradient rounds (``combine``; the protocol is in peer/replicas.py): the averager's buffer is ONE
flat float32 shared-memory tensor: the replica's gradient *sums* and, after them, its micro-batch
count, laid out with a sentinel every ``SENTINEL_EVERY`` elements (peer/round_buffer.py, note
"partial rounds": hivemind returns a round whose spans did not all arrive as a success, with this
replica's own values in the missing spans; the sentinels show it, ``RoundResult.missing``). Every
member takes part with weight 1, so the average is ``(mean of sums, mean of counts)`` and their
ratio is the stage's mean gradient over every micro-batch of the round, whatever each replica
contributed (0 included). The group size is set per round to the number of online replicas (min =
target, so a round never splits the stage into groups that step differently), and each member's
version, weight digest and sentinel travel in hivemind's ``gather``. A round blocks, so it runs in
the replica rounds' thread, never on the event loop.

Access (private runs, allow/deny lists; see swarm/dht/auth.py): hivemind's averaging RPCs carry no room
for our proofs, so the averager process keeps a set of *authorized peer ids* (digests in shared
memory, written by the peer process from the DHT records whose join proofs it verified). When the
set is active the averager refuses ``rpc_download_state``, ``rpc_join_group`` and
``rpc_aggregate_part`` from any other caller (the caller id is the one libp2p authenticated), and
never dials another peer for a download, a group or an all-reduce part. One set per process (the
averager class is per process too): several peers of one process serve the same run in tests.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import multiprocessing as mp
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, get_type_hints

import torch

from peer.round_buffer import RoundBuffer
from peer.state_stream import StateAssembler, flatten_into, shared_empty, state_parts

DECLARE_STATE_PERIOD_S = 60.0
"""How often a donor re-declares itself (hivemind's ``declare_state_period``; a declaration is a DHT store
under ``<prefix>.all_averagers`` that lives one period). hivemind's default is 30 s; 60 s halves these
stores of an idle peer (note "idle control plane", swarm/dht/network.py). A change of ``allow`` or of the
priority is declared at once whatever the period, so what it trades is only how long a dead donor's
declaration outlives it (up to 60 s instead of 30 s): a joiner that picks it fails at once (its
connection is refused) and tries the next donor (``DonorFailureFilter``), as before."""

__all__ = ["RoundResult", "StageAverager", "averager_prefix"]

logger = logging.getLogger(__name__)

StateFn = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class RoundResult(NamedTuple):
    """What a completed gradient round left in this replica's buffer."""

    sums: torch.Tensor  # the members' mean gradient sums, flat
    count: float  # the members' mean micro-batch count
    gathered: dict[str, Any]  # each member's peer id -> its ``gather``
    missing: float | None  # the buffer's share whose average did not arrive (note "partial rounds")


class RoundAborted(Exception):
    """A round given up while it waited, because a member is gone."""


def _await_round(control: Any, timeout_s: float, abort: Callable[[], str | None] | None) -> Any:
    """``control.result(timeout_s)``, asking ``abort`` every ``ABORT_POLL_S`` whether to give up."""
    if abort is None:
        return control.result(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return control.result(timeout=max(0.0, min(ABORT_POLL_S, left)))
        except concurrent.futures.TimeoutError:
            if left <= ABORT_POLL_S:
                raise
        why = abort()
        if why:
            raise RoundAborted(why)


def averager_prefix(run_id: str, spec_hash: str, stage: int) -> str:
    """``<run_id>_<spec_hash>_stage<i>``: peers of another spec under the same run id never mix."""
    prefix = f"{run_id}_{spec_hash}_stage{stage}"
    assert "." not in prefix  # run ids are [A-Za-z0-9_-] (RunSpec validates it), hashes are hex
    return prefix


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The one tensor a state download sends: ``tensors`` as they are when they already are one flat
    float32 tensor in shared memory, else copied into one (note "state in shared memory")."""
    if len(tensors) == 1:
        [t] = tensors
        if t.dim() == 1 and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_shared():
            return t.detach()
    return flatten_into(tensors, shared_empty)


def _unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    if len(shapes) == 1 and flat.shape == shapes[0]:
        return [flat]  # the downloaded tensor is ours alone: no copy
    sizes = [s.numel() for s in shapes]
    return [part.reshape(shape).clone() for part, shape in zip(flat.split(sizes), shapes, strict=True)]


ABORT_POLL_S = 0.25  # how often a waiting round asks whether to give up (``finish``)
ALLREDUCE_MARGIN_S = 10.0  # a round's wait after its group search: the all-reduce (next_chunk_timeout)
MAX_AUTHORIZED = 1024  # peer ids in the authorized set (a stage list of a run; more are not trusted)
_DIGEST = 16


def _digest(peer_id: str) -> bytes:
    return hashlib.sha256(peer_id.encode()).digest()[:_DIGEST]


class _AuthorizedSet:
    """Peer ids allowed to use the averager, in shared memory: written by the peer, read by its averager
    process (forked after this was made). Inactive (everyone allowed) until ``set`` is called."""

    def __init__(self) -> None:
        self._blob = mp.Array(ctypes.c_char, MAX_AUTHORIZED * _DIGEST)  # has its own lock
        self._count = mp.Value(ctypes.c_int, -1, lock=False)  # -1 = inactive; guarded by the blob's lock

    def set(self, peer_ids: list[str] | None) -> None:
        """Activate with exactly these peer ids (None deactivates)."""
        digests = (
            b"" if peer_ids is None else b"".join(sorted({_digest(p) for p in peer_ids})[:MAX_AUTHORIZED])
        )
        with self._blob.get_lock():
            self._blob.raw = digests.ljust(MAX_AUTHORIZED * _DIGEST, b"\0")
            self._count.value = -1 if peer_ids is None else len(digests) // _DIGEST

    def allows(self, peer_id: object) -> bool:
        with self._blob.get_lock():
            count = self._count.value
            if count < 0:
                return True
            raw = self._blob.raw[: count * _DIGEST]
        d = _digest(str(peer_id))
        return any(raw[i : i + _DIGEST] == d for i in range(0, len(raw), _DIGEST))


_DOWNLOAD_FAILED = re.compile(r"Failed to download state from (\S+) - ")
_AVERAGER_LOGGER = "hivemind.averaging.averager"


class DonorFailureFilter(logging.Filter):
    """Makes hivemind's report of a state download that failed because the donor is gone (a SIGKILLed
    peer whose donor declaration outlives it, a dropped connection, a stall) one WARNING line instead
    of an ERROR with a traceback: the next donor is tried, so it is not an error of this peer. Any other
    exception there (a bug, a malformed state) keeps its traceback. Installed on hivemind's averager
    logger (in the averager process, where downloads run) by :func:`quiet_donor_failures`."""

    def filter(self, record: logging.LogRecord) -> bool:
        match = _DOWNLOAD_FAILED.match(str(record.msg)) if record.exc_info else None
        if match is None or record.exc_info is None:
            return True
        error = record.exc_info[1]
        if not isinstance(error, _donor_gone_errors()):
            return True
        record.msg = "could not download state from donor %s: %s%s (a departed or unreachable peer; trying the next donor)"
        record.args = (match.group(1), type(error).__name__, f": {error}" if str(error) else "")
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return logging.getLogger(record.name).isEnabledFor(logging.WARNING)


@functools.lru_cache(maxsize=1)
def _donor_gone_errors() -> tuple[type[BaseException], ...]:
    """What a dead, departed or unreachable donor raises in hivemind's download loop."""
    errors: list[type[BaseException]] = [TimeoutError, ConnectionError, EOFError]
    try:
        from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
    except ImportError:  # pragma: no cover -- hivemind is a dependency; keep the filter usable without it
        pass
    else:
        errors += [P2PDaemonError, P2PHandlerError]
    return tuple(errors)


_PART_FAILED = re.compile(r"Caught (.*) when communicating (?:to|with) (\S+)$", re.DOTALL)
_ALLREDUCE_LOGGER = "hivemind.averaging.allreduce"


class AllreduceFailureFilter(logging.Filter):
    """hivemind logs why a member's part of an all-reduce failed at DEBUG only, and the round then
    arrives in part (note "partial rounds" in peer/round_buffer.py). With this filter on hivemind's
    all-reduce logger, enabled down to DEBUG by :func:`quiet_donor_failures`, those lines become one
    WARNING each (the exception, no traceback) and every other DEBUG or INFO line of that logger is
    dropped, so the peer's log says which member failed and how."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        match = _PART_FAILED.match(str(record.msg))
        if match is None:
            return False
        record.msg = "all-reduce: the exchange with %s failed: %s (that span keeps this replica's values)"
        record.args = (match.group(2), match.group(1))
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def quiet_donor_failures() -> None:
    """Install :class:`DonorFailureFilter` on hivemind's averager logger and :class:`AllreduceFailureFilter`
    on its all-reduce logger once (idempotent). The latter only where hivemind logs warnings at all
    (``HIVEMIND_LOGLEVEL`` WARNING or lower)."""
    target = logging.getLogger(_AVERAGER_LOGGER)
    if not any(isinstance(f, DonorFailureFilter) for f in target.filters):
        target.addFilter(DonorFailureFilter())
    allreduce = logging.getLogger(_ALLREDUCE_LOGGER)
    if allreduce.isEnabledFor(logging.WARNING) and not any(
        isinstance(f, AllreduceFailureFilter) for f in allreduce.filters
    ):
        allreduce.addFilter(AllreduceFailureFilter())
        allreduce.setLevel(logging.DEBUG)  # the filter passes only the failures among its DEBUG lines


@functools.lru_cache(maxsize=1)
def _make_averager_class() -> type:  # hivemind is imported lazily (seconds); one class per process
    quiet_donor_failures()

    class _StateAverager(_make_gated_class()):
        """A ``DecentralizedAverager`` whose downloadable state is the stage peer's full state."""

        state_fn: StateFn | None = None
        state_numel: int | None = (
            None  # of the state a download may bring: a donor announcing more is refused
        )

        def get_current_state(self):  # runs in the host process, in hivemind's fetcher thread
            if self.state_fn is None:
                raise RuntimeError("state requested before the peer holds any")
            meta, tensors = self.state_fn()
            return meta, [_flatten(tensors)], None

        def run(self) -> None:  # runs in the averager's own process: it must not outlive its peer
            from swarm.dht.processes import exit_with_parent

            exit_with_parent()
            quiet_donor_failures()  # inherited from the parent when forked; spawned children need it too
            super().run()

        async def _set_group_size(self, size: int) -> None:  # runs in the averager process (via its pipe)
            self._matchmaking.min_group_size = size
            self._matchmaking.target_group_size = size
            self._matchmaking.potential_leaders.target_group_size = size
            self._matchmaking.group_key_manager.target_group_size = size

        def set_group_size(self, size: int) -> None:  # host process: queued before the next step()
            self._outer_pipe.send(("_set_group_size", [], dict(size=size)))

        async def _shutdown(self, timeout):  # noqa: ANN001 -- runs in the averager process
            try:
                await super()._shutdown(timeout)
            finally:
                # the averager's replica of the DHT's P2P holds a handler socket file in /tmp that
                # hivemind never removes; shutting the replica down removes it (the daemon stays)
                p2p = getattr(self, "_p2p", None)
                if p2p is not None:
                    await p2p.shutdown()

    return _StateAverager


def _make_gated_class() -> type:
    """``DecentralizedAverager`` that talks to authorized peers only (see the module note): every
    outgoing call dials through ``get_stub``, every incoming one is checked by its handler."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
    from hivemind.proto import averaging_pb2

    class _GatedAverager(DecentralizedAverager):
        authorized = _AuthorizedSet()  # made before any averager process forks: shared with all

        @classmethod
        def get_stub(cls, p2p, peer, *, namespace=None):  # noqa: ANN001 -- hivemind's signature
            # every outgoing averaging call (state download, join a group, all-reduce parts) dials here
            if not cls.authorized.allows(peer):
                raise P2PDaemonError(f"peer {peer} has no valid join proof in this run; not dialling it")
            return super().get_stub(p2p, peer, namespace=namespace)

        async def rpc_download_state(self, _request, _context):  # noqa: ANN001 -- the parent's names
            if not self.authorized.allows(_context.remote_id):
                logger.warning("refused a state download by %s: not an authorized peer", _context.remote_id)
                return  # an empty stream: the caller moves on to the next donor
            if not self.allow_state_sharing:
                return  # as hivemind's: not a donor (any more)
            metadata, tensors, _infos = await self._get_current_state_from_host_process()
            # note "state stream" (peer/state_stream.py): hivemind's messages, fewer copies
            for tensor in tensors:
                for part in state_parts(tensor):
                    yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
                    metadata = None

        async def _load_state_from_peers(self, future, timeout=None):  # noqa: ANN001 -- hivemind's names
            # hivemind's own, but the parts go straight into one shared-memory tensor (note "state stream")
            from hivemind.p2p import PeerID
            from hivemind.utils import ValueWithExpiration
            from hivemind.utils.asyncio import aiter_with_timeout

            if timeout is not None:  # as hivemind's: the limit applies to each part
                timeout = (
                    self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
                )
            try:
                prefix = self._matchmaking.group_key_manager.prefix
                found, _ = self.dht.get(f"{prefix}.all_averagers", latest=True) or ({}, None)
                priority = {
                    PeerID(peer_id): (float(info.value), random.random())  # random: the tie breaker
                    for peer_id, info in (found.items() if isinstance(found, dict) else ())
                    if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
                }
                for peer in sorted(priority, key=priority.get, reverse=True):
                    if peer == self.peer_id:
                        continue
                    try:
                        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                        metadata, assembler = None, StateAssembler(max_numel=self.state_numel)
                        async for message in aiter_with_timeout(stream, timeout=timeout):
                            if message.metadata:
                                metadata = self.serializer.loads(message.metadata)
                            assembler.add(message.tensor_part)
                        tensors = assembler.finish()
                        if metadata:
                            future.set_result((metadata, tensors))
                            return
                        logger.debug("peer %s did not send its state", peer)
                    except Exception as e:  # noqa: BLE001 -- as hivemind's: try the next donor
                        logger.info("state download from %s failed: %r", peer, e)
            finally:
                if not future.done():
                    future.set_result(None)

        async def rpc_join_group(self, request, context):  # noqa: ANN001
            if not self.authorized.allows(context.remote_id):
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            async for item in super().rpc_join_group(request, context):
                yield item

        async def rpc_aggregate_part(self, stream, context):  # noqa: ANN001
            if not self.authorized.allows(context.remote_id):
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            async for item in super().rpc_aggregate_part(stream, context):
                yield item

    # hivemind finds handlers by their type hints; this module's annotations are strings (PEP 563)
    # naming imports local to this function, so give the overrides their parents' resolved hints.
    for name in ("rpc_download_state", "rpc_join_group", "rpc_aggregate_part"):
        getattr(_GatedAverager, name).__annotations__ = get_type_hints(getattr(DecentralizedAverager, name))
    return _GatedAverager


class StageAverager:
    """One averager of one stage: :meth:`create` (forks), then :meth:`wait_ready`."""

    def __init__(self, averager: Any, prefix: str, shapes: list[torch.Size], grad_numel: int):
        self._averager = averager
        self.shapes = shapes  # of the downloadable state
        self.grad_numel = grad_numel
        self.prefix = prefix
        self.layout = RoundBuffer(grad_numel + 1)  # the gradient sums, then the count
        self.rounds_ok = 0
        self.rounds_failed = 0
        self._lock = threading.Lock()  # one round at a time
        self._group_size = 0
        self._sentinel: tuple[int, float] | None = None  # (id of the scheduled control, its sentinel)

    @classmethod
    def create(
        cls,
        dht: Any,
        *,
        run_id: str,
        spec_hash: str,
        stage: int,
        shapes: list[torch.Tensor | torch.Size],
        grad_shapes: list[torch.Size],
        state_fn: StateFn,
        min_matchmaking_time_s: float = 2.0,
        request_timeout_s: float = 1.0,
    ) -> StageAverager:
        """Fork the averager process for ``stage`` (state downloads shaped like ``shapes``; gradient
        rounds over ``grad_shapes``, the stage's parameters, plus the count).

        Call from the event loop's thread and then :meth:`wait_ready` in a worker thread. Why not
        ``run_in_background``: it sets the *caller's* SIGINT handler to "ignore" for good (so the
        child ignores Ctrl-C) and only works in the main thread; here the handler is set only
        around the fork and restored afterwards, so Ctrl-C keeps working in the peer.
        """
        averager_cls = _make_averager_class()
        prefix = averager_prefix(run_id, spec_hash, stage)
        sizes = [t if isinstance(t, torch.Size) else t.shape for t in shapes]
        grad_numel = sum(s.numel() for s in grad_shapes)
        buffer = torch.zeros(RoundBuffer(grad_numel + 1).size, dtype=torch.float32)  # sums, count, sentinels
        averager = averager_cls(
            [buffer],
            dht,
            start=False,
            prefix=prefix,
            target_group_size=8,
            min_group_size=2,
            min_matchmaking_time=min_matchmaking_time_s,
            request_timeout=min(request_timeout_s, min_matchmaking_time_s / 2),
            allow_state_sharing=False,
            declare_state_period=DECLARE_STATE_PERIOD_S,
            next_chunk_timeout=10.0,
            shutdown_timeout=5.0,
        )
        averager.state_fn = state_fn
        averager.state_numel = sum(s.numel() for s in sizes)
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                averager.start()  # the forked child inherits "ignore SIGINT": the parent stops it
            finally:
                signal.signal(signal.SIGINT, previous)
        else:
            averager.start()
        return cls(averager, prefix, sizes, grad_numel)

    def set_authorized(self, peer_ids: list[str] | None) -> None:
        """Only these peer ids may download state or average with this process (None: everyone)."""
        self._averager.authorized.set(peer_ids)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the averager process serves (it joins the DHT's daemon); not on the loop."""
        self._averager.wait_until_ready(timeout_s)

    def share_state(self, allow: bool, priority: float = 0.0) -> None:
        """Declare (or stop declaring) this peer as a donor; higher ``priority`` is preferred."""
        self._averager.state_sharing_priority = float(priority)
        self._averager.allow_state_sharing = allow

    def load_state(self, timeout_s: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download ``(meta, tensors)`` from a donor of this stage, or None when there is none."""
        try:
            result = self._averager.load_state_from_peers(wait=True, timeout=timeout_s)
        except TimeoutError:  # a donor that stalls mid-download; the caller decides whether to retry
            logger.info("state download for %s timed out after %.0f s", self.prefix, timeout_s)
            return None
        if result is None:
            return None
        meta, tensors = result
        if not isinstance(meta, dict):
            logger.warning(
                "a donor of %s sent metadata of type %s; ignoring it", self.prefix, type(meta).__name__
            )
            return None
        total = sum(s.numel() for s in self.shapes)
        if len(tensors) != 1 or tensors[0].dim() != 1 or tensors[0].numel() != total:
            got = [tuple(t.shape) for t in tensors]
            logger.warning(
                "a donor of %s sent tensors %s, expected one flat tensor of %d", self.prefix, got, total
            )
            return None
        return meta, _unflatten(tensors[0], self.shapes)

    def others_waiting(self) -> bool:
        """Whether another replica of the stage is looking for a round group right now (its hivemind
        matchmaking declaration under the group key ``<prefix>.0b``; one DHT get)."""
        from hivemind.utils import get_dht_time

        found = self._averager.dht.get(f"{self.prefix}.0b", latest=True)
        if found is None or not isinstance(found.value, dict):
            return False
        me, now = self._averager.dht.peer_id.to_bytes(), get_dht_time()
        return any(
            key != me and item.value is True and item.expiration_time > now
            for key, item in found.value.items()
        )

    def schedule(self, *, group_size: int, gather: dict[str, Any], timeout_s: float) -> Any:
        """Start looking for the next round's group now, before this replica's gradients are ready
        (note "pre-scheduled rounds" in peer/replicas.py): hivemind's matchmaking runs in the averager
        process while the share accumulates, and the all-reduce waits for :meth:`finish`. Returns the
        hivemind ``StepControl``; ``timeout_s`` bounds the search for a group."""
        with self._lock:
            if group_size != self._group_size:
                self._averager.set_group_size(group_size)
                self._group_size = group_size
            sentinel = self.layout.draw_sentinel()  # note "partial rounds"
            # no retries: a retry after a partial all-reduce would start from a half-averaged buffer
            control = self._averager.step(
                weight=1.0,
                gather={**gather, "sentinel": sentinel},
                timeout=timeout_s,
                allow_retries=False,
                require_trigger=True,
                wait=False,
            )
            self._sentinel = (id(control), sentinel)
            return control

    @staticmethod
    def group_formed(control: Any) -> bool:
        """The scheduled round's group is complete and waits for this replica's gradients."""
        from hivemind.averaging.control import AveragingStage

        return not control.done() and control.stage == AveragingStage.AWAITING_TRIGGER

    @staticmethod
    def cancel(control: Any) -> None:
        """Give up a scheduled round (its partners' all-reduce fails and they retry)."""
        if not control.done():
            control.cancel()

    def finish(
        self,
        control: Any,
        sums: list[torch.Tensor],
        count: int,
        *,
        timeout_s: float,
        abort: Callable[[], str | None] | None = None,
    ) -> RoundResult | None:
        """Run the scheduled round with these gradient sums and micro-batch count: the same result as
        :meth:`combine`. ``timeout_s`` bounds the wait from here (group search and all-reduce);
        ``abort``, polled every ``ABORT_POLL_S`` while it waits, gives the round up when it returns a
        reason (a member is gone: note "lost member" in peer/recount.py)."""
        with self._lock:
            payload = torch.cat(  # the gradient sums, then the count
                [t.detach().reshape(-1).to("cpu", torch.float32) for t in sums]
                + [torch.tensor([float(count)])]
            )
            if payload.numel() - 1 != self.grad_numel:
                raise ValueError(
                    f"gradient of {payload.numel() - 1} values; the round buffer holds {self.grad_numel}"
                )
            if self._sentinel is None or self._sentinel[0] != id(control):
                raise ValueError("finish() of a round that schedule() did not start last")
            sentinel = self._sentinel[1]
            with self._averager.get_tensors() as buffers:
                self.layout.pack(buffers[0], payload, sentinel)
            try:
                if control.done():  # its search ended without a group; the caller schedules afresh
                    control.result()
                control.allow_allreduce()
                gathered = _await_round(control, timeout_s, abort)
            except Exception as e:  # noqa: BLE001 -- routine, see combine
                self.cancel(control)
                self.rounds_failed += 1
                logger.info("gradient round of %s did not complete: %s", self.prefix, e)
                return None
            if gathered is None:
                self.rounds_failed += 1
                return None
            with self._averager.get_tensors() as buffers:
                out, sentinels = self.layout.unpack(buffers[0])
            self.rounds_ok += 1
            members = {str(pid): data for pid, data in gathered.items()}
            values = [m.get("sentinel") if isinstance(m, dict) else None for m in members.values()]
            missing = (
                self.layout.missing(sentinels, [float(v) for v in values], sentinel)
                if all(isinstance(v, (int, float)) for v in values)
                else None  # a member that sent none: nothing to compare with
            )
            return RoundResult(out[:-1], float(out[-1]), members, missing)

    def combine(
        self,
        sums: list[torch.Tensor],
        count: int,
        *,
        group_size: int,
        gather: dict[str, Any],
        timeout_s: float,
    ) -> RoundResult | None:
        """One blocking gradient round of ``group_size`` replicas: the mean of the sums (flat), the mean
        count, each member's ``gather`` by peer id and the share that did not arrive
        (:class:`RoundResult`); None when no full group formed in time or the round failed (routine: the
        caller keeps its gradients). The same as :meth:`schedule` then :meth:`finish` at once."""
        try:
            control = self.schedule(group_size=group_size, gather=gather, timeout_s=timeout_s)
        # hivemind surfaces a failed round as one of several types (AllreduceException,
        # MatchmakingException, TimeoutError, P2P errors); a failed round is routine, never fatal.
        except Exception as e:  # noqa: BLE001
            self.rounds_failed += 1
            logger.info("gradient round of %s could not start: %s", self.prefix, e)
            return None
        return self.finish(control, sums, count, timeout_s=timeout_s + ALLREDUCE_MARGIN_S)

    def shutdown(self) -> None:
        try:
            self._averager.shutdown()
        except (OSError, ValueError, BrokenPipeError) as e:
            logger.debug("averager %s shutdown: %s", self.prefix, e)
