"""The layout of a gradient round's buffer, with sentinels that show a round that arrived in part (pure).

Note "partial rounds"
---------------------
hivemind's all-reduce splits the flat buffer into one span per member, and each member averages its
span for the group. When a member fails to send its span's average (a stream that broke, a reducer
that timed out), hivemind 1.1.12 keeps *this* replica's own values for that span, logs "Averaging:
received 60.3% results" and reports the round as a success. A replica that stepped on that buffer
applied a gradient that is partly its own and partly the group's mean: its weights leave the group's.
The digest check of the next round caught it (``diverged``), but on a tie of two replicas it kept the
lowest peer id's weights, which may be the corrupted ones (seen in a 2 x 2 demo: 2 of 150 rounds).

So every row of ``SENTINEL_EVERY`` buffer elements ends in a sentinel: each member writes a value of
its own, drawn at random in [1, 2) per round and sent along in hivemind's ``gather``, so after a
complete round every sentinel holds the mean of the members' values; a span whose average did not
arrive still holds this replica's own value. :meth:`RoundBuffer.missing` is the fraction of the
sentinels that do not hold the mean: 0.0 for a complete round. Any span of ``SENTINEL_EVERY`` or more
elements holds a sentinel, and a member's span is about ``1 / group size`` of the buffer, so a failed
span is never missed (a span below ``SENTINEL_EVERY`` would hold under 0.3% of a demo stage's
gradient). A round that arrived in part is not applied (peer/replicas.py); one of which nothing
arrived (``missing`` 1.0: a partner died mid-round) is a failed round, whose share is retried.

Layout: the payload (the gradient sums, then the micro-batch count) fills rows of ``SENTINEL_EVERY -
1`` values, zero-padded, and each row's last element is the sentinel.
"""

from __future__ import annotations

import math
import random

import torch

__all__ = ["RoundBuffer", "SENTINEL_EVERY"]

SENTINEL_EVERY = 1024  # buffer elements per sentinel
_TOLERANCE = 1e-5  # a sentinel "holds the mean" within this (float32 sums of values in [1, 2))


class RoundBuffer:
    """Where a round's ``payload`` values and its sentinels sit in the averager's flat buffer."""

    def __init__(self, payload: int):
        if payload < 1:
            raise ValueError(f"a round buffer needs at least one payload value, got {payload}")
        self.payload = payload
        self.rows = math.ceil(payload / (SENTINEL_EVERY - 1))
        self.size = self.rows * SENTINEL_EVERY  # the averager's buffer length

    @staticmethod
    def draw_sentinel() -> float:
        """This member's sentinel for one round (goes into its ``gather`` as ``"sentinel"``)."""
        return random.uniform(1.0, 2.0)

    def pack(self, buffer: torch.Tensor, payload: torch.Tensor, sentinel: float) -> None:
        """Write ``payload`` (flat, ``self.payload`` values) and this member's ``sentinel`` into ``buffer``."""
        if buffer.shape != (self.size,) or payload.shape != (self.payload,):
            raise ValueError(
                f"round buffer of shape {tuple(buffer.shape)} with a payload of {tuple(payload.shape)}; "
                f"this layout holds ({self.size},) with ({self.payload},)"
            )
        grid = buffer.view(self.rows, SENTINEL_EVERY)
        padded = torch.zeros(self.rows * (SENTINEL_EVERY - 1), dtype=buffer.dtype)
        padded[: self.payload] = payload
        grid[:, :-1].copy_(padded.view(self.rows, SENTINEL_EVERY - 1))
        grid[:, -1] = sentinel

    def unpack(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload, sentinels)`` read back from ``buffer`` (new tensors)."""
        grid = buffer.view(self.rows, SENTINEL_EVERY)
        return grid[:, :-1].reshape(-1)[: self.payload].clone(), grid[:, -1].clone()

    @staticmethod
    def missing(sentinels: torch.Tensor, values: list[float], own: float) -> float | None:
        """The fraction of ``sentinels`` that do not hold the mean of the members' ``values`` (0.0 for a
        complete round), or None when it cannot tell: ``own`` (this member's value) lies too close to
        the mean for a span left at ``own`` to differ from it."""
        if not values:
            return None
        mean = sum(values) / len(values)
        if abs(own - mean) <= 10 * _TOLERANCE:
            return None
        off = (sentinels.double() - mean).abs() > _TOLERANCE * max(1.0, abs(mean))
        return float(off.double().mean())
