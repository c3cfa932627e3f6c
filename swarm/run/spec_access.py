"""The ``access`` and ``pretrained`` sections of a run spec: who may take part, and where the initial
weights come from. Both are left out of the spec (and its hash) when absent.

Part of ``swarm.run.spec`` (which re-exports everything here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from swarm.run.fields import OMIT_NONE, check_fields, flag, reject, set_field
from swarm.run.limits import PEER_ID_RE, SHA256_HEX_RE, SPEC_HASH_RE

__all__ = ["AccessConfig", "PretrainedConfig", "MAX_ACCESS_LIST"]

MAX_ACCESS_LIST = 256  # peer ids per allow/deny list: keeps the spec far below the DHT value cap


@dataclass(frozen=True, kw_only=True)
class AccessConfig:
    """Who may take part (see swarm/dht/auth.py). Left out of the spec (and its hash) when absent.

    Written by ``swarm init --private`` or by hand (``access: {deny: [PEER_ID, ...]}``); it never
    holds the join secret, only ``secret_check``, which lets joiners detect a wrong secret.
    """

    _SECTION: ClassVar[str] = "access"

    private: bool = flag(False)
    """True: only holders of the run's join secret may appear in the DHT or call any peer."""
    secret_check: str | None = field(default=None, metadata=OMIT_NONE)
    """16 hex chars, ``swarm.dht.auth.secret_check(secret, run_id)``; required when private."""
    allow: tuple[str, ...] = ()
    """If non-empty, only these peer ids (base58) may take part."""
    deny: tuple[str, ...] = ()
    """These peer ids may never take part (wins over ``allow``)."""

    def __post_init__(self) -> None:
        s = self._SECTION
        check_fields(self, s)
        check = self.secret_check
        if self.private and (not isinstance(check, str) or not SPEC_HASH_RE.fullmatch(check)):
            raise reject(
                f"{s}.secret_check",
                check,
                "a private run needs the 16 hex chars of swarm.dht.auth.secret_check(secret, run_id)",
                "Create private runs with `swarm init RUN.yaml --private --secret-file PATH`.",
            )
        if not self.private and check is not None:
            raise reject(f"{s}.secret_check", check, "only a private run has a secret check", "Remove it.")
        for name in ("allow", "deny"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or len(value) > MAX_ACCESS_LIST:
                raise reject(
                    f"{s}.{name}",
                    value,
                    f"it must be a list of at most {MAX_ACCESS_LIST} peer ids",
                    "Fix the list.",
                )
            for pid in value:
                if not isinstance(pid, str) or not PEER_ID_RE.fullmatch(pid):
                    raise reject(
                        f"{s}.{name}",
                        pid,
                        "each entry must be a base58 libp2p peer id",
                        "Copy ids from `swarm status`.",
                    )
            set_field(self, name, tuple(sorted(set(value))))


@dataclass(frozen=True, kw_only=True)
class PretrainedConfig:
    """Where a run's initial weights come from when it continues an existing checkpoint
    (``swarm init --from-pretrained DIR``, see swarm/run/pretrained.py). Left out of the spec (and its
    hash) when absent: the initial weights are then drawn from ``seed``."""

    _SECTION: ClassVar[str] = "pretrained"

    source: str
    """The checkpoint's name (its directory name), for people; peers check the digests, not this."""
    stage_digests: tuple[str, ...]
    """sha256 (64 hex chars) of each stage's initial weights, in stage order
    (``swarm.run.pretrained.stage_digest``): a peer starting a stage checks the weights it got against it."""
    tokenizer: str | None = field(default=None, metadata=OMIT_NONE)
    """sha256 of the checkpoint's tokenizer.json: trainers and ``swarm generate`` use that tokenizer
    (and refuse another file); None = the checkpoint came without one."""

    def __post_init__(self) -> None:
        s = self._SECTION
        source = self.source
        if not isinstance(source, str) or not 1 <= len(source) <= 200 or not source.isprintable():
            raise reject(
                f"{s}.source", source, "it must be 1-200 printable characters", "Name the checkpoint."
            )
        hint = "Let `swarm init --from-pretrained DIR` compute it; do not edit it by hand."
        digests = self.stage_digests
        if isinstance(digests, (str, bytes)) or not isinstance(digests, Sequence) or not digests:
            raise reject(f"{s}.stage_digests", digests, "it must be a list with one digest per stage", hint)
        for i, d in enumerate(digests):
            if not isinstance(d, str) or not SHA256_HEX_RE.fullmatch(d):
                raise reject(f"{s}.stage_digests[{i}]", d, "it must be 64 lowercase hex characters", hint)
        set_field(self, "stage_digests", tuple(digests))
        if self.tokenizer is not None and (
            not isinstance(self.tokenizer, str) or not SHA256_HEX_RE.fullmatch(self.tokenizer)
        ):
            raise reject(f"{s}.tokenizer", self.tokenizer, "it must be 64 lowercase hex characters", hint)
