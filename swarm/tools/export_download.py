"""Downloading every stage's state from the swarm, the way joining peers do (``peer.averaging``).

An exporter (or a keeper) joins each stage's averager only to download: it never joins a gradient
round and holds no state to share. In a gated run it announces itself in the stage lists as
``reading`` while it downloads (``_ReaderRecords``), since peers share state only with listed ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarm.dht.records import PeerRecord
from swarm.errors import PeerFailure, StageUnavailableError, SwarmError
from swarm.tools.export_states import StageState, dense_stage_weights, stage_state_from_download

if TYPE_CHECKING:
    import hivemind

    from swarm.dht.membership import Membership
    from swarm.run.model import StageModule
    from swarm.run.spec import RunSpec

logger = logging.getLogger(__name__)


def _state_layout(spec: RunSpec, module: StageModule) -> tuple[dict[str, tuple[int, ...]], list[str], list]:
    """(param shapes, state names, meta-device state tensors) of a stage, as its peers lay them out."""
    import torch

    from swarm.run.optimizer import StageOptimizer

    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    # The peer's own optimizer class decides the order and slots of its state (swarm/run/optimizer.py);
    # built on the meta device it allocates nothing.
    meta_params = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    opt = StageOptimizer(meta_params, spec.optimizer)
    return shapes, opt.state_names(), opt.state_tensors()


def _no_state() -> tuple[dict[str, Any], list]:
    raise PeerFailure("an exporter holds no stage state to share")


def download_stage_states(
    dht: hivemind.DHT,
    membership: Membership,
    spec: RunSpec,
    *,
    state_timeout_s: float,
    on_stage: Callable[[StageState], None] | None = None,
) -> list[StageState]:
    """Download one peer's state of every stage (``StageAverager.load_state``, as joining peers do).

    Checks first that every stage has an online peer (``StageUnavailableError`` naming the others).
    Each returned ``StageState.params`` holds the stage's *dense* weights (:func:`dense_stage_weights`);
    ``on_stage(state)`` is called as each stage arrives.
    """
    online = _online_peers(membership, spec)
    states = []
    for stage in range(spec.num_stages):
        state = _download_stage(dht, spec, stage, online[stage], state_timeout_s=state_timeout_s)
        if on_stage is not None:
            on_stage(state)
        states.append(state)
    return states


def _online_peers(membership: Membership, spec: RunSpec) -> list[list[PeerRecord]]:
    """Each stage's online peers; ``StageUnavailableError`` naming the stages that have none."""
    records = membership.all_stage_records(spec.num_stages)
    online: list[list[PeerRecord]] = [[r for r in recs.values() if r.state == "online"] for recs in records]
    empty = [s for s, peers in enumerate(online) if not peers]
    if empty:
        raise StageUnavailableError(
            f"stage{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of run {spec.run_id!r} "
            f"{'have' if len(empty) > 1 else 'has'} no online peer to download from; start one with "
            f"`swarm peer --initial-peers ... --run {spec.run_id}` (or wait: `swarm status` shows joining peers)"
        )
    return online


def _download_stage(
    dht: hivemind.DHT, spec: RunSpec, stage: int, online: list[PeerRecord], *, state_timeout_s: float
) -> StageState:
    """One stage's state from one of its ``online`` peers, checked and converted to dense weights."""
    from swarm.run.model import StageModule, build_stage

    # shapes only (nothing drawn: the weights come from the download)
    shapes, state_names, layout = _state_layout(spec, StageModule(spec, stage, draw=False))
    t0 = time.monotonic()
    loaded = _load_state(dht, spec, stage, layout, timeout_s=state_timeout_s)
    if loaded is None:
        raise StageUnavailableError(
            f"no peer of stage {stage} sent its state within {state_timeout_s:.0f} s although "
            f"{len(online)} announce{'s' if len(online) == 1 else ''} being online; they "
            "may be busy or unreachable from here. Try again, or raise --state-timeout-s"
        )
    meta, tensors = loaded
    raw = stage_state_from_download(spec, stage, meta, tensors, expected=shapes, state_names=state_names)
    del meta, tensors, loaded  # optimizer slots: not part of the model
    module = build_stage(spec, stage, weights=raw.params)
    # Keep only the dense weights: the raw parameters are not needed once converted.
    state = dataclasses.replace(
        raw,
        params=dense_stage_weights(module),
        announced_versions=tuple(sorted(r.version for r in online)),
    )
    del raw, module
    logger.info(
        "stage %d: version %d (step %d) downloaded and converted in %.1f s",
        stage,
        state.version,
        state.step_count,
        time.monotonic() - t0,
    )
    return state


def _load_state(
    dht: hivemind.DHT, spec: RunSpec, stage: int, layout: list, *, timeout_s: float
) -> tuple[dict[str, Any], list] | None:
    """``StageAverager.load_state`` of the stage until a donor answers within ``timeout_s`` (else None)."""
    from peer.averaging import StageAverager

    deadline = time.monotonic() + timeout_s
    averager = StageAverager.create(
        dht,
        run_id=spec.run_id,
        spec_hash=spec.spec_hash,
        stage=stage,
        shapes=layout,
        grad_shapes=[],  # an exporter only downloads: it never joins a gradient round
        state_fn=_no_state,
    )
    try:
        averager.wait_ready(min(30.0, timeout_s))
        loaded = None
        # A donor declares itself in the DHT a moment after it goes online; retry until the deadline.
        while loaded is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                loaded = averager.load_state(timeout_s=left)
            except TimeoutError:
                loaded = None
            if loaded is None and deadline - time.monotonic() > 1.0:
                time.sleep(1.0)
    finally:
        averager.shutdown()
    return loaded


class _ReaderRecords:
    """Keeps a ``reading`` record of this exporter in every stage list while it downloads (see
    ``ExportConfig.secret``); :meth:`stop` replaces them with short-lived ``leaving`` records."""

    PERIOD_S = 5.0

    def __init__(self, membership: Membership, spec: RunSpec):
        self.membership = membership
        self.records = [
            PeerRecord(
                peer_id=membership.peer_id,
                run_id=spec.run_id,
                stage=s,
                state="reading",
                throughput=0.0,
                queue=0,
                version=0,
                codecs=(),
                spec_hash=spec.spec_hash,
            )
            for s in range(spec.num_stages)
        ]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="export-reader-records", daemon=True)

    def _announce(self) -> None:
        for record in self.records:
            try:
                self.membership.announce(record)
            except SwarmError as e:  # a DHT hiccup: the next period tries again
                logger.warning("could not announce the exporter's record for stage %d: %s", record.stage, e)

    def start(self) -> _ReaderRecords:
        self._announce()  # before the first download: peers refresh their authorized ids every second
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            self._announce()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)
        for record in self.records:
            with contextlib.suppress(SwarmError):
                self.membership.announce_leaving(record, expiration_s=self.PERIOD_S)
