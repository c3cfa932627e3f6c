"""The compute core of a stage peer: forward, backward, weight versions, stash and local steps. No network.

(Over 400 lines on purpose: versions, stash, optimizer and replica shares change together under one
lock, and their invariants are easier to check in one class than spread over files.)

:class:`StageCompute` is what the worker thread of ``peer/runtime.py`` calls. It runs the stage
module *functionally* (``torch.func.functional_call``, in ``peer/stage_math.py``) with the tensors of
one weight version, so different micro-batches can use different versions without copying weights
into the module:

- ``forward(mb_id, x, mode)`` runs with the latest version ``v`` and, in ``train`` mode, stashes
  ``(v, input)`` (``recompute=True``) or ``(v, graph)`` (``recompute=False``). On the last stage a
  ``train`` forward computes the loss and its backward at once.
- ``backward(mb_id, grad_output)`` takes the stashed version ``v`` (raising ``VersionEvicted`` when
  it is gone), recomputes the forward with it if needed, returns the gradient w.r.t. the stage input
  and accumulates parameter gradients into the optimizer. After ``accumulate`` backwards the
  optimizer steps, producing version ``v+1`` (new tensors; older versions stay intact).

Sync mode (``optimizer.mode == "sync"``): at most ``accumulate`` training forwards per step window;
:meth:`forward_allowed` closes the gate after that, and the step happens only when the window's
backwards have all arrived (or were dropped). So every gradient of a step is computed on the same
version, exactly like a synchronous pipeline. What differs between the modes is decided by
:attr:`StageCompute.policy` (``peer/policy.py``).

Stage boundaries: what a stage sends on and receives back goes through ``swarm.run.subspace``'s
``Boundary`` on the compute device: in a subspace-constrained run the ``k`` coefficients
``U^T (h - E_fix[tokens])`` forward and ``U^T g`` backward (``width = k``), otherwise the hidden
state itself (``width = d_model``). So ``forward`` takes ``(B, T, width)`` plus the token ids and
``backward`` takes and returns ``(B, T, width)`` tensors.

Note "applied staleness": what the look-ahead needs (swarm/run/optimizer.py, note "extrapolated weights")
is how many versions after its forward a micro-batch's gradient is *applied*. A lone peer steps as soon
as a step's gradients are in, so that is the staleness at its backward. A replica's share waits for
its round, and async replicas keep serving meanwhile, so a share accumulated during a round is
applied one round later: every share carries the sum of its micro-batches' forward versions, and
the round that applies it tells the optimizer the mean (``note_staleness``).

Note "speculative rounds": a replica's round waits for its partners' shares and then runs the all-reduce,
and forwards it serves meanwhile would run on the version the round is about to replace, so their
gradients were a version stale before they began (0.25-0.6 versions of applied staleness in a 2 x 2
async run, against 0-0.23 with one peer per stage). When its round starts, an async replica
*previews* the step it expects: its optimizer's twin steps with the replica's own share (the mean of
its micro-batches, which is what the combined gradient averages with the partners'), and training
forwards during the round run on those weights, stashed with their entry (``StashEntry.params``,
``ahead = 1``). The previewed weights are only ever read by this replica's own forwards and
backwards; the round's combined step is what every replica applies, so replicas still hold the same
state. The forward gate stays closed while the preview is computed (a few tens of ms), so the forwards
that queued while the share waited for its round run on the preview too, not on the version the round
replaces (with 4 replicas a share is one micro-batch, and the next one is usually queued by then).
A gradient taken on speculative weights counts as one version ahead of the round's version,
so when the round applies it in the next step its applied staleness is 0. Measured (BENCHMARKS.md
"Convergence", 2 x 2 async, 3 seeds, same load): applied staleness 0.58-0.64 / 0.29-0.33 (stage 0 /
stage 1) -> 0.42-0.43 / 0.02-0.06, held-out ratio 1.069 -> 1.036.

The preview's Muon steps take ``PREVIEW_NS_STEPS`` = 3 Newton-Schulz iterations instead of 5: a preview
is an estimate of the combined step either way, and on this machine a Muon step of the demo's stage is
~40 ms, half of a round's CPU. ``python -m benchmarks.preview_error`` measures how far a preview's
matrices land from the combined step's, relative to the step (BENCHMARKS.md "Demo throughput"): with 2
replicas 0.73 at 5 iterations, 0.79 at 3 (1.0 is no preview); with 4, where a share is one micro-batch,
0.92 at 5 and 0.89 at 3. Three keep most of what the preview is worth for 60% of its matrix products.

Thread-safety: the worker thread calls forward/backward; other threads (averaging, state download,
checkpoints, replica rounds) call :meth:`export_state`, :meth:`take_round`, :meth:`end_round`,
:meth:`adopt_state`. Every access to versions, stash and
optimizer state happens under :attr:`lock`; the matmuls themselves run outside it on immutable
version tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peer.policy import StepPolicy, policy_for
from peer.stage_math import ForwardResult, Mode, Params, StageModule
from peer.stash import MicroBatchStash, StashEntry, WeightVersions
from swarm.errors import RequestError
from swarm.run.optimizer import StageOptimizer
from swarm.run.spec import RunSpec

__all__ = ["StageCompute", "ForwardResult", "BackwardResult"]

# note "quiet": a replica decides that its traffic stopped (and joins a partner's round with less than
# its share) after QUIET_FACTOR x the longest of the last GAPS_KEPT gaps between its gradients. A
# fixed second tripped on a loaded machine, where gaps of over a second are normal, and cut stage
# steps short (2 x 2 runs exported 160-214 stage steps for 150).
QUIET_FACTOR = 1.5
GAPS_KEPT = 32
# Newton-Schulz iterations of a speculative preview's Muon steps (note "speculative rounds")
PREVIEW_NS_STEPS = 3

logger = logging.getLogger(__name__)


@dataclass
class BackwardResult:
    """``grad_input`` ``(B, T, width)`` float32 on CPU (what goes back across the boundary), or None on
    stage 0 (token ids have no gradient)."""

    version: int  # the stashed version the gradient was computed with
    compute_s: float
    grad_input: torch.Tensor | None
    stepped: bool
    staleness: int  # versions elapsed between this micro-batch's forward and its backward
    entry: StashEntry


@dataclass
class _Share:
    """A replica's gradient sums of ``count`` micro-batches, waiting for (or in) a round."""

    sums: list[torch.Tensor]
    count: int
    forward_versions: int  # the sum of the versions its micro-batches' forwards ran on


class StageCompute:
    """Weights, stash and optimizer of one stage on one device."""

    def __init__(
        self,
        spec: RunSpec,
        stage: int,
        *,
        device: torch.device | str = "cpu",
        clock: Callable[[], float] = time.monotonic,
        initial: dict[str, torch.Tensor] | None = None,
        emulate_s: tuple[float, float] | None = None,
    ):
        self.spec = spec
        self.stage = stage
        # initial: the stage's weights at version 0 (a checkpoint's), instead of the seed's draws
        self.net = StageModule(spec, stage, device=device, initial=initial)
        self.device = self.net.device
        self.is_first, self.is_last = self.net.is_first, self.net.is_last
        self.optimizer = StageOptimizer(self.net.parameters(), spec.optimizer)
        self.net.free_weights()  # the optimizer holds the weights from here on
        self.width = self.net.width  # of what crosses the stage boundary: d_model, or k in a subspace run
        self.versions = WeightVersions(spec.optimizer.max_versions)
        self.version = 0
        self.versions.reset(0, self.optimizer.served())
        self.stash = MicroBatchStash(spec.stash_ttl_s, clock=clock)
        self.lock = threading.RLock()
        self.policy: StepPolicy = policy_for(spec.optimizer.mode, spec.optimizer.accumulate)
        self.steps_taken = 0
        self.on_gate_change: Callable[[], None] = lambda: None  # the queue's notify()
        # Replicas (note "replica rounds" in peer/replicas.py): with more than one online replica the
        # stage steps collectively, with the gradient combined over every replica; a lone replica
        # steps locally on its own `accumulate` micro-batches, exactly as without replicas.
        self.replicas = 1  # online replicas of this stage, this one included (set by the peer)
        self.on_round_due: Callable[[], None] = lambda: None  # wakes the replica rounds' thread
        self.last_gradient_at = clock()
        self._gaps: deque[float] = deque(maxlen=GAPS_KEPT)  # seconds between recent gradients (note "quiet")
        self._round_active = False  # a round combines a share (sync mode: forwards wait meanwhile)
        # shares complete while a round ran wait here, oldest first: every round takes exactly one
        # share of each replica, so a slow round never merges several steps' micro-batches into one
        self._ready: deque[_Share] = deque()
        self._pending_forwards = 0  # sum of the forward versions of the optimizer's pending micro-batches
        self._active: _Share | None = None  # the share of the round that runs
        self._digest_cache: tuple[int, list[float]] | None = None
        # note "speculative rounds": on by default for async replicas; peer/replicas.py may turn it off
        self.speculate = self.policy.speculates
        self._speculative: Params | None = None  # weights training forwards use while a round runs
        self._previewing = False  # the preview is being computed: forwards wait for it (gate closed)
        # note "emulated compute": (forward, backward) seconds a micro-batch occupies this stage at least
        self.emulate_s = emulate_s

    def _emulate(self, t0: float, kind: int) -> None:
        """Note "emulated compute" (a benchmark knob, ``PeerConfig.emulate_compute_s``): sleep until the
        micro-batch has occupied this stage for the emulated forward (``kind`` 0), backward (1) or both
        (2, the last stage's loss and backward at once) seconds since ``t0``. Sleeping leaves the CPU
        free, as a GPU kernel would, so pipeline bubbles show even when the stages share cores."""
        if self.emulate_s is None:
            return
        busy = sum(self.emulate_s) if kind == 2 else self.emulate_s[kind]
        left = busy - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)

    def forward_allowed(self) -> bool:
        """The runtime's forward gate: False in sync mode once this step's forwards have all started,
        and in either mode while a replica's complete share already waits for the next round
        (backpressure: the trainer cannot run ahead of the stage's steps and pile up stale gradients)."""
        # No lock on purpose: the queue calls this while holding its own lock, and compute code
        # notifies the queue while holding ours; reading a few ints needs no lock (lock order stays
        # one-way: compute lock -> queue lock).
        if self._ready or self._previewing:
            return False
        return self.policy.forward_allowed(round_active=self._round_active, replicas=self.replicas)

    def quota(self) -> int:
        """Micro-batches this replica contributes to one stage step: the stage's ``accumulate``
        shared among its online replicas (all of it for a lone peer). A stage step then combines
        ``replicas x quota`` micro-batches: exactly ``accumulate`` when the replicas divide it."""
        return max(1, round(self.spec.optimizer.accumulate / max(1, self.replicas)))

    def params(self) -> Params:
        """The latest served weights (read-only tensors)."""
        with self.lock:
            return self.versions.latest

    # ---- forward -------------------------------------------------------------------------------

    def forward(
        self,
        mb_id: str,
        x: torch.Tensor,
        mode: Mode,
        *,
        targets: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        context: Any = None,
        count: bool = True,
    ) -> ForwardResult:
        """Run the stage on ``x``: token ids ``(B, T)`` on stage 0, elsewhere what crossed the boundary
        ``(B, T, width)`` (the hidden state, or subspace coefficients rebuilt with ``tokens``).

        ``count=False`` (a retry whose gradient this stage already added): the backward runs as usual
        and sends its input gradient on, but adds nothing to the optimizer."""
        train = mode == "train"
        if self.is_last and mode != "generate" and targets is None:
            raise RequestError(f"stage {self.stage} is the last stage: mode {mode!r} needs targets")
        with self.lock:
            if train and mb_id in self.stash:
                raise RequestError(
                    f"micro-batch {mb_id!r} is already in flight on this peer; use a new mb_id"
                )
            version, params = self.version, self.versions.latest
            ahead = 0
            if train and self._speculative is not None:  # note "speculative rounds"
                params, ahead = self._speculative, 1
            if train:
                self.policy.forward_started()
        t0 = time.perf_counter()
        try:
            x = self.net.to_device(x)
            if not self.is_first:
                x = self.net.decode_input(x, tokens)  # (B, T, width) -> (B, T, C)
            if self.is_last and train:
                return self._last_stage_train(mb_id, x, targets, version, params, t0, count, ahead)
            out, graph = self.net.forward_graph(params, x, train)
            result = self.net.forward_result(out, version, mode, targets, tokens)
            if train:
                entry = self.stash.new_entry(
                    mb_id,
                    version,
                    x,
                    output_shape=tuple(result.output.shape),
                    graph=graph,
                    context=context,
                    count=count,
                    params=params if ahead else None,
                )
                with self.lock:
                    self.stash.put(entry)
        except BaseException:
            if train:
                self._release_window_slot()
            raise
        self._emulate(t0, 0)
        result.compute_s = time.perf_counter() - t0
        return result

    def _last_stage_train(
        self,
        mb_id: str,
        x: torch.Tensor,
        targets: torch.Tensor | None,
        version: int,
        params: Params,
        t0: float,
        count: bool = True,
        ahead: int = 0,
    ) -> ForwardResult:
        """Loss and its backward at once: the last stage needs no stash."""
        assert targets is not None
        loss, param_grads, grad_input = self.net.loss_grads(params, x, targets)
        with self.lock:
            stepped = False
            if count:
                self._accumulate(param_grads, version + ahead)
                stepped = self._maybe_step()
            else:
                self._release_window_slot()
        self._emulate(t0, 2)
        return ForwardResult(
            version=version,
            compute_s=time.perf_counter() - t0,
            loss=loss,
            n_tokens=int(targets.numel()),
            grad_input=grad_input,
            stepped=stepped,
        )

    # ---- backward ------------------------------------------------------------------------------

    def peek(self, mb_id: str) -> StashEntry:
        """The stash entry of ``mb_id`` (refusing unknown ids), without removing it."""
        with self.lock:
            entry = self.stash.get(mb_id)
        if entry is None:
            raise RequestError(
                f"micro-batch {mb_id!r} has no stashed forward on this peer (never seen, already done, "
                f"dropped, or expired after {self.spec.stash_ttl_s:.0f} s); the trainer must resend it"
            )
        return entry

    def backward(self, mb_id: str, grad_output: torch.Tensor) -> BackwardResult:
        """Gradient of the stage input for ``grad_output`` (``(B, T, width)``: the gradient of our output
        as it crossed the boundary).

        Uses the version the forward used; raises ``VersionEvicted`` (a ``RequestError``) if it is
        gone, and ``RequestError`` if the micro-batch is unknown. Either way the entry is dropped.
        """
        with self.lock:
            entry = self.stash.pop(mb_id)
            if entry is None:
                self.peek(mb_id)  # raises the explanation
            try:
                params = entry.params if entry.params is not None else self.versions.get(entry.version)
            except RequestError:
                self.stash.dropped += 1
                self._release_window_slot()
                raise
        t0 = time.perf_counter()
        try:
            grad_input, param_grads = self.net.backward(entry, params, grad_output)
        except BaseException:
            with self.lock:  # the entry is gone: count it and free its sync-window slot
                self.stash.dropped += 1
            self._release_window_slot()
            raise
        with self.lock:
            staleness = self.version - entry.version
            stepped = False
            if entry.count:
                self._accumulate(param_grads, entry.version + entry.ahead)
                stepped = self._maybe_step()
            else:
                self._release_window_slot()
        self._emulate(t0, 1)
        return BackwardResult(
            version=entry.version,
            compute_s=time.perf_counter() - t0,
            grad_input=grad_input,
            stepped=stepped,
            staleness=staleness,
            entry=entry,
        )

    # ---- steps, drops, expiry ------------------------------------------------------------------

    def _accumulate(self, param_grads: dict[str, torch.Tensor | None], forward_version: int) -> None:
        """Add one micro-batch's gradient, computed on ``forward_version`` (under the lock). A lone
        peer steps as soon as its step is complete, so its staleness is known now; a replica's is
        known when its round applies the share (note "applied staleness")."""
        self.optimizer.accumulate(
            param_grads, staleness=self.version - forward_version if self.replicas <= 1 else None
        )
        self._pending_forwards += forward_version

    def _take_share(self) -> _Share:
        sums, count = self.optimizer.take_gradients()
        share = _Share(sums, count, self._pending_forwards)
        self._pending_forwards = 0
        return share

    def _maybe_step(self) -> bool:
        """Step when ``accumulate`` micro-batches are in (sync: and none of this window is in flight).

        A replicated stage never steps here: it wakes the replica rounds instead (peer/replicas.py)."""
        now = self.stash.clock()
        self._gaps.append(now - self.last_gradient_at)
        self.last_gradient_at = now
        if self.replicas > 1:
            if self.policy.share_complete(self.optimizer.pending, self.quota()):
                self._ready.append(self._take_share())
                self.on_round_due()
            elif self.optimizer.pending == 1:
                self.on_round_due()  # a share began: the rounds thread schedules its round now
            return False
        if not self.optimizer.ready:
            return False
        if not self.policy.may_step(len(self.stash)):
            return False
        served = self.optimizer.step()
        self._pending_forwards = 0
        self._push_version(served)
        self.steps_taken += 1
        if self.policy.reset_window():
            self.on_gate_change()
        return True

    def _push_version(self, served: Params) -> None:
        self.version += 1
        self.versions.push(self.version, served)

    def _release_window_slot(self) -> None:
        """A training forward of this window will never complete: let another one in (sync mode)."""
        with self.lock:
            if self.policy.release_slot():
                self._maybe_step()
        self.on_gate_change()

    def drop(self, mb_id: str) -> StashEntry | None:
        """Forget a micro-batch whose route failed."""
        with self.lock:
            entry = self.stash.drop(mb_id)
        if entry is not None:
            self._release_window_slot()
        return entry

    def expire(self) -> list[StashEntry]:
        """Drop stash entries whose backward never came within ``stash_ttl_s``."""
        with self.lock:
            gone = self.stash.expire()
        for _ in gone:
            self._release_window_slot()
        return gone

    def flush_step(self) -> bool:
        """Step now, alone, with every gradient not yet used (e.g. before leaving a stage, or a replica
        whose rounds keep failing)."""
        with self.lock:
            self._merge_ready()
            if self.optimizer.pending == 0:
                return False
            served = self.optimizer.step(weight=self._step_weight(self.optimizer.pending))
            self._pending_forwards = 0
            self._push_version(served)
            self.steps_taken += 1
            self.policy.reset_window()
        self.on_gate_change()
        return True

    def _step_weight(self, count: int) -> float:
        """The learning-rate fraction of a step on ``count`` micro-batches (note "token-weighted steps"
        in swarm/run/optimizer.py)."""
        if count <= 0:  # an empty round: nothing is applied anyway
            return 1.0
        return min(1.0, count / self.spec.optimizer.accumulate)

    # ---- state transfer, averaging, checkpoints ------------------------------------------------

    def export_state(
        self, copy: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """``(metadata, tensors)`` of base parameters and optimizer state, copied to CPU while the lock is
        held: each on its own, or by ``copy`` (e.g. all into one flat tensor in shared memory,
        peer/averaging.py note "state in shared memory"), which must not keep the live tensors."""
        with self.lock:
            state = self.optimizer.state_tensors()
            tensors = [t.detach().to("cpu", copy=True) for t in state] if copy is None else copy(state)
            meta = {
                "spec_hash": self.spec.spec_hash,
                "stage": self.stage,
                "version": self.version,
                "names": self.optimizer.state_names(),
                **self.optimizer.metadata(),
            }
        return meta, tensors

    def import_state(self, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Adopt a downloaded or checkpointed state; refuses another spec or stage (``RequestError``)."""
        version = self._check_state_meta(meta)
        with self.lock:
            try:
                self.optimizer.load(tensors, meta)
            except ValueError as e:
                raise RequestError(f"state refused: {e}") from None
            self.version = version
            self.versions.reset(version, self.optimizer.served())
            self._speculative = None
            self.stash = MicroBatchStash(self.spec.stash_ttl_s, clock=self.stash.clock)
            self._ready.clear()
            self._pending_forwards = 0
            self.policy.reset_window()
        self.on_gate_change()

    def _check_state_meta(self, meta: dict[str, Any]) -> int:
        """The version of a state for this spec and stage, or ``RequestError`` naming what differs."""
        if meta.get("spec_hash") != self.spec.spec_hash:
            raise RequestError(
                f"state is for run spec {meta.get('spec_hash')!r}, this peer serves {self.spec.spec_hash}"
            )
        if meta.get("stage") != self.stage:
            raise RequestError(
                f"state is for stage {meta.get('stage')!r}, this peer serves stage {self.stage}"
            )
        if list(meta.get("names", [])) != self.optimizer.state_names():
            raise RequestError("state tensors are named differently from this stage's; refusing it")
        version = meta.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise RequestError(f"state version {version!r} must be a non-negative integer")
        return version

    # ---- replica rounds (peer/replicas.py) ---------------------------------------------------

    def quiet_after(self, floor_s: float, cap_s: float, *, unseen_s: float | None = None) -> float:
        """Seconds without a gradient after which this replica's traffic counts as stopped (note
        "quiet"): 1.5 x the longest of the recent gaps between gradients, within ``[floor_s, cap_s]``;
        before any gap was seen, ``unseen_s`` (default ``floor_s``)."""
        with self.lock:
            if not self._gaps and unseen_s is not None:
                return unseen_s
            longest = max(self._gaps, default=0.0)
        return min(cap_s, max(floor_s, QUIET_FACTOR * longest))

    def round_due(self, settle_s: float = 1.0) -> bool:
        """A complete share of this replica waits for a round. In sync mode a share closes when the next
        window begins (:meth:`note_window`), or, after the last window, once nothing is in flight here
        and no gradient came for ``settle_s`` (see :meth:`quiet_after`)."""
        with self.lock:
            if self._round_active:
                return False
            if (
                self.policy.settles_share()
                and not self._ready
                and self.optimizer.pending
                and not len(self.stash)
            ):
                if self.stash.clock() - self.last_gradient_at >= settle_s:
                    self._ready.append(self._take_share())
            return bool(self._ready)

    def note_window(self, trainer: str, window: int) -> None:
        """Sync mode: a training forward of ``trainer``'s window ``window`` arrived. The trainer opens a
        window only once the previous one completed at every stage, so a newer window closes this
        replica's share of the previous one (the forward then waits for the round: forward_allowed)."""
        with self.lock:
            if not self.policy.new_window(trainer, window):
                return
            if self.replicas > 1 and self.optimizer.pending and not self._round_active:
                self._ready.append(self._take_share())
                self.on_round_due()

    def can_fill_in(self, idle_s: float) -> bool:
        """This replica may join a round another replica waits for with less than its share: nothing
        is in flight here and no gradient came for ``idle_s``, i.e. the trainers send their
        micro-batches elsewhere and the stage's step must not wait for us. (Not at once when nothing
        is pending: right after a round that is normal, and the next share is on its way.)"""
        with self.lock:
            if self._round_active or self._ready or len(self.stash) > 0:
                return False
            # Not at once in sync mode either: another replica's round is scheduled when its share
            # *begins*, so its declaration does not mean the window is over here (a last stage's
            # stash is empty between any two micro-batches).
            return self.stash.clock() - self.last_gradient_at >= idle_s

    def uncombined(self) -> int:
        """Micro-batches whose gradients no step has used yet (accumulating or waiting for a round)."""
        with self.lock:
            return self.optimizer.pending + sum(share.count for share in self._ready)

    def set_replicas(self, n: int) -> bool:
        """The stage's live replica count changed. Alone again, the stage steps locally: at once with
        the shares that waited for a round (they are complete steps' worth of gradient). Returns
        whether it stepped."""
        accumulate = self.spec.optimizer.accumulate
        if n > 1 and accumulate % n and n != self.replicas:
            logger.warning(
                "stage %d has %d replicas but optimizer.accumulate is %d: a stage step combines %d x %d = %d "
                "micro-batches, not %d; a multiple of the replica count keeps the step size exact",
                self.stage,
                n,
                accumulate,
                n,
                max(1, round(accumulate / n)),
                n * max(1, round(accumulate / n)),
                accumulate,
            )
        stepped = False
        with self.lock:
            self.replicas = max(1, n)
            if self.replicas == 1 and not self._round_active:
                if self._ready:
                    stepped = self.flush_step()
                elif self.optimizer.ready:
                    stepped = self._maybe_step()
        self.on_gate_change()
        return stepped

    def _merge_ready(self) -> None:
        """Put the shares waiting for a round back into the accumulator (a local step takes them all)."""
        while self._ready:
            share = self._ready.popleft()
            self.optimizer.give_back_gradients(share.sums, share.count)
            self._pending_forwards += share.forward_versions

    def take_round(self) -> tuple[list[torch.Tensor], int, int]:
        """Start a round: ``(gradient sums, micro-batch count, version)`` of the oldest complete share, or
        of what has accumulated (an idle replica's partial share); accumulation goes on apart."""
        with self.lock:
            share = self._ready.popleft() if self._ready else self._take_share()
            self._active = share
            self._round_active = True
            version = self.version
            twin = (
                self.optimizer.twin(ns_steps=PREVIEW_NS_STEPS)
                if self.speculate and share.count > 0 and self.replicas > 1
                else None
            )
            # the forwards queued while this share waited would otherwise run on the version the round
            # replaces (a version stale) before the preview lands: the gate stays closed until it does
            self._previewing = twin is not None
        self.on_gate_change()
        if twin is not None:  # note "speculative rounds"; the twin's step runs outside the lock
            try:
                served = twin.step_with([g / share.count for g in share.sums])
                with self.lock:
                    if self._active is share and self.version == version:
                        self._speculative = served
            finally:
                self._previewing = False
                self.on_gate_change()
        return share.sums, share.count, version

    def end_round(
        self,
        mean: list[torch.Tensor] | None,
        version: int,
        back: tuple[list[torch.Tensor], int] | None,
        *,
        combined: int | None = None,
    ) -> bool:
        """Finish a round: step with the combined ``mean`` gradient of ``combined`` micro-batches (the
        whole group's) if this replica still is at ``version`` (True), or give ``back`` the taken share
        when the round failed (the next round retries it first). Returns whether it stepped. A round of
        fewer than ``accumulate`` micro-batches takes that fraction of a step (note "token-weighted
        steps" in swarm/run/optimizer.py)."""
        stepped = False
        with self.lock:
            active, self._active = self._active, None
            forwards = active.forward_versions if active is not None else 0
            if back is not None:
                self._ready.appendleft(_Share(back[0], back[1], forwards))  # retried first
            self._speculative = None
            if mean is not None and self.version == version:
                if active is not None and active.count:  # note "applied staleness"
                    self.optimizer.note_staleness(version - forwards / active.count, active.count)
                weight = 1.0 if combined is None else self._step_weight(combined)
                served = self.optimizer.step_with(mean, weight=weight)
                self._push_version(served)
                self.steps_taken += 1
                self.policy.reset_window()
                stepped = True
            self._round_active = False
        self.on_gate_change()
        return stepped

    def digest(self) -> list[float]:
        """Three statistics of the base parameters (sum, sum of squares, a signed sum), to tell replicas
        that diverged from replicas that differ by rounding only (compare with a relative tolerance)."""
        with self.lock:
            if self._digest_cache is not None and self._digest_cache[0] == self.version:
                return self._digest_cache[1]
            params = [self.optimizer.params[n] for n in self.optimizer.names]
            version = self.version
        total = square = signed = 0.0
        for i, p in enumerate(params):
            d = p.detach().double()
            total += float(d.sum())
            square += float(d.pow(2).sum())
            signed += float(d.flatten()[:: 2 + i % 3].sum())
        out = [total, square, signed]
        with self.lock:
            self._digest_cache = (version, out)
        return out

    def adopt_state(self, meta: dict[str, Any], tensors: list[torch.Tensor]) -> bool:
        """Catch up with the stage: take a newer replica's state as a new version, keeping the stash and
        the kept versions (in-flight backwards still run on the weights their forward used) and the
        gradients accumulated meanwhile (added to the next round, like any stale gradient). False when
        the state is not newer than ours."""
        version = self._check_state_meta(meta)
        with self.lock:
            if version <= self.version:
                return False
            kept = self.optimizer.take_gradients()  # load() zeroes the accumulator
            try:
                self.optimizer.load(tensors, meta)
            except ValueError as e:
                raise RequestError(f"state refused: {e}") from None
            finally:
                self.optimizer.give_back_gradients(*kept)
            self.version = version
            self.versions.push(version, self.optimizer.served())
            self._speculative = None
        self.on_gate_change()
        return True
