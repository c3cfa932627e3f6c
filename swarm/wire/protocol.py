"""The data plane: messages between trainers and stage peers, carried by hivemind's libp2p ``P2P``.

(Over 400 lines on purpose: the message headers, token packing and part framing are one wire format
under one version tag, ``PROTOCOL_TAG``; split, a change to one would hide where the others must follow.)

Why not ``ServicerBase``: handler names there are derived from (and cached on) the servicer class,
so the peer and the trainer would have to share one class. Here the protocol owns the names
(``FORWARD``, ``BACKWARD``, ``INFO``, ``REPORT``) and both sides register or call them directly.

Wire format (note "message parts")
-----------------------------------
A :class:`Message` is a small header (a msgpack dict, at most ``MAX_HEADER_BYTES``) plus an opaque
payload (codec bytes from ``compression``). It travels as a *stream* of hivemind
``runtime_pb2.ExpertRequest`` parts: the first part's ``uid`` is the protocol version tag, its
``metadata`` is the header; each part's ``tensors[0].buffer`` carries up to ``PART_BYTES`` of the
payload. Streams are used for every message, small or large, because unary messages are capped at
4 MiB and an oversized unary *response* hangs the caller (see docs/HIVEMIND.md, "P2P"). The header
declares ``payload_bytes``; the receiver checks it against its cap *before* reading the parts and
stops reading as soon as the parts exceed it.

Access (``swarm/dht/auth.py``): in a private run the sender adds ``payload_sha256`` and an ``auth`` field
(HMAC proof of the join secret, timestamp, nonce) to the header; ``serve``'s ``gate`` checks it
(and allow/deny lists, penalties) right after the header is read, before any payload byte is
buffered or decoded. ``read_message`` checks ``payload_sha256`` whenever a header carries it.

Replies are a single ``ExpertResponse`` whose ``metadata`` is a msgpack dict: ``{"ok": True, ...}``
or ``{"ok": False, "error": "...", "code": "...", "failure": "..."}``. Refusals are replies, not
exceptions, so a peer that refuses garbage does not log a traceback per request; the caller turns them
into :class:`~swarm.errors.RequestError` whose ``failure`` is the reply's (note "failure codes").

Failure codes (note "failure codes")
------------------------------------
What went wrong travels as a ``swarm.errors.Failure`` value: ``failure`` in a refusal reply (``busy``,
``version_evicted``, ``refused``, ...) and in a ``failed`` report (also ``timeout``, ``unreachable``,
``error``, ``stash_expired``); ``error`` and ``reason`` are text for humans and nobody parses them.
``code`` (the exception's type name) stays for older callers. Peers older than the codes send no
``failure``: only then :func:`legacy_failure` reads their text, by the fixed shapes those versions
wrote (never by a word anywhere in it, which a peer id could contain).

Flow of one training micro-batch (the trainer's view is in swarm/train/trainer.py's module docstring)
------------------------------------------------------------------------------------------
1. trainer -> route[0]     ``FORWARD``  (tokens and targets in the header, empty payload; one window of
   ``seq + 1`` ids when the targets are the tokens shifted by one: note "shifted window")
2. route[s] -> route[s+1]  ``FORWARD``  (payload = encoded activation of stage s)
3. last stage: loss; then, in ``train`` mode, route[S-1] -> route[S-2] ``BACKWARD`` (payload = encoded
   gradient w.r.t. that stage's input; header = the loss and the forward's stats, note "one report")
4. route[s] -> route[s-1]  ``BACKWARD`` ... down to stage 0, which sends ``REPORT`` kind ``done`` with the
   loss and every stage's stats: one report per micro-batch. In ``eval`` / ``generate`` mode the last
   stage sends ``REPORT`` kind ``result`` instead of a backward.
Any peer that cannot deliver to the next hop sends ``REPORT`` kind ``failed`` naming the stage and
peer that failed, and drops its stash entry. ``FORWARD`` and ``BACKWARD`` are acknowledged as soon
as the request is validated and queued (the ack carries the queue length), so a call never waits
for the rest of the route.

One report (note "one report")
------------------------------
Every message costs something on the wire beyond its header and payload: ~1.3 KB and 13 packets on a
libp2p stream of its own (a yamux stream through both p2pd daemons, multistream-select of the protocol
name, noise frames, the reply, both closes), ~0.4 KB and 4 packets on a channel (``call`` sends a
message of one part of at most 64 KiB on the long-lived stream to that peer, note "channels" in
swarm/wire/channel.py; ``python -m benchmarks.stream_cost``). Against ~16 bytes per token of payload per
hop of a subspace d/32 run, fewer messages still matter. So a trainer's
``FORWARD`` asks for ``one_report``: the last stage then sends no ``loss`` report, its loss (``loss``,
``n_tokens``) rides the ``BACKWARD`` headers down, each stage adds its forward's per-hop stats to the
``BACKWARD`` it sends (the ``FORWARD`` headers carry none), and stage 0's ``done`` carries them all. Both fields are absent on the wire unless used. Mixed versions keep working: a peer older
than the flag re-serialises the forward header without it, so the last stage of such a route sends
``loss`` and ``done`` as before (the trainer takes either), and a route whose last stage saw the flag has
only peers that pass the loss down.

Probes and cancellations (note "liveness probes" in swarm/client/liveness.py)
----------------------------------------------------------------------
``INFO`` (header ``{}`` or ``{"mb_ids": [...]}``) answers with the peer's run, stage, version, queue
and state; with ``mb_ids`` it adds ``held`` (those it holds actively: queued, computing, or sending
to the next hop or the trainer) and ``stashed`` (those waiting in its stash for a backward). A
trainer probes peers with it; a peer probes a trainer (which serves ``INFO`` too) before it drops
the trainer's stash entries. ``CANCEL`` (header ``{"run_id", "mb_ids"}``) from a trainer makes a
peer drop those of its micro-batches (stash entries, queued tasks, sends not yet made): the trainer
gave up on their attempts, so their backward will never come (in sync mode a stage could not step
while they waited). Only the trainer named in a micro-batch's forward header can cancel it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from swarm.errors import Failure, PeerFailure, RequestError
from swarm.traffic import TRAFFIC, message_kind
from swarm.wire import channel

__all__ = [
    "PROTOCOL_TAG",
    "PART_BYTES",
    "MAX_HEADER_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "FORWARD",
    "BACKWARD",
    "INFO",
    "CANCEL",
    "REPORT",
    "MAX_LISTED_IDS",
    "listed_ids",
    "Message",
    "ForwardHeader",
    "BackwardHeader",
    "Report",
    "pack_tokens",
    "pack_ids",
    "token_width",
    "TOKEN_WIDTHS",
    "unpack_tokens",
    "to_parts",
    "read_message",
    "serve",
    "unserve",
    "call",
    "peer_id_from_str",
]

PROTOCOL_TAG = "swarmpipe/1"
PART_BYTES = 1 << 20  # 1 MiB per part, far below the 4 MiB unary cap the daemon also applies to parts
MAX_HEADER_BYTES = 64 << 10  # token ids of a micro-batch live in the header: 64 KiB = 16k int32 tokens
DEFAULT_MAX_PAYLOAD_BYTES = 256 << 20

FORWARD = "swarmpipe.stage.forward"
BACKWARD = "swarmpipe.stage.backward"
INFO = "swarmpipe.stage.info"
CANCEL = "swarmpipe.stage.cancel"
REPORT = "swarmpipe.trainer.report"
MAX_LISTED_IDS = 1024  # micro-batch ids one INFO or CANCEL request may list

Mode = Literal["train", "eval", "generate"]
ReportKind = Literal["loss", "done", "failed", "result"]
_MODES = ("train", "eval", "generate")
_REPORT_KINDS = ("loss", "done", "failed", "result")
_MAX_ROUTE = 1024
_MAX_ID_CHARS = 128


@dataclass
class Message:
    """One protocol message: a msgpack-able header and opaque payload bytes."""

    header: dict[str, Any]
    payload: bytes = b""


# --------------------------------------------------------------------------------------------
# Field checks shared by the typed headers. Each raises RequestError naming field, value, rule.
# --------------------------------------------------------------------------------------------


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in d:
        raise RequestError(f"{what}: field {key!r} is missing; the sender speaks another protocol version?")
    value = d[key]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise RequestError(f"{what}: field {key!r} must be a number, got a bool")
    if not isinstance(value, kind):
        raise RequestError(f"{what}: field {key!r} has type {type(value).__name__}, expected {kind}")
    return value


def _check_str(value: str, key: str, what: str, max_chars: int = _MAX_ID_CHARS) -> str:
    if not 0 < len(value) <= max_chars:
        raise RequestError(f"{what}: field {key!r} must hold 1..{max_chars} characters, got {len(value)}")
    return value


def _check_int(value: int, key: str, what: str, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise RequestError(f"{what}: field {key!r} = {value} is outside [{lo}, {hi}]")
    return value


def _opt_int(d: dict[str, Any], key: str, default: int, what: str, lo: int, hi: int) -> int:
    """An optional integer field (absent in messages of older peers): ``default`` when missing."""
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{what}: field {key!r} must be an integer, got {type(value).__name__}")
    return _check_int(value, key, what, lo, hi)


def _opt_bool(d: dict[str, Any], key: str, what: str) -> bool:
    """An optional flag (absent in messages of older peers, and when False)."""
    value = d.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f"{what}: {key!r} must be a bool, got {type(value).__name__}")
    return value


def _opt_loss(d: dict[str, Any], what: str) -> float | None:
    loss = d.get("loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
        raise RequestError(f"{what}: 'loss' must be a number or None")
    return None if loss is None else float(loss)


def _check_stats(stats: Any, what: str) -> dict[str, float]:
    if not isinstance(stats, dict) or len(stats) > 256:
        raise RequestError(f"{what}: 'stats' must be a dict of at most 256 numbers")
    clean = {}
    for k, v in stats.items():
        if not isinstance(k, str) or len(k) > 64 or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RequestError(f"{what}: 'stats' must map short names to numbers, got {str(k)[:64]!r}: {v!r}")
        clean[k] = float(v)
    return clean


@dataclass(frozen=True)
class ForwardHeader:
    """Header of a ``FORWARD`` message sent to the peer serving ``stage``.

    ``route[i]`` is the base58 peer id chosen for stage i; ``trainer`` is the trainer's peer id
    (reports go there). ``tokens`` and ``targets`` are little-endian token ids of shape ``(batch, seq)``,
    1, 2 or 4 bytes each (uint8 / uint16 / int32, the narrowest that holds the run's vocabulary: see
    :func:`pack_tokens`; both of one width), ``targets`` empty in ``generate`` mode. ``mb_id`` is unique
    per attempt. ``shifted`` (note "shifted window"): ``tokens`` holds ``(batch, seq + 1)`` ids, the inputs
    are its first ``seq`` columns and the targets its last ``seq`` (a trainer's targets are its tokens
    shifted by one), ``targets`` is empty: every hop carries ``seq + 1`` ids instead of ``2 x seq``.
    Read both with :meth:`token_ids`.
    """

    run_id: str
    spec_hash: str
    mb_id: str
    stage: int
    route: tuple[str, ...]
    trainer: str
    mode: Mode
    batch: int
    seq: int
    tokens: bytes
    targets: bytes
    sent_at: float = field(default_factory=time.time)
    # per-hop figures accumulated along the route (e.g. "fwd_bytes_1", "fwd_compute_s_1"); the last
    # stage copies them into its report so the trainer can account bytes per link.
    stats: dict[str, float] = field(default_factory=dict)
    # a retry of a micro-batch whose earlier attempt's backward already added its gradient at stages
    # >= counted_from (note "counted stages" in swarm/train/loop.py): those stages run it without adding
    # the gradient again. -1: no stage has counted it.
    counted_from: int = -1
    # sync mode: the trainer's step this micro-batch belongs to (-1: async). A replica that sees a newer
    # window of a trainer knows the previous one is over everywhere (peer/replicas.py).
    window: int = -1
    shifted: bool = False
    # note "one report": the trainer asks for one report per training micro-batch; the last stage sends
    # its loss down in the BACKWARD header instead of a ``loss`` report, and stage 0's ``done`` carries it
    one_report: bool = False

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["route"] = list(self.route)
        for flag in ("shifted", "one_report"):  # absent = False: headers without them are unchanged
            if not d[flag]:
                del d[flag]
        return d

    def token_ids(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``(batch, seq)`` token ids and targets (None when the header has none), refusing ids outside
        ``[0, vocab_size)``."""
        if self.shifted:
            win = unpack_tokens(self.tokens, self.batch, self.seq + 1, vocab_size)
            return win[:, :-1].contiguous(), win[:, 1:].contiguous()
        tokens = unpack_tokens(self.tokens, self.batch, self.seq, vocab_size)
        return tokens, unpack_tokens(self.targets, self.batch, self.seq, vocab_size) if self.targets else None

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ForwardHeader:
        what = "forward header"
        route = _get(d, "route", list, what)
        if not 0 < len(route) <= _MAX_ROUTE or not all(
            isinstance(p, str) and 0 < len(p) <= _MAX_ID_CHARS for p in route
        ):
            raise RequestError(f"{what}: 'route' must be 1..{_MAX_ROUTE} peer id strings")
        mode = _get(d, "mode", str, what)
        if mode not in _MODES:
            raise RequestError(f"{what}: 'mode' = {mode!r} is not one of {_MODES}")
        batch = _check_int(_get(d, "batch", int, what), "batch", what, 1, 1 << 16)
        seq = _check_int(_get(d, "seq", int, what), "seq", what, 1, 1 << 20)
        tokens = _get(d, "tokens", bytes, what)
        targets = _get(d, "targets", bytes, what)
        shifted = _opt_bool(d, "shifted", what)
        cols = seq + 1 if shifted else seq
        width = _width_of(tokens, batch, cols)
        if width is None:
            raise RequestError(
                f"{what}: 'tokens' holds {len(tokens)} bytes, expected batch*{'(seq+1)' if shifted else 'seq'}"
                f"*width = {batch}*{cols}*{'|'.join(map(str, TOKEN_WIDTHS))}"
            )
        n = batch * seq * width
        if shifted and (targets or mode == "generate"):
            raise RequestError(
                f"{what}: a shifted window carries the targets in 'tokens': 'targets' must be empty and the "
                f"mode not 'generate' (got {len(targets)} target bytes, mode {mode!r})"
            )
        if not shifted and len(targets) not in ((0, n) if mode == "generate" else (n,)):
            raise RequestError(
                f"{what}: 'targets' holds {len(targets)} bytes, expected {n} (the width of 'tokens') "
                f"in mode {mode!r}"
            )
        stage = _check_int(_get(d, "stage", int, what), "stage", what, 0, len(route) - 1)
        sent_at = _get(d, "sent_at", (int, float), what)
        if not math.isfinite(sent_at):
            raise RequestError(f"{what}: 'sent_at' must be finite")
        return cls(
            run_id=_check_str(_get(d, "run_id", str, what), "run_id", what),
            spec_hash=_check_str(_get(d, "spec_hash", str, what), "spec_hash", what),
            mb_id=_check_str(_get(d, "mb_id", str, what), "mb_id", what),
            stage=stage,
            route=tuple(route),
            trainer=_check_str(_get(d, "trainer", str, what), "trainer", what),
            mode=mode,  # type: ignore[arg-type]
            batch=batch,
            seq=seq,
            tokens=tokens,
            targets=targets,
            sent_at=float(sent_at),
            stats=_check_stats(d.get("stats", {}), what),
            counted_from=_opt_int(d, "counted_from", -1, what, -1, len(route)),
            window=_opt_int(d, "window", -1, what, -1, 1 << 62),
            shifted=shifted,
            one_report=_opt_bool(d, "one_report", what),
        )


@dataclass(frozen=True)
class BackwardHeader:
    """Header of a ``BACKWARD`` message: the gradient w.r.t. the output of stage ``stage``.

    ``loss`` and ``n_tokens`` (note "one report"): the last stage's loss of a micro-batch whose forward
    header asked for ``one_report``, carried down to stage 0 (None, and absent on the wire, otherwise).
    """

    run_id: str
    spec_hash: str
    mb_id: str
    stage: int
    sent_at: float = field(default_factory=time.time)
    stats: dict[str, float] = field(default_factory=dict)  # accumulated like ForwardHeader.stats
    loss: float | None = None
    n_tokens: int = 0

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.loss is None:  # absent: the header without a loss is unchanged
            del d["loss"], d["n_tokens"]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> BackwardHeader:
        what = "backward header"
        sent_at = _get(d, "sent_at", (int, float), what)
        if not math.isfinite(sent_at):
            raise RequestError(f"{what}: 'sent_at' must be finite")
        return cls(
            run_id=_check_str(_get(d, "run_id", str, what), "run_id", what),
            spec_hash=_check_str(_get(d, "spec_hash", str, what), "spec_hash", what),
            mb_id=_check_str(_get(d, "mb_id", str, what), "mb_id", what),
            stage=_check_int(_get(d, "stage", int, what), "stage", what, 0, _MAX_ROUTE),
            sent_at=float(sent_at),
            stats=_check_stats(d.get("stats", {}), what),
            loss=_opt_loss(d, what),
            n_tokens=_opt_int(d, "n_tokens", 0, what, 0, 1 << 40),
        )


@dataclass(frozen=True)
class Report:
    """A peer -> trainer report about one micro-batch.

    kinds: ``loss`` (last stage: ``loss`` and ``n_tokens`` set), ``done`` (stage 0 finished backward:
    the micro-batch's gradients reached every stage; with ``loss`` and ``n_tokens`` set when the forward
    asked for one report, note "one report"), ``failed`` (``stage``/``peer`` name the hop that
    failed, ``reason`` says why), ``result`` (eval/generate: ``loss`` and/or payload = encoded logits).
    ``stats`` holds per-stage numbers such as compute seconds and bytes sent (str -> float).
    """

    run_id: str
    mb_id: str
    kind: ReportKind
    stage: int
    peer: str
    loss: float | None = None
    n_tokens: int = 0
    reason: str = ""
    version: int = -1
    stats: dict[str, float] = field(default_factory=dict)
    # ``failed`` reports of the backward phase: the stages >= counted_from already added this
    # micro-batch's gradient (-1: none did, e.g. a forward failure)
    counted_from: int = -1
    # ``failed`` reports: what broke (note "failure codes"); None only for reports built without one
    failure: Failure | None = None

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["failure"] = "" if self.failure is None else self.failure.value
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Report:
        what = "report"
        kind = _get(d, "kind", str, what)
        if kind not in _REPORT_KINDS:
            raise RequestError(f"{what}: 'kind' = {kind!r} is not one of {_REPORT_KINDS}")
        loss = _opt_loss(d, what)
        reason = d.get("reason", "")
        if not isinstance(reason, str):
            raise RequestError(f"{what}: 'reason' must be a string")
        return cls(
            run_id=_check_str(_get(d, "run_id", str, what), "run_id", what),
            mb_id=_check_str(_get(d, "mb_id", str, what), "mb_id", what),
            kind=kind,  # type: ignore[arg-type]
            stage=_check_int(_get(d, "stage", int, what), "stage", what, -1, _MAX_ROUTE),
            peer=_get(d, "peer", str, what)[:_MAX_ID_CHARS],
            loss=loss,
            n_tokens=_check_int(int(d.get("n_tokens", 0)), "n_tokens", what, 0, 1 << 40),
            reason=reason[:2000],
            version=int(d.get("version", -1)),
            stats=_check_stats(d.get("stats", {}), what),
            counted_from=_opt_int(d, "counted_from", -1, what, -1, _MAX_ROUTE),
            failure=_report_failure(kind, d.get("failure"), reason[:2000]),
        )


def _report_failure(kind: str, value: Any, reason: str) -> Failure | None:
    """A report's failure code; a ``failed`` report of an older peer (no code) gets its text's."""
    if kind != "failed":
        return None
    return Failure.parse(value) or legacy_failure(reason)


# Note "failure codes": the fixed shapes of the texts peers wrote before failure codes existed.
# ``call``'s texts start with the protocol name and the peer id, or the peer id and "refused";
# a peer's own failures start with their kind.
_CALL_TEXT = re.compile(
    r"(?s)[\w.]+ to \S+(?P<what> timed out after |: the stream closed without a reply| failed: |: )"
)
_REFUSAL_TEXT = re.compile(r"(?s)\S+ refused [\w.]+: (?P<error>.*)")


def legacy_failure(text: str) -> Failure:
    """The failure of a ``failed`` report from a peer older than failure codes, read from its text."""
    code = Failure.parse(text)
    if code is not None:
        return code
    m = _CALL_TEXT.match(text)
    if m is not None:
        what = m.group("what")
        if what == " timed out after ":
            return Failure.TIMEOUT
        return Failure.ERROR if what == ": " else Failure.UNREACHABLE  # ": " = a garbled reply
    m = _REFUSAL_TEXT.match(text)
    if m is not None:
        return _legacy_refusal(m.group("error"))
    if text.startswith("version evicted: "):
        return Failure.VERSION_EVICTED
    if text.startswith("stash expired: "):
        return Failure.STASH_EXPIRED
    return Failure.ERROR


def _legacy_refusal(error: str) -> Failure:
    """The failure of a refusal reply from a peer older than failure codes, by its error text."""
    if error.startswith("busy, queue full"):
        return Failure.BUSY
    if error.startswith("version evicted: "):
        return Failure.VERSION_EVICTED
    return Failure.REFUSED


# --------------------------------------------------------------------------------------------
# Tokens in headers
# --------------------------------------------------------------------------------------------


TOKEN_WIDTHS = (1, 2, 4)
"""Bytes per token id on the wire: uint8, uint16 (little-endian), int32 (little-endian)."""
_TOKEN_DTYPES = {1: "u1", 2: "<u2", 4: "<i4"}


def token_width(vocab_size: int | None) -> int:
    """The narrowest width in :data:`TOKEN_WIDTHS` holding ids ``[0, vocab_size)``; 4 when unknown."""
    if vocab_size is None or vocab_size > 1 << 16:
        return 4
    return 1 if vocab_size <= 1 << 8 else 2


def _width_of(data: bytes, batch: int, seq: int) -> int | None:
    """The width in :data:`TOKEN_WIDTHS` of ``(batch, seq)`` ids held in ``data``; None if none fits."""
    return next((w for w in TOKEN_WIDTHS if len(data) == batch * seq * w), None)


def _check_vocab(t: torch.Tensor, vocab_size: int) -> None:
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise RequestError(
            f"token ids must lie in [0, {vocab_size}) for this run's vocabulary, "
            f"got min {int(t.min())} max {int(t.max())}"
        )


def pack_tokens(tokens: torch.Tensor, vocab_size: int | None = None) -> bytes:
    """(B, T) integer tensor -> little-endian bytes, ``token_width(vocab_size)`` bytes per id.

    Every hop of a route carries a micro-batch's ids (a subspace boundary needs them at every stage), so
    a byte vocabulary costs 1 byte per id instead of 4. Ids outside ``[0, vocab_size)`` are refused
    rather than wrapped.
    """
    if tokens.dim() != 2:
        raise RequestError(f"token ids must have shape (batch, seq), got {tuple(tokens.shape)}")
    t = tokens.detach().to("cpu", torch.int64)
    if vocab_size is not None:
        _check_vocab(t, vocab_size)
    return t.contiguous().numpy().astype(_TOKEN_DTYPES[token_width(vocab_size)]).tobytes()


def pack_ids(
    tokens: torch.Tensor, targets: torch.Tensor | None, vocab_size: int | None = None
) -> tuple[bytes, bytes, bool]:
    """``(tokens, targets, shifted)`` header fields for a micro-batch: one ``(B, T + 1)`` window when the
    targets are the tokens shifted by one (note "shifted window" in :class:`ForwardHeader`), both
    apart otherwise."""
    if targets is None:
        return pack_tokens(tokens, vocab_size), b"", False
    if (
        tokens.dim() == 2
        and targets.shape == tokens.shape
        and torch.equal(tokens[:, 1:].to(torch.int64), targets[:, :-1].to(torch.int64))
    ):
        return (
            pack_tokens(torch.cat([tokens, targets[:, -1:].to(tokens.dtype)], dim=1), vocab_size),
            b"",
            True,
        )
    return pack_tokens(tokens, vocab_size), pack_tokens(targets, vocab_size), False


def unpack_tokens(data: bytes, batch: int, seq: int, vocab_size: int) -> torch.Tensor:
    """Token bytes of any width in :data:`TOKEN_WIDTHS` -> (B, T) LongTensor, refusing ids outside
    ``[0, vocab_size)``."""
    import numpy as np

    width = _width_of(data, batch, seq)
    if width is None:
        raise RequestError(
            f"token bytes: {len(data)} bytes cannot hold ({batch}, {seq}) ids of 1, 2 or 4 bytes"
        )
    ids = np.frombuffer(data, dtype=_TOKEN_DTYPES[width]).astype(np.int64)
    t = torch.from_numpy(ids).view(batch, seq)
    _check_vocab(t, vocab_size)
    return t


# --------------------------------------------------------------------------------------------
# Parts
# --------------------------------------------------------------------------------------------


def to_parts(message: Message, *, part_bytes: int = PART_BYTES) -> list[runtime_pb2.ExpertRequest]:
    """Split a message into stream parts (the first part carries the header)."""
    header = dict(message.header)
    header["payload_bytes"] = len(message.payload)
    header_bytes = msgpack.packb(header, use_bin_type=True)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise RequestError(
            f"message header is {len(header_bytes)} bytes, over the {MAX_HEADER_BYTES}-byte cap; "
            "send fewer tokens per micro-batch"
        )
    payload = memoryview(message.payload)
    chunks = [payload[i : i + part_bytes] for i in range(0, len(payload), part_bytes)] or [payload[:0]]
    parts = []
    for i, chunk in enumerate(chunks):
        part = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=bytes(chunk))])
        if i == 0:
            part.uid = PROTOCOL_TAG
            part.metadata = header_bytes
        parts.append(part)
    return parts


Gate = Callable[[dict[str, Any]], None]


async def read_message(
    parts: AsyncIterator[runtime_pb2.ExpertRequest],
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    gate: Gate | None = None,
) -> Message:
    """Assemble a message from stream parts, validating sizes before buffering anything large.

    ``gate(header)`` (access checks) runs on the parsed header before any payload is buffered.
    """
    first = await anext(parts, None)
    if first is None:
        raise RequestError("empty request stream: expected at least one part with a header")
    if first.uid != PROTOCOL_TAG:
        raise RequestError(f"protocol tag {first.uid[:40]!r} is not {PROTOCOL_TAG!r}; upgrade one side")
    if len(first.metadata) > MAX_HEADER_BYTES:
        raise RequestError(f"header of {len(first.metadata)} bytes exceeds the {MAX_HEADER_BYTES}-byte cap")
    try:
        header = msgpack.unpackb(first.metadata, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise RequestError(f"header is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise RequestError(f"header must be a map, got {type(header).__name__}")
    if gate is not None:
        gate(header)
    declared = header.get("payload_bytes")
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 0:
        raise RequestError(f"header field 'payload_bytes' = {declared!r} must be a non-negative integer")
    if declared > max_payload_bytes:
        raise RequestError(
            f"payload of {declared} bytes exceeds this peer's cap of {max_payload_bytes} bytes; "
            "use a stronger codec or smaller micro-batches"
        )
    buf = bytearray()

    def _take(part: runtime_pb2.ExpertRequest) -> None:
        for t in part.tensors:
            if len(buf) + len(t.buffer) > declared:
                raise RequestError(f"payload parts exceed the declared {declared} bytes")
            buf.extend(t.buffer)

    _take(first)
    async for part in parts:
        _take(part)
    if len(buf) != declared:
        raise RequestError(f"payload truncated: got {len(buf)} of the declared {declared} bytes")
    digest = header.get("payload_sha256")
    if digest is not None and digest != hashlib.sha256(buf).digest():
        raise RequestError("payload does not match the header's payload_sha256: corrupted or tampered")
    return Message(header=header, payload=bytes(buf))


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _reply(d: dict[str, Any]) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=msgpack.packb(d, use_bin_type=True))


Handler = Callable[[Message, PeerID], Awaitable[dict[str, Any]]]


RequestGate = Callable[[str, str, dict[str, Any]], None]


async def serve(
    p2p: P2P,
    name: str,
    handler: Handler,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    gate: RequestGate | None = None,
    on_refused: Callable[[RequestError], None] | None = None,
) -> None:
    """Register ``handler(message, remote_peer_id) -> reply dict`` under protocol name ``name``.

    ``gate(name, remote_peer_id, header)``, if given, runs before any payload is read and refuses
    by raising ``RequestError`` (``swarm.dht.auth.RunAuth.gate`` builds one). ``RequestError`` raised
    while reading or handling becomes an ``{"ok": False}`` reply (and is passed to ``on_refused``,
    for counting); the handler's own reply gets ``ok: True`` added.
    """

    async def _handle(
        parts: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        yield await _respond(parts, context)
        # Linger (see note "reply before close"): hivemind closes our end of the stream as soon as
        # this generator ends, and the daemon may then reset the stream before the reply reached
        # the caller (seen under load as "the stream closed without a reply"). The caller closes
        # its end once it has the reply, which cancels this sleep at once.
        await asyncio.sleep(_LINGER_S)

    async def _respond(
        parts: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        try:
            remote = str(context.remote_id)
            message = await read_message(
                parts,
                max_payload_bytes=max_payload_bytes,
                gate=None if gate is None else (lambda header: gate(name, remote, header)),
            )
            reply = _reply({"ok": True, **await handler(message, context.remote_id)})
            TRAFFIC.add(f"reply.{message_kind(name)}", header=len(reply.metadata))
            return reply
        except RequestError as e:
            if on_refused is not None:
                on_refused(e)
            await _discard_rest(parts)
            failure = e.failure or Failure.REFUSED
            return _reply({"ok": False, "error": str(e), "code": type(e).__name__, "failure": failure.value})

    async def _respond_part(
        part: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return await _respond(_aiter([part]), context)

    await p2p.add_protobuf_handler(
        name, _handle, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
    )
    await channel.register(p2p, message_kind(name), _respond_part, tag=PROTOCOL_TAG)


async def unserve(p2p: P2P, name: str) -> None:
    """Stop serving ``name`` (on streams of their own and on channels); the daemon may already be gone."""
    channel.unregister(p2p, message_kind(name))
    await p2p.remove_protobuf_handler(name, stream_input=True, stream_output=True)


_LINGER_S = 10.0


_DISCARD_BYTES = 64 << 20
_DISCARD_S = 10.0


async def _discard_rest(parts: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
    """Read and drop the parts a refused request still has in flight (bounded in bytes and time).

    Why: closing a stream with unread data makes the daemon reset it, and the reset can reach the
    caller before the refusal reply does, turning a clear refusal into "connection reset" (seen on
    a loaded machine with a payload over the cap). Draining first lets the reply arrive intact.
    """

    async def _drain() -> None:
        seen = 0
        async for part in parts:
            seen += sum(len(t.buffer) for t in part.tensors)
            if seen > _DISCARD_BYTES:
                return

    try:
        await asyncio.wait_for(_drain(), timeout=_DISCARD_S)
    except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        pass


async def call(
    p2p: P2P, peer: PeerID | str, name: str, message: Message, *, timeout_s: float, auth: Any = None
) -> dict[str, Any]:
    """Send ``message`` to ``peer``'s handler ``name`` and return its reply dict.

    ``auth`` (a ``swarm.dht.auth.RunAuth``) signs the request in a private run. Raises ``RequestError``
    when the peer refused the request (the message says why), and ``PeerFailure`` (reason
    ``timeout`` or ``unreachable``) when it could not be reached in time.
    """
    peer_id = peer_id_from_str(peer) if isinstance(peer, str) else peer
    if auth is not None and auth.private:
        header = dict(message.header)
        header["payload_bytes"] = len(message.payload)
        header["payload_sha256"] = hashlib.sha256(message.payload).digest()
        header = auth.sign_request(name, str(p2p.peer_id), str(peer_id), header)
        message = Message(header, message.payload)
    parts = to_parts(message)
    TRAFFIC.add(message_kind(name), header=len(parts[0].metadata), payload=len(message.payload))
    try:
        response = await asyncio.wait_for(_exchange(p2p, peer_id, name, parts), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise PeerFailure(
            f"{name} to {peer_id} timed out after {timeout_s:.1f} s", peer=str(peer_id), reason="timeout"
        ) from None
    except (ConnectionError, OSError, asyncio.IncompleteReadError, P2PDaemonError, P2PHandlerError) as e:
        # P2PHandlerError: the remote handler crashed (a bug there, not a refusal); treat the peer as failed.
        raise PeerFailure(
            f"{name} to {peer_id} failed: {e}", peer=str(peer_id), reason="unreachable"
        ) from None
    try:
        reply = msgpack.unpackb(response.metadata, raw=False)
    except Exception:
        raise PeerFailure(
            f"{name} to {peer_id}: the reply is not valid msgpack", peer=str(peer_id), reason="garbage"
        ) from None
    if not isinstance(reply, dict):
        raise PeerFailure(f"{name} to {peer_id}: the reply is not a map", peer=str(peer_id), reason="garbage")
    if not reply.get("ok"):
        text = str(reply.get("error", "no reason given"))
        failure = Failure.parse(reply.get("failure")) or _legacy_refusal(text)
        raise RequestError(f"{peer_id} refused {name}: {text}", failure=failure)
    return reply


async def _exchange(
    p2p: P2P, peer_id: PeerID, name: str, parts: list[runtime_pb2.ExpertRequest]
) -> runtime_pb2.ExpertResponse:
    """The reply to a message: on the channel to the peer when the message is small (note "channels" in
    swarm/wire/channel.py): small ones on its small lane, one-part activations and gradients on its bulk
    lane; messages of several parts, or when the peer has no channel, on a stream of their own."""
    lane = channel.lane_of(parts)
    if lane is not None:
        response = await channel.request(p2p, peer_id, name, parts[0], tag=PROTOCOL_TAG, lane=lane)
        if response is not None:
            return response
    return await _first_response(p2p, peer_id, name, parts)


async def _first_response(
    p2p: P2P, peer_id: PeerID, name: str, parts: list[runtime_pb2.ExpertRequest]
) -> runtime_pb2.ExpertResponse:
    """Take the reply and close the stream at once.

    A server may refuse after the first part (payload over its cap) and close the stream while we
    are still writing; ``call_protobuf_handler`` would then surface the write error and lose the
    refusal, so read the single reply ourselves and drop the unsent parts.
    """
    stream = await p2p.iterate_protobuf_handler(peer_id, name, _aiter(parts), runtime_pb2.ExpertResponse)
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise PeerFailure(
            f"{name} to {peer_id}: the stream closed without a reply", peer=str(peer_id), reason="unreachable"
        ) from None
    finally:
        await stream.aclose()


def listed_ids(header: dict[str, Any], what: str) -> list[str]:
    """The optional ``mb_ids`` list of an ``INFO`` or ``CANCEL`` header (empty when absent)."""
    ids = header.get("mb_ids", [])
    if not isinstance(ids, list) or len(ids) > MAX_LISTED_IDS:
        raise RequestError(f"{what}: 'mb_ids' must be a list of at most {MAX_LISTED_IDS} micro-batch ids")
    if not all(isinstance(i, str) and 0 < len(i) <= _MAX_ID_CHARS for i in ids):
        raise RequestError(
            f"{what}: 'mb_ids' must hold micro-batch id strings of 1..{_MAX_ID_CHARS} characters"
        )
    return ids


def peer_id_from_str(value: str) -> PeerID:
    """Parse a base58 peer id string, raising ``RequestError`` on garbage."""
    try:
        return PeerID.from_base58(value)
    except Exception:
        raise RequestError(f"{value[:60]!r} is not a base58 libp2p peer id") from None
