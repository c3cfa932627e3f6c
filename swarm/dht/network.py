"""Joining the swarm's DHT: addresses, identities, validators. The one place a DHT is created.

(Over 400 lines on purpose: addresses, config, identity and the daemon's sockets are all inputs of
``start_dht``, the one place a DHT is created.)

Every process of a swarm (bootstrap, stage peer, trainer, status) calls ``start_dht(DHTConfig(...))``.
Doing it in one place matters because hivemind nodes validate what other nodes ask them to store
and return: nodes with different validators would disagree about which records exist. Every node
gets the same two validators:

- ``RSASignatureValidator`` with the node's own RSA key, so a subkey carrying an ``[owner:...]``
  marker can only be written by that key's holder (see ``swarm/dht/records.py``);
- ``SchemaValidator`` with ``records.RegistryKeysSchema`` (``allow_extra_keys=True``, so averager
  and other keys pass through). The per-run schema (``records.RunKeysSchema``) is added by
  ``Membership`` once the run id is known, the same way in every process.

The RSA key of the validator is also the node's libp2p identity: ``start_dht`` generates (or loads
from ``identity_path``) an RSA identity file and gives p2pd the same key. So a record's ``peer_id``
can be checked against the key that signed its subkey, and nobody can announce records for a peer
id that is not theirs. Without ``identity_path`` the key is fresh for each start and its temporary
file is deleted once the daemon has read it.

Multiaddrs typed by users go through ``parse_maddrs``, which validates them with the ``multiaddr``
package and explains the expected shape with an example.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarm.dht.processes import SOCKET_PREFIX_ENV
from swarm.dht.records import KEY_PREFIX, RegistryKeysSchema, peer_id_of_subkey
from swarm.errors import ConfigError, PeerFailure

if TYPE_CHECKING:  # hivemind takes seconds to import; only the functions that start a DHT need it
    import hivemind
    from hivemind.utils.crypto import RSAPrivateKey

# Note "idle control plane" (BENCHMARKS.md "Control plane", session 15): an idle swarm's DHT traffic is
# RPCs, each a libp2p stream of its own (~1.3 KB on the wire whatever it carries). Counted in an idle
# swarm of 4 stage peers (benchmarks/dht_rpcs.py): every store made ~5 ``rpc_find`` and 4 ``rpc_store``.
DHT_NUM_REPLICAS = 3
"""Nodes that store each value (hivemind's default 5). Every store sends one ``rpc_store`` per replica
besides itself, and every record of ours is stored again by its writer well before it expires (a peer
record every 15 s, living 45 s; spec and registry every 30 s; progress every 15 s), so a value needs to
survive only the departures of one refresh period. Reads ask for the latest value (``latest=True``),
which walks the whole beam of nodes nearest the key, so they find any replica. Measured (idle swarm):
stores 4 -> 2-3 ``rpc_store`` each; a writer that is not itself among the 3 nodes nearest the key made
~4 more ``rpc_find`` per store than one that is (cause not found), which eats part of the saving. Trades:
a value is lost when all 3 holders leave within one refresh period (it comes back with the writer's
next store), instead of all 5."""
DHT_STORE_BEAM = DHT_NUM_REPLICAS
"""How many nodes a store of ours walks to find the ``DHT_NUM_REPLICAS`` nearest the key (hivemind's
default is its ``bucket_size``, 20: in a swarm of fewer nodes a store visited every node with an
``rpc_find`` before it stored on 3 of them). A walk of the 3 nearest is a Kademlia lookup with k = 3:
it starts from the nodes nearest the key in this node's routing table and visits them nearest first,
following any nearer node they name. Reads keep hivemind's full beam, so a value a store put on a node
that is not quite among the nearest (a routing table that missed a node that just joined) is still
read, and the next refresh stores it on the right ones. Measured: 2 ``rpc_find`` fewer per store.
Trades: none for what reads return; on the averager's stores (its donor declarations, hivemind's own
calls) it does not apply."""
DHT_CACHE_NEAREST = 0
"""Nodes a read pushes the value it found to (hivemind's default 1: an extra ``rpc_store`` after a read
that found a value newer than the copies it saw, 3-6 a minute in the idle swarm, more while trainers
read). Such a cached copy only serves reads that accept any unexpired value; every read of ours, and
the averager's matchmaking and donor reads, ask for the latest one. Trades nothing here."""


__all__ = [
    "DHT_NUM_REPLICAS",
    "DHT_STORE_BEAM",
    "DHT_CACHE_NEAREST",
    "LOOPBACK_HOST_MADDR",
    "PUBLIC_HOST_MADDR",
    "INITIAL_PEER_EXAMPLE",
    "DHTConfig",
    "LocalSigner",
    "start_dht",
    "get_latest_many",
    "local_signer",
    "visible_maddrs",
    "parse_maddrs",
    "reachability_warning",
]

LOOPBACK_HOST_MADDR = "/ip4/127.0.0.1/tcp/0"
PUBLIC_HOST_MADDR = "/ip4/0.0.0.0/tcp/0"
# A well-formed initial peer (documentation address range, a real-shaped peer id) for error messages.
INITIAL_PEER_EXAMPLE = "/ip4/203.0.113.7/tcp/31337/p2p/QmWcs14zqAdEZtLLGwoFcCRp18SE78VmhZgGqmnVBuiRhz"


# ------------------------------------------------------------------------------------- multiaddrs


def parse_maddrs(
    values: str | Iterable[str], *, what: str = "--initial-peers", require_peer_id: bool = True
) -> tuple[str, ...]:
    """Validate user-given multiaddrs and return them normalised.

    ``values`` is one string or several; each string may hold several addresses separated by
    commas or whitespace (so ``--initial-peers "A,B"`` and ``--initial-peers A B`` both work).
    ``require_peer_id`` (on for initial peers) demands a ``/p2p/<peer id>`` part: libp2p only
    connects to a peer whose id it knows. Raises ``ConfigError`` naming the bad value, with an example.
    """
    import multiaddr
    import multiaddr.exceptions

    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        if not isinstance(value, str):
            raise ConfigError(
                f"{what}: {value!r} is not a string; give multiaddrs like {INITIAL_PEER_EXAMPLE}"
            )
        for item in value.replace(",", " ").split():
            example = INITIAL_PEER_EXAMPLE if require_peer_id else LOOPBACK_HOST_MADDR
            try:
                ma = multiaddr.Multiaddr(item)
                names = [p.name for p in ma.protocols()]
            except (multiaddr.exceptions.Error, ValueError, TypeError) as e:
                raise ConfigError(
                    f"{what}: {item!r} is not a valid multiaddr ({e}); "
                    f"expected something like {example} (copy it from the output of `swarm init`)"
                ) from None
            if not names or names[0] not in ("ip4", "ip6", "dns", "dns4", "dns6"):
                raise ConfigError(
                    f"{what}: {item!r} must start with /ip4/, /ip6/ or /dns*/ (an address), e.g. {example}"
                )
            has_peer_id = "p2p" in names or "ipfs" in names
            if require_peer_id and not has_peer_id:
                raise ConfigError(
                    f"{what}: {item!r} has no /p2p/<peer id> part; libp2p needs the peer id to connect. "
                    f"Use the full address printed by `swarm init`, e.g. {INITIAL_PEER_EXAMPLE}"
                )
            if not require_peer_id and has_peer_id:
                raise ConfigError(
                    f"{what}: {item!r} names a peer id; listen/announce addresses are this node's own, "
                    f"without /p2p/, e.g. {LOOPBACK_HOST_MADDR}"
                )
            out.append(str(ma))
    return tuple(out)


def _ip_of(maddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(parts[2])
        except ValueError:
            return None
    return None


def _is_public(maddr: str) -> bool:
    """True for global IPs and DNS names (a name is presumably reachable from elsewhere)."""
    ip = _ip_of(maddr)
    if ip is None:
        return maddr.startswith(("/dns/", "/dns4/", "/dns6/"))
    return ip.is_global


def reachability_warning(initial_peers: Sequence[str], announce: Sequence[str]) -> str | None:
    """A warning when this node joins peers on the internet but only announces local addresses.

    ``announce`` is what other peers will dial: the node's ``announce_maddrs``, or its
    ``visible_maddrs`` when none were given. If an initial peer is public and none of these is,
    remote peers cannot reach us (the symptom: peers join but never send us requests).
    """
    if not any(_is_public(m) for m in initial_peers):
        return None
    if any(_is_public(m) for m in announce):
        return None
    shown = ", ".join(announce) if announce else "(none)"
    return (
        f"the initial peers are on the internet, but this node only announces local addresses ({shown}); "
        "remote peers will not be able to connect to it. Listen on all interfaces with --public and "
        "announce your public address with --announce-maddrs /ip4/<PUBLIC_IP>/tcp/<PORT> "
        "(forward that port to this machine), or run as a client that only dials out."
    )


# ------------------------------------------------------------------------------------ DHT config


def _as_tuple(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class DHTConfig:
    """How a process joins the swarm's DHT (checked in ``__post_init__``; CLI flags map 1:1)."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs with /p2p/ of peers already in the swarm; empty = start a new swarm (a bootstrap)."""
    host_maddrs: tuple[str, ...] = (LOOPBACK_HOST_MADDR,)
    """Where to listen. Port 0 = any free port. The default is loopback only (this machine)."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses other peers should dial (e.g. a public IP behind NAT, explicit port); empty = automatic."""
    identity_path: str | None = None
    """RSA identity file for a stable peer id (created if missing); None = a fresh id per start."""
    client_mode: bool = False
    """Only dial out, never accept connections (for trainers/status behind NAT); stores nothing for others."""
    public: bool = False
    """Convenience: listen on all interfaces (``/ip4/0.0.0.0/tcp/0``) instead of loopback."""
    start: bool = True
    """Start the DHT process right away (False: the caller calls ``dht.run_in_background()``)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "initial_peers", parse_maddrs(_as_tuple(self.initial_peers), what="initial peers"))
        hosts = parse_maddrs(_as_tuple(self.host_maddrs), what="host maddrs", require_peer_id=False)
        if self.public:
            if hosts not in ((), (LOOPBACK_HOST_MADDR,), (PUBLIC_HOST_MADDR,)):
                raise ConfigError(
                    f"public=True listens on {PUBLIC_HOST_MADDR}, but host maddrs {list(hosts)} were also "
                    "given; pass one of them (--public or --host-maddrs), not both"
                )
            hosts = (PUBLIC_HOST_MADDR,)
        if not hosts:
            hosts = (LOOPBACK_HOST_MADDR,)
        set_(self, "host_maddrs", hosts)
        announce = parse_maddrs(
            _as_tuple(self.announce_maddrs), what="announce maddrs", require_peer_id=False
        )
        for maddr in announce:
            parts = maddr.split("/")
            if "tcp" in parts and parts[parts.index("tcp") + 1 :][:1] == ["0"]:
                raise ConfigError(
                    f"announce maddrs: {maddr!r} has port 0; others must dial a fixed port. Listen on a fixed "
                    "port (--host-maddrs /ip4/0.0.0.0/tcp/31337) and announce the same port"
                )
        set_(self, "announce_maddrs", announce)
        if self.identity_path is not None:
            if not isinstance(self.identity_path, str | os.PathLike) or not os.fspath(self.identity_path):
                raise ConfigError(f"identity_path={self.identity_path!r} must be a file path or None")
            set_(self, "identity_path", os.fspath(self.identity_path))
        for name in ("client_mode", "public", "start"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")


# ---------------------------------------------------------------------------------- identity


@dataclass(frozen=True)
class LocalSigner:
    """The RSA key a DHT node signs with, its ``[owner:...]`` marker and its libp2p peer id."""

    private_key: RSAPrivateKey = field(repr=False)
    marker: bytes = field(repr=False)
    peer_id: str


# DHT object -> its signer; lets Membership find the key of a DHT made by start_dht.
_SIGNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _load_rsa_identity(path: str) -> RSAPrivateKey:
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    try:
        with open(path, "rb") as f:
            message = crypto_pb2.PrivateKey.FromString(f.read())
    except OSError as e:
        raise ConfigError(f"cannot read identity file {path!r} ({e.strerror or e}); check the path") from e
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError type
        raise ConfigError(
            f"identity file {path!r} is not a libp2p private key ({type(e).__name__}); "
            "pass another path and a new identity will be created there"
        ) from e
    if message.key_type != crypto_pb2.KeyType.RSA:
        raise ConfigError(
            f"identity file {path!r} holds a {crypto_pb2.KeyType.Name(message.key_type)} key; swarmpipe "
            "binds DHT records to RSA identities. Pass another path and a new RSA identity is created there"
        )
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    try:
        key.__setstate__({"_private_key": message.data})  # RSAPrivateKey's own unpickling: DER bytes
    except ValueError as e:
        raise ConfigError(f"identity file {path!r} holds a damaged RSA key ({e}); pass another path") from e
    return key


def _prepare_identity(identity_path: str | None) -> tuple[str, str | None]:
    """Return (identity file to give p2pd, temporary directory to delete afterwards or None)."""
    from hivemind.p2p import P2P

    if identity_path is None:
        tmpdir = tempfile.mkdtemp(prefix="swarmpipe-identity-")
        path = os.path.join(tmpdir, "identity.key")
        P2P.generate_identity(path)
        return path, tmpdir
    if not os.path.exists(identity_path):
        parent = os.path.dirname(os.path.abspath(identity_path))
        if not os.path.isdir(parent):
            raise ConfigError(
                f"cannot create identity file {identity_path!r}: directory {parent!r} does not exist; create it first"
            )
        P2P.generate_identity(identity_path)
    return identity_path, None


def _apply_socket_prefix() -> None:
    """Name hivemind's unix sockets ``$SWARMPIPE_SOCKET_PREFIX<p2pd|p2pclient>-<id>.sock`` if set.

    hivemind puts them at ``/tmp/hivemind-*.sock`` and a SIGKILLed process cannot remove its own;
    the test suite sets a per-session prefix so that it can find (and fail on) the files its own
    processes leave behind. Must stay under /tmp-like short paths (unix socket paths have ~100 chars).
    """
    prefix = os.environ.get(SOCKET_PREFIX_ENV)
    if prefix:
        from hivemind.p2p import P2P

        if not prefix.startswith("/") or len(prefix) > 60:
            raise ConfigError(
                f"{SOCKET_PREFIX_ENV}={prefix!r} must be an absolute path prefix of at most 60 chars"
            )
        P2P._UNIX_SOCKET_PREFIX = "/unix" + prefix  # read when a P2P (daemon or replica) starts


@functools.lru_cache(maxsize=1)
def _dht_class() -> type:
    """``hivemind.DHT`` whose forked process (and its ``p2pd``) exits when the process that started it
    dies, even by SIGKILL (``swarm.dht.processes.exit_with_parent``)."""
    import hivemind

    from swarm.dht.processes import exit_with_parent

    class _DHT(hivemind.DHT):
        def run(self) -> None:  # runs in the DHT's own process
            exit_with_parent()
            super().run()

    return _DHT


def start_dht(cfg: DHTConfig) -> hivemind.DHT:
    """Start (or create, if ``cfg.start`` is False) this process's DHT node with the swarm's validators.

    Raises ``ConfigError`` for a bad identity file and ``PeerFailure`` when the initial peers cannot
    be reached (the daemon refuses to start without any of them). Callers own the returned DHT and
    must call ``dht.shutdown()`` in ``finally``.
    """
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    _apply_socket_prefix()
    identity_file, tmpdir = _prepare_identity(cfg.identity_path)
    try:
        key = _load_rsa_identity(identity_file)
        rsa_validator = RSASignatureValidator(key)
        signer = LocalSigner(
            private_key=key,
            marker=rsa_validator.local_public_key,
            peer_id=peer_id_of_subkey(rsa_validator.local_public_key),
        )
        validators = [
            rsa_validator,
            SchemaValidator(RegistryKeysSchema, prefix=KEY_PREFIX, allow_extra_keys=True),
        ]
        try:
            dht = _dht_class()(
                initial_peers=list(cfg.initial_peers) or None,
                start=cfg.start,
                host_maddrs=list(cfg.host_maddrs),
                announce_maddrs=list(cfg.announce_maddrs) or None,
                identity_path=identity_file,
                # A fresh random key cannot be in use; a user's file may be (a second copy running).
                check_if_identity_free=tmpdir is None,
                client_mode=cfg.client_mode,
                record_validators=validators,
                # Every read of ours asks for the latest value (``latest=True``), which hivemind's cache
                # cannot answer; refreshing cached keys before they expire only re-fetched them in the
                # background, on every node that had read them (benchmarks/control_plane.py measures it).
                cache_refresh_before_expiry=0,
                num_replicas=DHT_NUM_REPLICAS,
                cache_nearest=DHT_CACHE_NEAREST,
            )
        except P2PDaemonError as e:
            raise _daemon_failure(e, cfg) from e
    finally:
        if tmpdir is not None and cfg.start:
            shutil.rmtree(tmpdir, ignore_errors=True)
    if tmpdir is not None and not cfg.start:
        weakref.finalize(dht, shutil.rmtree, tmpdir, ignore_errors=True)
    _SIGNERS[dht] = signer
    _remove_replica_sockets_on_shutdown(dht)
    if cfg.start and dht.peer_id.to_base58() != signer.peer_id:
        dht.shutdown()
        raise AssertionError("p2pd did not take the RSA identity it was given")  # an invariant of this module
    return dht


async def get_latest_many(_dht: Any, node: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """The latest value of each of ``keys`` (None where none is found), in one walk of the DHT: run it in
    the DHT's process with ``dht.run_coroutine(functools.partial(get_latest_many, keys=...))``.

    Note "one walk for several keys" (note "idle control plane"): ``dht.get(key, latest=True)`` per key
    walks the nodes nearest each key separately, one ``rpc_find`` per node and key; hivemind's
    ``get_many`` walks them for all keys at once and packs up to sqrt(len(keys)) keys into each
    ``rpc_find`` (2 of a trainer's 4 stage keys), answering the same values and expirations. A module-level
    function: ``run_coroutine`` pickles it by reference into the DHT's process."""
    return await node.get_many(list(keys), sufficient_expiration_time=float("inf"))


def _daemon_failure(e: Exception, cfg: DHTConfig) -> ConfigError | PeerFailure:
    """What p2pd's refusal to start means for the user: an unreachable initial peer, an identity in
    use, or the daemon's own message."""
    if "bootstrap" in str(e) and cfg.initial_peers:
        return PeerFailure(
            f"could not reach any initial peer {list(cfg.initial_peers)} ({e}); check that the "
            "node behind that address (e.g. `swarm init`) is running and that the address is the "
            "one it printed"
        )
    if "already taken" in str(e):
        return ConfigError(
            f"identity {cfg.identity_path!r} is already used by a running peer; "
            "each process needs its own identity file"
        )
    return PeerFailure(f"the libp2p daemon failed to start: {e}")


def _remove_replica_sockets_on_shutdown(dht: hivemind.DHT) -> None:
    """Make ``dht.shutdown()`` also remove the socket files of this process's P2P replicas.

    A replica (``dht.replicate_p2p()``) that serves handlers listens on its own unix socket file in
    /tmp, which only its ``shutdown()`` removes; callers that just stop the DHT (the daemon, after
    which the replica is useless anyway) would leave one file per replica behind. Only this
    process's object is patched: the DHT's own process was forked before (or forks without calling
    these).
    """
    replicas: list[Any] = []
    replicate, shutdown = dht.replicate_p2p, dht.shutdown

    async def replicate_p2p() -> Any:
        p2p = await replicate()
        replicas.append(p2p)
        return p2p

    def shutdown_and_clean() -> None:
        try:
            shutdown()
        finally:
            for p2p in replicas:
                with contextlib.suppress(FileNotFoundError, TypeError, KeyError, AttributeError):
                    os.remove(p2p._client_listen_maddr["unix"])
            replicas.clear()

    dht.replicate_p2p = replicate_p2p  # type: ignore[method-assign]
    dht.shutdown = shutdown_and_clean  # type: ignore[method-assign]


def local_signer(dht: hivemind.DHT) -> LocalSigner:
    """The signing key of a DHT created by ``start_dht``; ``ConfigError`` for any other DHT."""
    try:
        return _SIGNERS[dht]
    except (KeyError, TypeError):
        raise ConfigError(
            "this DHT was not created by swarm.dht.network.start_dht, so its records cannot be signed "
            "with its peer identity; create DHTs with start_dht(DHTConfig(...))"
        ) from None


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Addresses (with /p2p/) other peers can use as ``--initial-peers`` for this node."""
    return [str(m) for m in dht.get_visible_maddrs()]
