"""The trainer's control loop against a simulated swarm (no sockets, millisecond delays).

``SimSwarm`` stands in for the network side of ``swarm.client.link.SwarmLink`` only: it answers
``send_forward`` and sends the reports real peers would send (``loss``, ``done``, ``failed``),
with peers that can die, stay silent, or appear later. It checks the trainer's scheduling and
bookkeeping (pipelining bound, sync lock-step, re-sends, deadlines, waiting for an empty stage);
real peers on loopback are exercised in tests/test_trainer_integration.py.
"""

from __future__ import annotations

import asyncio
import io
import json

import pytest
import torch

from swarm.client.liveness import LivenessConfig
from swarm.client.routing import RoutingConfig
from swarm.dht.records import PeerRecord
from swarm.errors import ConfigError, Failure, PeerFailure, StageUnavailableError
from swarm.run.spec import RunSpec
from swarm.train.data import DataConfig, TokenData
from swarm.train.metrics import read_metrics
from swarm.train.trainer import REACTIONS, Trainer, TrainerConfig, read_resume_state, service_seconds
from swarm.wire.protocol import Report, legacy_failure

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def pid(name: str) -> str:
    return ("Qm" + "".join(_B58[ord(c) % 58] for c in name) + "1" * 44)[:46]


def make_spec(mode: str = "async", accumulate: int = 1) -> RunSpec:
    return RunSpec.from_dict(
        {
            "run_id": "sim",
            "model": {"vocab_size": 256, "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8},
            "stages": 2,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": {"mode": mode, "accumulate": accumulate},
            "micro_batch_size": 2,
        }
    )


class Progress:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def publish_progress(self, trainer_id, tokens, steps, loss, *, tokens_per_s=0.0) -> bool:
        self.calls.append((trainer_id, tokens, steps, loss))
        return True

    def events(self) -> list:  # stage events (swarm/tools/keeper.py): none in a simulated swarm
        return []


class SimSwarm:
    """Peers by stage; ``dead`` ones refuse connections, ``silent`` ones swallow micro-batches
    (``forgetful`` ones too, but then deny holding them when probed), ``stalling`` ones hold each
    micro-batch ``stall_s`` seconds. ``at`` says which peer holds a micro-batch (what probes answer)."""

    def __init__(self, spec: RunSpec, peers: dict[int, list[str]], *, hop_s: float = 0.002):
        self.spec = spec
        self.peers = {s: [pid(n) for n in names] for s, names in peers.items()}
        self.dead: set[str] = set()
        self.silent: set[str] = set()
        self.hanging: set[str] = set()
        self.hop_s = hop_s
        self.membership = Progress()
        self.peer_id = pid("trainer")
        self.on_report = lambda report, payload: None
        self.received: dict[str, int] = {}
        self.inflight = 0
        self.max_inflight_seen = 0
        self.sent_modes: list[str] = []
        self.steps_seen = 0
        self.counted_from: dict[str, int] = {}  # mb_id -> the header's counted_from
        self.evict_first: int = 0  # fail this many backwards at stage 0 (version evicted), as peers report it
        self.forgetful: set[str] = set()
        self.stalling: set[str] = set()
        self.stall_s = 0.0
        self.at: dict[str, str] = {}  # mb_id -> the peer holding it now
        self.probes: list[str] = []  # peers probed, in order
        self.cancelled: dict[str, list[str]] = {}  # peer -> mb_ids the trainer cancelled there
        self.on_heard = lambda peer: None
        self.sent_tokens: list[torch.Tensor] = []  # token ids of every training attempt, in order
        self.legacy = False  # peers older than "one report": they ignore the flag (loss report + done)
        self.one_report: dict[str, bool] = {}  # mb_id -> its forward asked for one report (and was heard)
        self.reports: list[str] = []  # kinds of the reports sent, in order
        self._tasks: set[asyncio.Task] = set()

    async def stage_records(self) -> list[dict[str, PeerRecord]]:
        out = []
        for s in range(self.spec.num_stages):
            recs = {}
            for p in self.peers.get(s, []):
                recs[p] = PeerRecord(
                    peer_id=p,
                    run_id=self.spec.run_id,
                    stage=s,
                    state="online",
                    throughput=1e6,
                    queue=0,
                    version=0,
                    codecs=("none",),
                    spec_hash=self.spec.spec_hash,
                )
            out.append(recs)
        return out

    async def send_forward(
        self, *, route, mb_id, mode, tokens, targets, timeout_s, counted_from=-1, window=-1, one_report=False
    ) -> dict:
        self.counted_from[mb_id] = counted_from
        self.one_report[mb_id] = one_report and not self.legacy
        if mode == "train":
            self.sent_tokens.append(tokens.clone())
        assert tokens.shape == (self.spec.micro_batch_size, self.spec.model.seq_len)
        if route[0] in self.dead:
            raise PeerFailure("connection refused", peer=route[0], reason="unreachable")
        if route[0] in self.hanging:  # a dial that never completes (until the caller's timeout)
            await asyncio.sleep(timeout_s)
            raise PeerFailure("timed out", peer=route[0], reason="timeout")
        self.sent_modes.append(mode)
        task = asyncio.get_running_loop().create_task(self._travel(route, mb_id, mode, tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return {"queue": 0}

    async def probe(self, peer: str, mb_ids: list[str], *, timeout_s: float) -> dict:
        self.probes.append(peer)
        await asyncio.sleep(0)
        if peer in self.dead:
            raise PeerFailure("connection refused", peer=peer, reason="unreachable")
        return {"held": [i for i in mb_ids if self.at.get(i) == peer]}

    async def cancel(self, peer: str, mb_ids: list[str], *, timeout_s: float = 5.0) -> None:
        self.cancelled.setdefault(peer, []).extend(mb_ids)

    def _report(self, mb_id: str, kind: str, stage: int, peer: str, **kw) -> None:
        self.reports.append(kind)
        self.on_heard(peer)
        self.on_report(
            Report(run_id=self.spec.run_id, mb_id=mb_id, kind=kind, stage=stage, peer=peer, **kw), b""
        )

    async def _travel(self, route, mb_id, mode, tokens) -> None:
        self.inflight += 1
        self.max_inflight_seen = max(self.max_inflight_seen, self.inflight)
        try:
            stats: dict[str, float] = {}
            for s, p in enumerate(route):
                if p in self.dead:  # the previous hop cannot deliver and says so
                    self._report(mb_id, "failed", s, p, reason="unreachable", failure=Failure.UNREACHABLE)
                    return
                self.at[mb_id] = p
                if p in self.silent:
                    if p in self.forgetful:
                        self.at.pop(mb_id, None)
                    return
                self.received[p] = self.received.get(p, 0) + 1
                await asyncio.sleep(self.stall_s if p in self.stalling else self.hop_s)
                stats[f"fwd_compute_s_{s}"] = self.hop_s
                stats[f"fwd_bytes_{s}"] = 100.0
            loss = 5.0 / (1 + 0.05 * self.steps_seen)  # a loss that falls as work completes
            if mode == "eval":
                self._report(mb_id, "result", len(route) - 1, route[-1], loss=loss, stats=stats)
                return
            one = self.one_report.get(mb_id, False)
            if not one:
                self._report(mb_id, "loss", len(route) - 1, route[-1], loss=loss, stats=stats)
            await asyncio.sleep(self.hop_s * len(route))
            if mode == "train" and self.evict_first > 0 and len(route) > 1:
                self.evict_first -= 1  # stage 1 already added the gradient: the report says so
                self._report(
                    mb_id,
                    "failed",
                    0,
                    route[0],
                    reason="version evicted: weight version 0 is gone",
                    failure=Failure.VERSION_EVICTED,
                    counted_from=1,
                )
                return
            self.steps_seen += 1
            self.at.pop(mb_id, None)
            bwd = {"bwd_compute_s_0": self.hop_s}
            if one:  # note "one report": the loss and the forward stats came down with the backward
                self._report(
                    mb_id, "done", 0, route[0], loss=loss, n_tokens=tokens.numel(), stats=stats | bwd
                )
            else:
                self._report(mb_id, "done", 0, route[0], stats=bwd)
        finally:
            self.inflight -= 1

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def data_for(spec: RunSpec) -> TokenData:
    return TokenData(torch.arange(20000) % 256, seq_len=spec.model.seq_len)


FAST = RoutingConfig(deadline_base_s=0.5, deadline_slack=1.0, backoff_base_s=0.2, backoff_max_s=1.0)


def config(tmp_path, **kw) -> TrainerConfig:
    base = dict(
        initial_peers=("/ip4/127.0.0.1/tcp/1/p2p/" + pid("boot"),),
        run_id="sim",
        out_dir=str(tmp_path),
        routing=FAST,
        refresh_every_s=0.05,
        publish_every_s=0.05,
        quiet=True,
    )
    base.update(kw)
    return TrainerConfig(**base)


def run(trainer: Trainer, sim: SimSwarm, spec: RunSpec) -> dict:
    async def main():
        try:
            return await asyncio.wait_for(trainer.run_on(sim, data_for(spec)), timeout=30)
        finally:
            await sim.close()

    return asyncio.run(main())


def test_async_run_pipelines_accounts_and_writes_files(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0", "b0"], 1: ["a1", "b1"]})
    summary = run(Trainer(config(tmp_path, steps=40, max_inflight=4, eval_every=20)), sim, spec)
    mb = summary["micro_batches"]
    assert mb["completed"] == 40 and mb["dropped"] == 0 and mb["opened"] == 40
    assert 1 < sim.max_inflight_seen <= 4
    assert all(sim.received.get(pid(n), 0) > 5 for n in ("a0", "b0", "a1", "b1"))
    assert summary["tokens"] == 40 * spec.tokens_per_micro_batch and summary["steps"] == 40
    assert summary["loss_last"] < summary["loss_first"]
    assert set(summary["peer_loss"]["1"]) == {pid("a1"), pid("b1")}
    assert summary["bytes_per_token"] == pytest.approx(200.0 / spec.tokens_per_micro_batch)
    steps = read_metrics(tmp_path / "metrics.jsonl", "step")
    assert [r["step"] for r in steps] == list(range(1, 41))
    evals = read_metrics(tmp_path / "metrics.jsonl", "eval")
    assert [e["step"] for e in evals] == [20, 40] and all(e["eval_loss"] for e in evals)
    assert "eval" in sim.sent_modes
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert json.loads((tmp_path / "summary.json").read_text())["micro_batches"]["completed"] == 40
    assert sum(summary["peers_by_stage"]["0"].values()) == 40 + summary["eval_micro_batches"]["completed"]
    assert sim.membership.calls and sim.membership.calls[-1][1] == summary["tokens"]


@pytest.mark.parametrize("legacy", [False, True], ids=["one report", "older peers: loss + done"])
def test_each_training_micro_batch_gets_one_report_with_its_loss_and_stats(tmp_path, legacy):
    """Note "one report": the trainer asks for it; stage 0's ``done`` carries the loss and every stat, and
    peers that ignore the flag (older ones) still send ``loss`` then ``done``, accounted the same."""
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: ["a1"]})
    sim.legacy = legacy
    summary = run(Trainer(config(tmp_path, steps=8, max_inflight=2)), sim, spec)
    assert summary["micro_batches"]["completed"] == 8 and summary["micro_batches"]["odd_reports"] == 0
    train_reports = [k for k in sim.reports if k != "result"]
    assert train_reports.count("done") == 8 and train_reports.count("loss") == (8 if legacy else 0)
    steps = read_metrics(tmp_path / "metrics.jsonl", "step")
    assert len(steps) == 8 and all(r["loss"] is not None for r in steps)
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["bytes_per_token"] == pytest.approx(200.0 / spec.tokens_per_micro_batch)


def test_sync_mode_sends_accumulate_then_waits(tmp_path):
    spec = make_spec("sync", accumulate=3)
    sim = SimSwarm(spec, {0: ["a0", "b0"], 1: ["a1"]})
    summary = run(Trainer(config(tmp_path, steps=5, max_inflight=8)), sim, spec)
    assert summary["micro_batches"]["completed"] == 15 and summary["steps"] == 5
    assert sim.max_inflight_seen == 3  # never more than one window of `accumulate` in the swarm


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sync_training_waits_for_an_evaluation_round_and_async_overlaps_it(tmp_path, mode):
    """Note "evaluation between windows": in sync mode no training micro-batch is in flight with an
    evaluation's, and its record says that training paused for ``eval_s``; async rounds overlap."""
    spec = make_spec(mode, accumulate=2)

    class Watched(SimSwarm):
        modes: dict[str, str] = {}  # mb_id -> mode, while in flight
        mixed = 0  # sends that found the other kind in flight

        async def send_forward(self, *, mb_id, mode, **kw) -> dict:
            if any(m != mode for m in self.modes.values()):
                self.mixed += 1
            self.modes[mb_id] = mode
            return await super().send_forward(mb_id=mb_id, mode=mode, **kw)

        def _report(self, mb_id: str, kind: str, stage: int, peer: str, **kw) -> None:
            if kind in ("done", "result", "failed"):
                self.modes.pop(mb_id, None)
            super()._report(mb_id, kind, stage, peer, **kw)

    sim = Watched(spec, {0: ["a0"], 1: ["a1"]})
    sim.hop_s = 0.01
    summary = run(Trainer(config(tmp_path, steps=8, max_inflight=4, eval_every=2)), sim, spec)
    assert summary["micro_batches"]["completed"] == 16
    evals = read_metrics(tmp_path / "metrics.jsonl", "eval")
    assert [e["step"] for e in evals] == [2, 4, 6, 8] and all(e["eval_s"] >= 0 for e in evals)
    if mode == "sync":
        assert sim.mixed == 0 and all(e["paused"] for e in evals)
    else:
        assert sim.mixed > 0 and not any(e["paused"] for e in evals)


def test_a_report_callback_only_records_it_and_the_loop_closes_the_steps(tmp_path):
    """Nothing changes under the link's callback: the ledger and the steps move when the loop reacts."""
    spec = make_spec(accumulate=2)
    trainer = Trainer(config(tmp_path, steps=4, max_inflight=2))

    class Watched(SimSwarm):
        unchanged: list[bool] = []

        def _report(self, mb_id: str, kind: str, stage: int, peer: str, **kw) -> None:
            before = (trainer.ledger.totals(), trainer.step)
            super()._report(mb_id, kind, stage, peer, **kw)
            self.unchanged.append(before == (trainer.ledger.totals(), trainer.step))

    sim = Watched(spec, {0: ["a0"], 1: ["a1"]})
    summary = run(trainer, sim, spec)
    assert summary["steps"] == 4 and summary["micro_batches"]["completed"] == 8
    assert len(sim.unchanged) >= 8 and all(sim.unchanged)  # one report (done + loss) per micro-batch


def test_dead_peer_is_routed_around_and_everything_is_accounted(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0", "b0"], 1: ["a1", "b1"]})
    sim.dead.add(pid("b1"))  # stage-1 peer gone: stage 0 reports `failed` naming it
    sim.dead.add(pid("b0"))  # stage-0 peer gone: the trainer's own call fails
    summary = run(Trainer(config(tmp_path, steps=30, max_inflight=4)), sim, spec)
    mb = summary["micro_batches"]
    assert mb["completed"] == 30 and mb["retries"] > 0
    assert mb["opened"] == mb["completed"] + mb["dropped"]
    assert set(mb["failures_by_reason"]) == {"unreachable"}
    assert set(summary["peers_by_stage"]["1"]) == {pid("a1")}
    events = read_metrics(tmp_path / "metrics.jsonl", "event")
    assert any(e["event"] == "attempt_failed" and e["peer"] == pid("b1") for e in events)


def test_peer_dying_with_work_queued_closes_all_its_attempts_at_once(tmp_path):
    """A silent peer would hold its micro-batches until their deadlines; once one failure names it
    unreachable, every other attempt through it is re-sent at once, long before any deadline."""
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: ["a1", "doomed"]})
    sim.silent.add(pid("doomed"))  # swallows work, like a peer killed with micro-batches queued
    slow_deadlines = RoutingConfig(deadline_base_s=60.0, backoff_base_s=0.2, backoff_max_s=1.0)
    trainer = Trainer(config(tmp_path, steps=10, max_inflight=4, routing=slow_deadlines))

    def through_doomed() -> list:
        return [a for a in trainer.ledger.inflight_attempts() if a.route[1] == pid("doomed")]

    async def main():
        run = asyncio.get_running_loop().create_task(trainer.run_on(sim, data_for(spec)))
        try:
            while getattr(trainer, "ledger", None) is None or len(through_doomed()) < 2:
                await asyncio.sleep(0.005)
            sim.dead.add(pid("doomed"))  # one hop notices and reports it; the others stay silent
            sim._report(
                through_doomed()[0].mb_id,
                "failed",
                1,
                pid("doomed"),
                reason="unreachable",
                failure=Failure.UNREACHABLE,
            )
            return await asyncio.wait_for(run, timeout=30)
        finally:
            await sim.close()

    summary = asyncio.run(main())
    mb = summary["micro_batches"]
    assert mb["completed"] == 10 and mb["failures_by_reason"] == {"unreachable": mb["failed_attempts"]}
    # no 60 s deadline was waited for: the run ended within wait_for's 30 s, and no attempt timed out
    assert mb["failed_attempts"] >= 2 and "timeout" not in mb["failures_by_reason"]


def test_silent_peer_times_out_and_micro_batches_are_resent(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: ["a1", "quiet"]})
    sim.silent.add(pid("quiet"))
    summary = run(Trainer(config(tmp_path, steps=12, max_inflight=2, max_attempts=6)), sim, spec)
    mb = summary["micro_batches"]
    assert mb["completed"] == 12 and mb["failures_by_reason"].get("timeout", 0) >= 1
    assert mb["opened"] == mb["completed"] + mb["dropped"]


def test_stage0_peer_that_never_acknowledges_is_blamed_at_the_deadline(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["ok0", "hangs"], 1: ["a1"]})
    sim.hanging.add(pid("hangs"))
    trainer = Trainer(config(tmp_path, steps=12, max_inflight=2, call_timeout_s=30.0))
    summary = run(trainer, sim, spec)
    mb = summary["micro_batches"]
    assert mb["completed"] == 12 and mb["failures_by_reason"].get("timeout", 0) >= 1
    events = read_metrics(tmp_path / "metrics.jsonl", "event")
    timeouts = [e for e in events if e["event"] == "attempt_failed" and e["reason"] == "timeout"]
    assert timeouts and all(e["peer"] == pid("hangs") and e["stage"] == 0 for e in timeouts)
    assert trainer.router.stats[pid("hangs")].failed >= 1  # backed off, not tried again at once
    assert set(summary["peers_by_stage"]["0"]) == {pid("ok0")}


def test_exhausted_attempts_drop_with_reason_and_stage_then_give_up_on_empty_stage(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: ["bad"]})
    sim.dead.add(pid("bad"))
    trainer = Trainer(config(tmp_path, steps=2, max_inflight=1, max_attempts=1, stage_wait_s=0.5))

    async def main():
        async def record_expires():  # a dead peer's record expires after a while
            await asyncio.sleep(0.3)
            sim.peers[1] = []

        helper = asyncio.get_running_loop().create_task(record_expires())
        try:
            return await asyncio.wait_for(trainer.run_on(sim, data_for(spec)), timeout=30)
        finally:
            await helper
            await sim.close()

    with pytest.raises(StageUnavailableError, match="stage 1 of run 'sim' had no usable peer"):
        asyncio.run(main())
    mb = trainer.summary["micro_batches"]
    assert mb["dropped"] >= 1 and mb["dropped_by_reason"].get("unreachable", 0) >= 1
    assert mb["dropped_by_stage"].get("1", 0) >= 1
    assert mb["opened"] == mb["completed"] + mb["dropped"]


def test_empty_stage_waits_with_command_then_continues(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: []})
    out = io.StringIO()
    trainer = Trainer(config(tmp_path, steps=5, quiet=False, progress_interval_s=100.0), out=out)

    async def main():
        async def add_peer_later():
            await asyncio.sleep(0.5)
            sim.peers[1] = [pid("late")]

        helper = asyncio.get_running_loop().create_task(add_peer_later())
        try:
            return await asyncio.wait_for(trainer.run_on(sim, data_for(spec)), timeout=30)
        finally:
            await helper
            await sim.close()

    summary = asyncio.run(main())
    text = out.getvalue()
    assert "stage 1 of run 'sim' has no online peer" in text
    assert "swarm peer --initial-peers /ip4/127.0.0.1/tcp/1/p2p/" in text and "--run sim --stage 1" in text
    assert "training continues" in text
    assert summary["micro_batches"]["completed"] == 5


def test_service_seconds_reads_per_stage_stats():
    stats = {"fwd_compute_s_1": 0.25, "bwd_compute_s_1": 0.5, "fwd_compute_s_0": 0.1}
    assert service_seconds(stats, 1) == 0.75
    assert service_seconds(stats, 0) == 0.1
    assert service_seconds(stats, 2) is None


@pytest.mark.parametrize(
    "text, kind",
    [
        ("unreachable", "unreachable"),
        ("swarmpipe.stage.forward to QmX failed: connection refused", "unreachable"),
        ("QmX refused swarmpipe.stage.forward: this peer is joining and takes no new forwards", "refused"),
        ("swarmpipe.stage.forward to QmX timed out after 30.0 s", "timeout"),
        ("QmX refused swarmpipe.stage.forward: busy, queue full (64 tasks)", "busy"),
        ("version evicted: weight version 3 of stage 1 is gone (max_versions=3)", "version_evicted"),
        ("stash expired: no backward within 120 s", "stash_expired"),
        ("swarmpipe.stage.backward to QmX failed: stream closed", "unreachable"),
        ("swarmpipe.stage.backward to QmX: the stream closed without a reply", "unreachable"),
        ("swarmpipe.stage.backward to QmX: the reply is not valid msgpack", "error"),
        ("compute error: RuntimeError: CUDA out of memory", "error"),
        ("something odd", "error"),
        # the text's shape decides, never a word inside a peer id
        ("swarmpipe.stage.forward to 12D3KooWbusyQueueFull timed out after 30.0 s", "timeout"),
        (
            "12D3KooWbusy refused swarmpipe.stage.forward: this peer is leaving and takes no new forwards",
            "refused",
        ),
        ("swarmpipe.stage.forward to QmEvictedTimeout failed: connection reset", "unreachable"),
    ],
)
def test_failure_texts_of_older_peers_are_read_by_their_shape(text, kind):
    assert legacy_failure(text) is Failure(kind)


def test_a_failed_report_with_a_code_is_never_read_from_its_text():
    """A peer id containing "busy" no longer makes a timeout look like backpressure."""
    text = "swarmpipe.stage.forward to 12D3KooWbusyXYZ timed out after 30.0 s; busy, queue full"
    wire = Report(
        run_id="r",
        mb_id="m",
        kind="failed",
        stage=1,
        peer="12D3KooWbusyXYZ",
        reason=text,
        failure=Failure.TIMEOUT,
    ).to_wire()
    assert wire["failure"] == "timeout"
    assert Report.from_wire(wire).failure is Failure.TIMEOUT
    older = {k: v for k, v in wire.items() if k != "failure"}  # a peer from before failure codes
    assert Report.from_wire(older).failure is Failure.TIMEOUT
    assert Report.from_wire(wire | {"failure": "from_the_future"}).failure is Failure.TIMEOUT  # by its text
    done = Report(run_id="r", mb_id="m", kind="done", stage=0, peer="p").to_wire()
    assert done["failure"] == "" and Report.from_wire(done).failure is None


def test_every_failure_code_has_a_reaction():
    assert set(REACTIONS) == set(Failure)
    suspect = {f.value for f, r in REACTIONS.items() if r.backoff}
    assert suspect == {"unreachable", "timeout", "error"}
    assert [f.value for f, r in REACTIONS.items() if r.pause] == ["busy"]
    assert [f.value for f, r in REACTIONS.items() if r.dead] == ["unreachable"]


def test_tensorboard_sink_receives_the_step_records(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: ["a1"]})
    run(Trainer(config(tmp_path, steps=6, max_inflight=2, log=("tensorboard",))), sim, spec)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "loss" in tags
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, 7))


def test_a_retry_after_a_backward_failure_is_not_counted_again_at_later_stages(tmp_path):
    spec = make_spec("async", accumulate=1)
    sim = SimSwarm(spec, {0: ["a"], 1: ["b"]})
    sim.evict_first = 2
    trainer = Trainer(config(tmp_path, steps=6, max_inflight=1))
    summary = run(trainer, sim, spec)
    assert summary["micro_batches"]["completed"] == 6
    retried = [v for v in sim.counted_from.values() if v >= 0]
    assert retried == [1, 1]  # both retries tell stage 1 it already counted them
    assert sum(1 for v in sim.counted_from.values() if v < 0) == 6  # first attempts and the rest


# ---- failure detection (note "failure detection" in swarm/train/probing.py) ---------------------------

QUICK = LivenessConfig(
    silence_s=0.05, probe_every_s=0.02, initial_rto_s=0.3, min_rto_s=0.1, recheck_s=0.05, dead_hold_s=5.0
)
NO_DEADLINE = RoutingConfig(deadline_base_s=600.0, backoff_base_s=0.2, backoff_max_s=1.0)


def kill_when_holding(trainer: Trainer, sim: SimSwarm, spec: RunSpec, victim: str, n: int = 2) -> dict:
    """Run ``trainer``; once ``victim`` holds ``n`` attempts, mark it dead (nobody reports it)."""

    def through() -> list:
        return [a for a in trainer.ledger.inflight_attempts() if sim.at.get(a.mb_id) == victim]

    async def main():
        task = asyncio.get_running_loop().create_task(trainer.run_on(sim, data_for(spec)))
        try:
            while getattr(trainer, "ledger", None) is None or len(through()) < n:
                await asyncio.sleep(0.005)
            held = {a.mb_id for a in through()}
            sim.dead.add(victim)
            summary = await asyncio.wait_for(task, timeout=30)
            summary["held_by_victim"] = held
            return summary
        finally:
            await sim.close()

    return asyncio.run(main())


def test_a_peer_killed_with_work_is_found_by_a_probe_and_its_micro_batches_resent(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: ["a1", "doomed"]})
    sim.silent.add(pid("doomed"))  # keeps what it gets, as a peer that is about to be SIGKILLed
    # max_inflight 2: once both are with the victim, nothing else is sent, so only a probe can tell
    trainer = Trainer(config(tmp_path, steps=10, max_inflight=2, routing=NO_DEADLINE, liveness=QUICK))
    summary = kill_when_holding(trainer, sim, spec, pid("doomed"))
    mb = summary["micro_batches"]
    assert mb["completed"] == 10 and mb["opened"] == mb["completed"] + mb["dropped"]
    assert set(mb["failures_by_reason"]) == {"unreachable"}  # no deadline was waited for
    assert pid("doomed") in sim.probes
    events = read_metrics(tmp_path / "metrics.jsonl", "event")
    assert any(e["event"] == "peer_dead" and e["peer"] == pid("doomed") for e in events)
    assert trainer.detected and trainer.detected[0]["peer"] == pid("doomed")
    # the survivors of those routes were told to drop them; the dead peer was not called
    assert summary["held_by_victim"] <= set(sim.cancelled.get(pid("a0"), []))
    assert pid("doomed") not in sim.cancelled


def test_a_micro_batch_no_route_peer_holds_is_resent_before_its_deadline(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: ["a1", "forgets"]})
    sim.silent.add(pid("forgets"))
    sim.forgetful.add(pid("forgets"))  # alive, answers probes, but lost what it was given
    trainer = Trainer(config(tmp_path, steps=8, max_inflight=2, routing=NO_DEADLINE, liveness=QUICK))
    summary = run(trainer, sim, spec)
    mb = summary["micro_batches"]
    assert mb["completed"] == 8
    assert set(mb["failures_by_reason"]) == {"lost"} and mb["failures_by_reason"]["lost"] >= 1


def test_a_slow_peer_that_still_holds_its_micro_batches_is_not_given_up_on(tmp_path):
    spec = make_spec()
    sim = SimSwarm(spec, {0: ["a0"], 1: ["slow"]})
    sim.stalling.add(pid("slow"))
    sim.stall_s = 0.4  # longer than the first check times: the checks find it holding them
    trainer = Trainer(config(tmp_path, steps=4, max_inflight=2, routing=NO_DEADLINE, liveness=QUICK))
    summary = run(trainer, sim, spec)
    mb = summary["micro_batches"]
    assert mb["completed"] == 4 and mb["failed_attempts"] == 0
    assert pid("slow") in sim.probes


def test_sync_mode_does_not_stall_when_a_peer_dies_with_its_window(tmp_path):
    spec = make_spec("sync", accumulate=3)
    sim = SimSwarm(spec, {0: ["a0"], 1: ["a1", "doomed"]})
    sim.silent.add(pid("doomed"))
    trainer = Trainer(config(tmp_path, steps=4, max_inflight=8, routing=NO_DEADLINE, liveness=QUICK))
    summary = kill_when_holding(trainer, sim, spec, pid("doomed"), n=1)
    assert summary["steps"] == 4 and summary["micro_batches"]["completed"] == 12
    assert set(summary["micro_batches"]["failures_by_reason"]) == {"unreachable"}


# ---- resume (note "resume" in swarm/train/resume.py) --------------------------------------------------


def killed_at(trainer: Trainer, sim: SimSwarm, spec: RunSpec, step: int) -> None:
    """Run ``trainer`` and stop it abruptly once it reached ``step`` (its task is cancelled)."""

    async def main():
        task = asyncio.get_running_loop().create_task(trainer.run_on(sim, data_for(spec)))
        try:
            while getattr(trainer, "step", 0) < step:
                await asyncio.sleep(0.002)
            while not task.done():  # asyncio.wait_for of Python < 3.12 may swallow one cancellation
                task.cancel()
                await asyncio.sleep(0.01)
            await asyncio.gather(task, return_exceptions=True)
        finally:
            await sim.close()

    asyncio.run(main())


def test_resume_continues_steps_tokens_data_and_appends_to_the_metrics(tmp_path):
    spec = make_spec(accumulate=2)
    first = SimSwarm(spec, {0: ["a0"], 1: ["a1"]}, hop_s=0.03)  # slow enough to stop it mid-run
    trainer = Trainer(config(tmp_path, steps=10, max_inflight=2, seed=7, trainer_id="alice"))
    killed_at(trainer, first, spec, 4)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"type": "step", "step": 9')  # the kill cut a line in half
    state = read_resume_state(str(tmp_path), run_id="sim")
    assert (state.trainer_id, state.seed, state.target_steps) == ("alice", 7, 10)
    assert 4 <= state.step < 10 and state.data_position >= 2 * state.step

    second = SimSwarm(spec, {0: ["a0"], 1: ["a1"]})
    summary = run(Trainer(config(tmp_path, max_inflight=2, resume=True)), second, spec)  # target: 10 again
    steps = read_metrics(tmp_path / "metrics.jsonl", "step")
    assert [r["step"] for r in steps] == list(range(1, 11))  # continued, not restarted or duplicated
    assert steps[-1]["tokens"] == 10 * 2 * spec.tokens_per_micro_batch
    assert summary["steps"] == 10 and summary["trainer_id"] == "alice"
    starts = [e for e in read_metrics(tmp_path / "metrics.jsonl", "event") if e["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_step"] == state.step and starts[1]["trainer"] == "alice"
    # the data stream goes on where it stopped: the resumed trainer's first micro-batch is draw number P
    stream = data_for(spec).stream(spec.micro_batch_size, seed=7)
    for _ in range(state.data_position):
        next(stream)
    assert torch.equal(second.sent_tokens[0], next(stream)[0])
    assert steps[-1]["time"] >= steps[state.step - 1]["time"]


def test_resume_with_more_steps_trains_to_the_new_total(tmp_path):
    spec = make_spec()
    run(Trainer(config(tmp_path, steps=3, max_inflight=2)), SimSwarm(spec, {0: ["a"], 1: ["b"]}), spec)
    run(
        Trainer(config(tmp_path, steps=5, max_inflight=2, resume=True)),
        SimSwarm(spec, {0: ["a"], 1: ["b"]}),
        spec,
    )
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "step")] == [1, 2, 3, 4, 5]


def _files(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())} if path.exists() else {}


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "no such directory"),
        ("empty", "holds no trainer start record"),
        ("other_run", "was written by a trainer of run 'elsewhere'"),
        ("other_spec", "but the run's spec is now"),
        ("other_data", "read data from"),
        ("finished", "nothing is left to do"),
    ],
)
def test_a_bad_resume_directory_is_refused_and_nothing_changes(tmp_path, case, match):
    spec = make_spec()
    out = tmp_path / "out"
    if case != "missing":
        out.mkdir()
    if case in ("other_run", "other_spec", "other_data", "finished"):
        old = make_spec(accumulate=2) if case == "other_spec" else spec
        if case == "other_run":
            old = RunSpec.from_dict(spec.to_dict() | {"run_id": "elsewhere"})
        cfg = config(out, steps=2, max_inflight=2, run_id=old.run_id)
        run(Trainer(cfg), SimSwarm(old, {0: ["a"], 1: ["b"]}), old)
    before = _files(out)
    kw = {"data": DataConfig(source=str(tmp_path))}
    cfg = config(out, steps=2, max_inflight=2, resume=True, **(kw if case == "other_data" else {}))
    with pytest.raises(ConfigError, match=match):
        run(Trainer(cfg), SimSwarm(spec, {0: ["a"], 1: ["b"]}), spec)
    assert _files(out) == before


def test_the_train_command_refuses_a_resume_that_contradicts_its_directory(tmp_path, capsys):
    from swarm.cli import main

    spec = make_spec()
    run(
        Trainer(config(tmp_path, steps=2, max_inflight=2, seed=3)), SimSwarm(spec, {0: ["a"], 1: ["b"]}), spec
    )
    base = ["train", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/" + pid("boot"), "--run", "sim"]
    assert main([*base, "--resume", str(tmp_path), "--out", str(tmp_path / "elsewhere")]) == 1
    assert "name different directories" in capsys.readouterr().err
    assert main([*base, "--resume", str(tmp_path), "--seed", "4"]) == 1
    assert "differs from the seed 3" in capsys.readouterr().err
    assert main([*base, "--resume", str(tmp_path / "nope")]) == 1
    assert "no such directory" in capsys.readouterr().err


def test_inflight_rule_of_thumb_keeps_two_per_stage_and_every_peer_busy():
    from swarm.train.trainer import inflight_rule_of_thumb

    assert inflight_rule_of_thumb(2, 2) == 4  # one peer per stage: a transfer overlaps a computation
    assert inflight_rule_of_thumb(2, 4) == 4  # 2 x 2: one per replica is enough
    assert inflight_rule_of_thumb(2, 8) == 8  # 2 x 4: every replica busy


def test_async_in_flight_is_paced_from_the_stage_count_up_to_what_the_swarm_takes(tmp_path):
    # the simulated peers serve any number at once (no queues): the pacer climbs to max_inflight
    spec = make_spec(accumulate=4)  # staleness caps of 3 per stage-0 peer: the pacer's target binds
    sim = SimSwarm(spec, {0: ["a0", "b0"], 1: ["a1", "b1"]}, hop_s=0.02)
    summary = run(Trainer(config(tmp_path, steps=20, max_inflight=5)), sim, spec)
    paced = summary["inflight"]
    assert paced["mode"] == "paced" and paced["max"] == 5 and paced["floor"] == 2, paced
    targets = [
        e["target"] for e in read_metrics(tmp_path / "metrics.jsonl", "event") if e["event"] == "inflight"
    ]
    assert targets[:3] == [3, 4, 5], targets  # one more at a time while round trips do not lengthen
    assert all(2 <= t <= 5 for t in targets)
    steps = read_metrics(tmp_path / "metrics.jsonl", "step")
    assert steps[0]["inflight_target"] == 2
    assert sim.max_inflight_seen == 5


def test_a_fixed_in_flight_count_is_kept_without_pacing(tmp_path):
    spec = make_spec(accumulate=4)
    sim = SimSwarm(spec, {0: ["a0"], 1: ["a1"]}, hop_s=0.01)
    summary = run(Trainer(config(tmp_path, steps=5, max_inflight=3, pacing=False)), sim, spec)
    assert summary["inflight"] == {"mode": "fixed", "max": 3}
    assert sim.max_inflight_seen == 3
