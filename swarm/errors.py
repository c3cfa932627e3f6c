"""One small hierarchy for every error a user or a remote peer can cause.

Messages name the offending value, the rule it broke and the next step. Retry loops catch these
types (never bare ``Exception``); ``assert`` is kept for the code's own invariants.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "Failure",
    "SwarmError",
    "ConfigError",
    "RecordError",
    "RequestError",
    "StageUnavailableError",
    "PeerFailure",
]


class Failure(str, Enum):
    """Why a request or a micro-batch failed, as one word that travels on the wire.

    Refusal replies and ``failed`` reports carry it in their ``failure`` field, so that no receiver
    parses English text back; the trainer's reaction is a table keyed by it
    (``swarm.train.trainer.REACTIONS``). The text next to it is for humans only.
    """

    UNREACHABLE = "unreachable"  # the peer could not be reached, or its stream broke
    TIMEOUT = "timeout"  # no answer in time
    ERROR = "error"  # the peer failed computing, answered garbage, or something unexpected
    BUSY = "busy"  # its compute queue is full (backpressure)
    REFUSED = "refused"  # it refused this request (malformed, not allowed, joining or leaving)
    VERSION_EVICTED = "version_evicted"  # the weight version a backward needs is gone (staleness)
    STASH_EXPIRED = "stash_expired"  # no backward came within the stash TTL
    LOST = "lost"  # (decided by the trainer) no peer of the route holds the micro-batch any more

    @classmethod
    def parse(cls, value: object) -> Failure | None:
        """The failure a wire value names; None for anything else (e.g. a code of a newer peer)."""
        try:
            return cls(value)
        except (ValueError, TypeError):
            return None


class SwarmError(Exception):
    """Base class of every error swarmpipe raises on purpose."""


class ConfigError(SwarmError, ValueError):
    """A run spec, a command-line value or a config field was rejected."""


class RecordError(SwarmError, ValueError):
    """A DHT record failed validation (wrong type, wrong spec hash, forged subkey, ...)."""


class RequestError(SwarmError, ValueError):
    """A request from a peer or trainer was refused before it touched any state.

    ``failure``: what kind of refusal it is on the wire (``Failure``); None for a plain refusal of a
    malformed or unwanted request (a reply says ``refused``; a peer's own computation that raised it
    reports ``error``). Subclasses may set a class default.
    """

    failure: Failure | None = None

    def __init__(self, *args: object, failure: Failure | None = None):
        super().__init__(*args)
        if failure is not None:
            self.failure = failure


class StageUnavailableError(SwarmError):
    """A stage of the run has no usable peer right now."""


class PeerFailure(SwarmError):
    """A remote peer did not answer, answered with an error, or broke a route."""

    def __init__(
        self, message: str, *, peer: str | None = None, stage: int | None = None, reason: str = "error"
    ):
        super().__init__(message)
        self.peer = peer
        self.stage = stage
        self.reason = reason

    @property
    def failure(self) -> Failure:
        """``timeout`` and ``unreachable`` as they are; anything else (a garbled reply) is an ``error``."""
        return Failure.parse(self.reason) or Failure.ERROR
