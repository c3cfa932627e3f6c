"""Who may take part in a run: join secrets, HMAC proofs, replay protection, allow/deny lists, penalties.

Private runs (note "two planes")
--------------------------------
``swarm init RUN.yaml --private --secret-file PATH`` draws a random 256-bit *join secret*, writes it
to PATH (mode 0600) and publishes a spec whose ``access`` section says ``private: true`` plus a
``secret_check`` (an HMAC of the run id under the secret; it lets a joiner with a wrong secret fail
at once with a clear message, and reveals nothing usable: the secret is 256 random bits). The spec
itself stays readable by anyone who can reach the DHT: it holds model sizes and hyper-parameters,
never the secret, and joiners need it to learn that the run is private.

Every holder of the secret proves it on both planes:

- **DHT**: a peer record (and a trainer's progress record) carries ``auth_exp`` (unix seconds) and
  ``auth`` = HMAC-SHA256(secret, "dht" | run | peer id | auth_exp). Readers drop records without a
  valid, unexpired proof (``RunAuth.check_record``), so an outsider never appears in stage lists.
  The proof names the peer id, and hivemind's RSA signature validator ties the record to that peer
  id's key, so copying an insider's proof into one's own record does not work.
- **RPC**: every request header carries ``auth`` = {``ts`` (ms), ``n`` (16-byte nonce), ``mac``},
  the MAC covering the handler name, sender and receiver peer ids (the sender id is the one libp2p
  authenticated for the stream), ``ts``, the nonce and the rest of the header, which includes the
  payload's sha256. A receiver checks it right after reading the small header, before reading the
  payload or decoding anything (``RunAuth.check_request``); a timestamp outside ``window_s`` or a
  nonce seen before (bounded cache) is refused as a replay.

State downloads and averaging go through hivemind's averager, whose RPCs we cannot extend; there
the caller's peer id must belong to a stage peer with a valid DHT proof (see ``peer/averaging.py``).

Public runs may still publish ``access.allow`` (only these peer ids) or ``access.deny`` (never these)
in the signed spec; both planes apply them the same way.

``PenaltyBox`` ignores a sender for a while after it sent poison (NaN/Inf or absurd gradients). (The
per-sender queue cap, ``SenderLimiter``, is admission control and lives in ``peer/admission.py``.)
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import math
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from swarm.errors import ConfigError, RecordError, RequestError

if TYPE_CHECKING:
    from swarm.run.spec import RunSpec

__all__ = [
    "SECRET_ENV",
    "SECRET_BYTES",
    "AuthError",
    "generate_secret",
    "parse_secret",
    "format_secret",
    "write_secret_file",
    "read_secret_file",
    "load_secret",
    "secret_check",
    "RunAuth",
    "PenaltyBox",
]

SECRET_ENV = "SWARMPIPE_SECRET"
SECRET_BYTES = 32
_SECRET_PREFIX = "swsec1_"
_MAX_NONCES = 1 << 16


class AuthError(RequestError):
    """A request or record lacks a valid proof of the run's join secret, or its sender is not allowed."""


# ------------------------------------------------------------------------------------------ secrets


def generate_secret() -> bytes:
    """A fresh random join secret (256 bits from the OS's CSPRNG)."""
    return secrets.token_bytes(SECRET_BYTES)


def format_secret(secret: bytes) -> str:
    """The printable form: ``swsec1_`` + 64 hex digits (the prefix makes a pasted value recognisable)."""
    return _SECRET_PREFIX + secret.hex()


def parse_secret(text: str) -> bytes:
    """Parse what ``format_secret`` printed (surrounding whitespace ignored); ``ConfigError`` otherwise."""
    value = text.strip()
    body = value[len(_SECRET_PREFIX) :] if value.startswith(_SECRET_PREFIX) else ""
    try:
        secret = bytes.fromhex(body)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise ConfigError(
            f"the join secret must be '{_SECRET_PREFIX}' followed by {2 * SECRET_BYTES} hex digits "
            f"(got {len(value)} characters starting {value[:10]!r}); copy it exactly as `swarm init "
            "--private` printed it or use the --secret-file it wrote"
        )
    return secret


def write_secret_file(path: str | os.PathLike[str], secret: bytes) -> None:
    """Create ``path`` with mode 0600 holding the secret; refuses to overwrite an existing file."""
    try:
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"secret file {os.fspath(path)!r} already exists; refusing to overwrite it"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(format_secret(secret) + "\n")


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """Read a secret file, refusing one that other users may read (it would leak the run)."""
    p = os.fspath(path)
    if p.strip().startswith(_SECRET_PREFIX):  # never echo a secret back into logs or terminals
        raise ConfigError(
            f"--secret-file takes the path of a file holding the secret, not the secret itself (it would "
            f"show in `ps` and shell history); write it to a file with mode 0600 or set {SECRET_ENV}"
        )
    try:
        mode = os.stat(p).st_mode
        with open(p) as f:
            text = f.read(4096)
    except OSError as e:
        raise ConfigError(f"cannot read the secret file {p!r}: {e.strerror}; check --secret-file") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"secret file {p!r} has mode {stat.S_IMODE(mode):04o}: others may read the join secret; "
            f"run `chmod 600 {p}` first"
        )
    return parse_secret(text)


def load_secret(secret_file: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The join secret from ``secret_file`` if given, else from ``$SWARMPIPE_SECRET``, else None."""
    if secret_file:
        return read_secret_file(secret_file)
    env = os.environ if environ is None else environ
    value = env.get(SECRET_ENV)
    return parse_secret(value) if value else None


def _mac(secret: bytes, *parts: bytes | str) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        b = part.encode() if isinstance(part, str) else part
        h.update(len(b).to_bytes(4, "big"))  # length-prefixed: no ambiguity between adjacent fields
        h.update(b)
    return h.digest()


def secret_check(secret: bytes, run_id: str) -> str:
    """16 hex chars that the spec publishes so a joiner can tell a wrong secret from a right one."""
    return _mac(secret, "swarmpipe-check-v1", run_id).hex()[:16]


# ---------------------------------------------------------------------------------------- RunAuth


@dataclass(frozen=True)
class _Lists:
    allow: frozenset[str]
    deny: frozenset[str]


class RunAuth:
    """The access rules of one run, and this process's means to prove and check membership.

    ``secret`` None means a public run (no proofs; allow/deny lists still apply). Thread-safe for
    the ways it is used: proofs are pure; the nonce cache is touched only from the event loop.
    ``clock`` is injectable so replay windows are tested without sleeping.
    """

    def __init__(
        self,
        run_id: str,
        *,
        secret: bytes | None = None,
        allow: Iterable[str] = (),
        deny: Iterable[str] = (),
        window_s: float = 60.0,
        proof_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if secret is not None and len(secret) != SECRET_BYTES:
            raise ConfigError(f"a join secret has {SECRET_BYTES} bytes, got {len(secret)}")
        self.run_id = run_id
        self._secret = secret
        self.lists = _Lists(frozenset(allow), frozenset(deny))
        self.window_s = float(window_s)
        self.proof_ttl_s = float(proof_ttl_s)
        self.clock = clock
        self._nonces: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self.refused: collections.Counter[str] = collections.Counter()

    @classmethod
    def from_spec(cls, spec: RunSpec, secret: bytes | None, **kwargs: Any) -> RunAuth:
        """The rules the spec publishes; a private run needs the right secret (``ConfigError`` otherwise)."""
        access = spec.access
        if access is None:
            return cls(spec.run_id, **kwargs)
        if access.private:
            if secret is None:
                raise ConfigError(
                    f"run {spec.run_id!r} is private: pass --secret-file PATH (the file `swarm init "
                    f"--private` wrote) or set {SECRET_ENV}"
                )
            if not hmac.compare_digest(secret_check(secret, spec.run_id), access.secret_check or ""):
                raise ConfigError(
                    f"the join secret does not match run {spec.run_id!r} (its spec publishes check "
                    f"{access.secret_check}); ask the run's owner for the current secret file"
                )
        return cls(
            spec.run_id,
            secret=secret if access.private else None,
            allow=access.allow,
            deny=access.deny,
            **kwargs,
        )

    @property
    def private(self) -> bool:
        return self._secret is not None

    @property
    def gated(self) -> bool:
        """True when some peer ids are refused (private run, or an allow/deny list)."""
        return self.private or bool(self.lists.allow) or bool(self.lists.deny)

    def peer_allowed(self, peer_id: str) -> bool:
        """The allow/deny lists only (no proof): deny wins; an empty allow list allows everyone."""
        if peer_id in self.lists.deny:
            return False
        return not self.lists.allow or peer_id in self.lists.allow

    # ---------------------------------------------------------------------------- DHT proofs

    def record_proof(self, peer_id: str) -> dict[str, Any]:
        """Fields to add to this peer's DHT record (empty in a public run)."""
        if self._secret is None:
            return {}
        exp = int(self.clock() + self.proof_ttl_s)
        return {"auth_exp": exp, "auth": _mac(self._secret, "dht", self.run_id, peer_id, str(exp))}

    def check_record(self, peer_id: str, value: Mapping[str, Any]) -> None:
        """Raise ``RecordError`` unless the record of ``peer_id`` may be used (lists and proof)."""
        if not self.peer_allowed(peer_id):
            raise RecordError(f"peer {peer_id} is not allowed in run {self.run_id!r} (allow/deny list)")
        if self._secret is None:
            return
        exp, proof = value.get("auth_exp"), value.get("auth")
        if isinstance(exp, bool) or not isinstance(exp, int) or not isinstance(proof, bytes):
            raise RecordError(f"record of {peer_id} carries no join proof; run {self.run_id!r} is private")
        now = self.clock()
        if exp < now or exp > now + self.proof_ttl_s + self.window_s:
            raise RecordError(f"join proof of {peer_id} expires at {exp}, outside [now, now + ttl]")
        if not hmac.compare_digest(proof, _mac(self._secret, "dht", self.run_id, peer_id, str(exp))):
            raise RecordError(f"join proof of {peer_id} is invalid: it was not made with this run's secret")

    # ---------------------------------------------------------------------------------- RPCs

    def _request_mac(
        self, name: str, sender: str, receiver: str, ts: int, nonce: bytes, header: dict
    ) -> bytes:
        assert self._secret is not None
        body = hashlib.sha256(msgpack.packb(header, use_bin_type=True)).digest()
        return _mac(self._secret, "rpc", self.run_id, name, sender, receiver, str(ts), nonce, body)

    def sign_request(self, name: str, sender: str, receiver: str, header: dict[str, Any]) -> dict[str, Any]:
        """``header`` plus an ``auth`` field (a copy; unchanged in a public run).

        The header must already hold ``payload_bytes`` and ``payload_sha256`` (``protocol.call`` adds them).
        """
        if self._secret is None:
            return header
        ts = int(self.clock() * 1000)
        nonce = secrets.token_bytes(16)
        clean = {k: v for k, v in header.items() if k != "auth"}
        return {
            **clean,
            "auth": {
                "ts": ts,
                "n": nonce,
                "mac": self._request_mac(name, sender, receiver, ts, nonce, clean),
            },
        }

    def check_request(self, name: str, sender: str, receiver: str, header: dict[str, Any]) -> None:
        """Raise ``AuthError`` unless ``sender`` may call ``name`` with this (fresh) header."""
        if not self.peer_allowed(sender):
            self.refused["listed"] += 1
            raise AuthError(f"peer {sender} is not allowed in run {self.run_id!r} (allow/deny list)")
        if self._secret is None:
            return
        auth = header.get("auth")
        if not isinstance(auth, dict):
            self.refused["no_proof"] += 1
            raise AuthError(
                f"run {self.run_id!r} is private and this request carries no join proof; start the "
                f"sender with --secret-file or {SECRET_ENV}"
            )
        ts, nonce, mac = auth.get("ts"), auth.get("n"), auth.get("mac")
        if (
            isinstance(ts, bool)
            or not isinstance(ts, int)
            or not isinstance(nonce, bytes)
            or len(nonce) != 16
            or not isinstance(mac, bytes)
            or not isinstance(header.get("payload_sha256"), bytes)
        ):
            self.refused["malformed"] += 1
            raise AuthError(
                "the request's join proof is malformed (needs ts, 16-byte n, mac, payload_sha256)"
            )
        now = self.clock()
        if not math.isfinite(ts) or abs(ts / 1000 - now) > self.window_s:
            self.refused["stale"] += 1
            raise AuthError(
                f"request timestamp is {ts / 1000 - now:+.0f} s from this peer's clock, outside "
                f"+-{self.window_s:.0f} s: a replay, or a clock that needs NTP"
            )
        clean = {k: v for k, v in header.items() if k != "auth"}
        if not hmac.compare_digest(mac, self._request_mac(name, sender, receiver, ts, nonce, clean)):
            self.refused["bad_mac"] += 1
            raise AuthError(f"the request's join proof is invalid for run {self.run_id!r} (wrong secret?)")
        self._remember(nonce, now)

    def gate(self, receiver: str, penalties: PenaltyBox | None = None) -> Callable[[str, str, dict], None]:
        """A ``swarm.wire.protocol.serve`` gate for the node ``receiver``: penalties, lists, then the proof."""

        def check(name: str, sender: str, header: dict[str, Any]) -> None:
            if penalties is not None:
                penalties.check(sender)
            self.check_request(name, sender, receiver, header)

        return check

    def _remember(self, nonce: bytes, now: float) -> None:
        while self._nonces and next(iter(self._nonces.values())) < now - self.window_s:
            self._nonces.popitem(last=False)
        if nonce in self._nonces:
            self.refused["replay"] += 1
            raise AuthError("this request was seen before (same nonce): a replay; refused")
        if len(self._nonces) >= _MAX_NONCES:
            self.refused["busy"] += 1
            raise AuthError(
                f"over {_MAX_NONCES} authenticated requests in {self.window_s:.0f} s; retry later"
            )
        self._nonces[nonce] = now


# ------------------------------------------------------------------------------ penalties, floods


class PenaltyBox:
    """Senders that sent poison are ignored for ``penalty_s`` seconds (bounded number of entries)."""

    def __init__(
        self, penalty_s: float = 30.0, *, max_entries: int = 4096, clock: Callable[[], float] = time.monotonic
    ):
        self.penalty_s = penalty_s
        self.max_entries = max_entries
        self.clock = clock
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.penalized = 0

    def penalize(self, peer_id: str) -> None:
        self._until.pop(peer_id, None)
        self._until[peer_id] = self.clock() + self.penalty_s
        self.penalized += 1
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def check(self, peer_id: str) -> None:
        """Raise ``AuthError`` while ``peer_id`` is being ignored."""
        until = self._until.get(peer_id)
        if until is None:
            return
        left = until - self.clock()
        if left <= 0:
            del self._until[peer_id]
            return
        raise AuthError(f"peer {peer_id} sent invalid gradients and is ignored for another {left:.0f} s")
