"""One small hierarchy for every error a user or a remote peer can cause.

Messages name the offending value, the rule it broke and the next step. Retry loops catch these
types (never bare ``Exception``); ``assert`` is kept for the code's own invariants.
"""

from __future__ import annotations

__all__ = [
    "SwarmError",
    "ConfigError",
    "RecordError",
    "RequestError",
    "StageUnavailableError",
    "PeerFailure",
]


class SwarmError(Exception):
    """Base class of every error swarmpipe raises on purpose."""


class ConfigError(SwarmError, ValueError):
    """A run spec, a command-line value or a config field was rejected."""


class RecordError(SwarmError, ValueError):
    """A DHT record failed validation (wrong type, wrong spec hash, forged subkey, ...)."""


class RequestError(SwarmError, ValueError):
    """A request from a peer or trainer was refused before it touched any state."""


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
