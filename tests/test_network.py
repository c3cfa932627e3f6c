"""Address parsing, DHT config checks and identity files (swarm/dht/network.py); no sockets."""

from __future__ import annotations

import pytest

from swarm.dht.network import (
    INITIAL_PEER_EXAMPLE,
    LOOPBACK_HOST_MADDR,
    PUBLIC_HOST_MADDR,
    DHTConfig,
    local_signer,
    parse_maddrs,
    reachability_warning,
)
from swarm.errors import ConfigError

PEER = "QmWcs14zqAdEZtLLGwoFcCRp18SE78VmhZgGqmnVBuiRhz"
LOCAL = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"
REMOTE = f"/ip4/93.184.216.34/tcp/4001/p2p/{PEER}"  # a global address (never dialed here)


def test_parse_maddrs_accepts_lists_commas_and_spaces():
    assert parse_maddrs(LOCAL) == (LOCAL,)
    assert parse_maddrs([f"{LOCAL},{REMOTE}", f" {LOCAL} "]) == (LOCAL, REMOTE, LOCAL)
    assert parse_maddrs(f"/dns4/boot.example.org/tcp/31337/p2p/{PEER}") == (
        f"/dns4/boot.example.org/tcp/31337/p2p/{PEER}",
    )
    assert parse_maddrs([], what="x") == ()
    assert parse_maddrs(INITIAL_PEER_EXAMPLE) == (INITIAL_PEER_EXAMPLE,)  # the example we show is valid
    assert parse_maddrs("/ip4/0.0.0.0/tcp/31337", require_peer_id=False) == ("/ip4/0.0.0.0/tcp/31337",)


@pytest.mark.parametrize(
    "bad, rule",
    [
        ("/ip4/127.0.0.1/tcp/4001", "no /p2p/"),
        ("127.0.0.1:4001", "not a valid multiaddr"),
        ("/ip4/1.2.3/tcp/1/p2p/" + PEER, "not a valid multiaddr"),
        ("/ip4/127.0.0.1/tcp/4001/p2p/not-a-peer-id", "not a valid multiaddr"),
        ("/tcp/4001/p2p/" + PEER, "must start with"),
    ],
)
def test_parse_maddrs_explains_bad_initial_peers_with_an_example(bad, rule):
    with pytest.raises(ConfigError, match=rule) as info:
        parse_maddrs(bad, what="--initial-peers")
    message = str(info.value)
    assert bad in message and "--initial-peers" in message
    assert INITIAL_PEER_EXAMPLE in message or "swarm init" in message


def test_own_addresses_must_not_name_a_peer():
    with pytest.raises(ConfigError, match="without /p2p/"):
        parse_maddrs(LOCAL, what="host maddrs", require_peer_id=False)


def test_dht_config_defaults_and_public():
    cfg = DHTConfig()
    assert cfg.host_maddrs == (LOOPBACK_HOST_MADDR,) and cfg.initial_peers == () and not cfg.client_mode
    assert DHTConfig(public=True).host_maddrs == (PUBLIC_HOST_MADDR,)
    cfg = DHTConfig(initial_peers=[LOCAL], host_maddrs="/ip4/127.0.0.1/tcp/5000")
    assert cfg.initial_peers == (LOCAL,) and cfg.host_maddrs == ("/ip4/127.0.0.1/tcp/5000",)


def test_dht_config_refusals():
    with pytest.raises(ConfigError, match="not both"):
        DHTConfig(public=True, host_maddrs=("/ip4/127.0.0.1/tcp/5000",))
    with pytest.raises(ConfigError, match="port 0"):
        DHTConfig(announce_maddrs=("/ip4/198.51.100.20/tcp/0",))
    with pytest.raises(ConfigError, match="no /p2p/"):
        DHTConfig(initial_peers=("/ip4/127.0.0.1/tcp/4001",))
    with pytest.raises(ConfigError, match="client_mode"):
        DHTConfig(client_mode="yes")


def test_reachability_warning():
    assert reachability_warning([LOCAL], ["/ip4/127.0.0.1/tcp/5/p2p/" + PEER]) is None
    assert reachability_warning([REMOTE], ["/ip4/93.184.216.35/tcp/31337"]) is None
    warning = reachability_warning([REMOTE], ["/ip4/127.0.0.1/tcp/5", "/ip4/192.168.1.4/tcp/5"])
    assert warning and "--announce-maddrs" in warning and "192.168.1.4" in warning
    assert reachability_warning([f"/dns4/boot.example.org/tcp/1/p2p/{PEER}"], []) is not None


def test_identity_files_must_hold_an_rsa_key(tmp_path):
    from hivemind.proto import crypto_pb2

    from swarm.dht.network import _load_rsa_identity, _prepare_identity

    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"\xff\x00 not protobuf at all")
    with pytest.raises(ConfigError, match="not a libp2p private key|damaged"):
        _load_rsa_identity(str(garbage))
    ed = tmp_path / "ed25519.key"
    ed.write_bytes(
        crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"x" * 64).SerializeToString()
    )
    with pytest.raises(ConfigError, match="Ed25519"):
        _load_rsa_identity(str(ed))
    with pytest.raises(ConfigError, match="does not exist"):
        _prepare_identity(str(tmp_path / "missing-dir" / "id.key"))
    # A new path gets a fresh RSA identity, and loading it twice gives the same key.
    path, tmpdir = _prepare_identity(str(tmp_path / "id.key"))
    assert tmpdir is None
    first, second = _load_rsa_identity(path), _load_rsa_identity(path)
    assert first.get_public_key().to_bytes() == second.get_public_key().to_bytes()


def test_local_signer_requires_start_dht():
    with pytest.raises(ConfigError, match="start_dht"):
        local_signer(object())
