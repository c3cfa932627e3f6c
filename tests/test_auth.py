"""Unit tests of swarm/dht/auth.py (no sockets, no sleeping: clocks are injected)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat

import pytest

from peer.admission import SenderLimiter
from peer.averaging import _AuthorizedSet
from swarm.dht.auth import (
    SECRET_ENV,
    AuthError,
    PenaltyBox,
    RunAuth,
    format_secret,
    generate_secret,
    load_secret,
    parse_secret,
    read_secret_file,
    secret_check,
    write_secret_file,
)
from swarm.errors import ConfigError, RecordError, RequestError
from swarm.run.spec import AccessConfig, RunSpec

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
B = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


class Clock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _header(payload: bytes = b"abc") -> dict:
    return {
        "run_id": "r",
        "mb_id": "m",
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).digest(),
    }


def test_secret_round_trip_and_file_mode(tmp_path):
    secret = generate_secret()
    assert parse_secret(" " + format_secret(secret) + "\n") == secret
    path = tmp_path / "run.secret"
    write_secret_file(path, secret)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret_file(path) == secret
    with pytest.raises(ConfigError, match="already exists"):
        write_secret_file(path, generate_secret())
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_secret_file(path)
    with pytest.raises(ConfigError, match="hex digits"):
        parse_secret("swsec1_1234")
    assert load_secret(None, {SECRET_ENV: format_secret(secret)}) == secret
    assert load_secret(None, {}) is None


def test_record_proofs():
    clock = Clock()
    secret = generate_secret()
    auth = RunAuth("r", secret=secret, clock=clock)
    proof = auth.record_proof(A)
    auth.check_record(A, proof)
    with pytest.raises(RecordError, match="invalid"):
        auth.check_record(B, proof)  # another peer copying A's proof
    with pytest.raises(RecordError, match="invalid"):
        RunAuth("r", secret=generate_secret(), clock=clock).check_record(A, proof)
    with pytest.raises(RecordError, match="invalid"):
        RunAuth("other", secret=secret, clock=clock).check_record(A, proof)
    with pytest.raises(RecordError, match="no join proof"):
        auth.check_record(A, {})
    clock.t += auth.proof_ttl_s + 1
    with pytest.raises(RecordError, match="expires"):
        auth.check_record(A, proof)
    public = RunAuth("r")
    assert public.record_proof(A) == {}
    public.check_record(A, {})


def test_request_proofs_and_replays():
    clock = Clock()
    secret = generate_secret()
    sender, receiver = RunAuth("r", secret=secret, clock=clock), RunAuth("r", secret=secret, clock=clock)
    signed = sender.sign_request("fwd", A, B, _header())
    receiver.check_request("fwd", A, B, signed)
    with pytest.raises(AuthError, match="replay"):
        receiver.check_request("fwd", A, B, signed)
    for name, snd, rcv, header in [
        ("bwd", A, B, sender.sign_request("fwd", A, B, _header())),  # another handler
        ("fwd", B, B, sender.sign_request("fwd", A, B, _header())),  # another sender id
        ("fwd", A, A, sender.sign_request("fwd", A, B, _header())),  # another receiver
        ("fwd", A, B, {**sender.sign_request("fwd", A, B, _header()), "mb_id": "x"}),  # tampered header
        ("fwd", A, B, {**sender.sign_request("fwd", A, B, _header()), "payload_sha256": b"0" * 32}),
        (
            "fwd",
            A,
            B,
            RunAuth("r", secret=generate_secret(), clock=clock).sign_request("fwd", A, B, _header()),
        ),
    ]:
        with pytest.raises(AuthError, match="invalid"):
            receiver.check_request(name, snd, rcv, header)
    with pytest.raises(AuthError, match="no join proof"):
        receiver.check_request("fwd", A, B, _header())
    late = sender.sign_request("fwd", A, B, _header())
    clock.t += receiver.window_s + 1
    with pytest.raises(AuthError, match="outside"):
        receiver.check_request("fwd", A, B, late)
    assert receiver.refused["replay"] == 1 and receiver.refused["bad_mac"] == 6


def test_lists_apply_to_records_and_requests():
    auth = RunAuth("r", deny=[B])
    auth.check_request("fwd", A, "me", {})
    with pytest.raises(AuthError, match="not allowed"):
        auth.check_request("fwd", B, "me", {})
    with pytest.raises(RecordError, match="not allowed"):
        auth.check_record(B, {})
    only_a = RunAuth("r", allow=[A])
    assert only_a.peer_allowed(A) and not only_a.peer_allowed(B) and only_a.gated
    assert not RunAuth("r").gated


def test_from_spec_needs_the_right_secret():
    spec = RunSpec.from_yaml(os.path.join(EXAMPLES, "tiny.yaml"))
    secret = generate_secret()
    private = dataclasses.replace(
        spec, access=AccessConfig(private=True, secret_check=secret_check(secret, spec.run_id))
    )
    assert private.spec_hash != spec.spec_hash
    assert RunSpec.from_json(private.canonical_bytes()).access == private.access
    assert secret.hex() not in private.canonical_bytes().decode()  # the spec never holds the secret
    assert RunAuth.from_spec(private, secret).private
    with pytest.raises(ConfigError, match="is private"):
        RunAuth.from_spec(private, None)
    with pytest.raises(ConfigError, match="does not match"):
        RunAuth.from_spec(private, generate_secret())
    assert not RunAuth.from_spec(spec, secret).private  # a public run ignores a secret
    with pytest.raises(ConfigError, match="secret_check"):
        AccessConfig(private=True)
    with pytest.raises(ConfigError, match="peer id"):
        AccessConfig(deny=["not a peer id"])


def test_penalty_box_and_sender_limiter():
    clock = Clock(0.0)
    box = PenaltyBox(30.0, clock=clock)
    box.check(A)
    box.penalize(A)
    with pytest.raises(AuthError, match="ignored for another 30 s"):
        box.check(A)
    box.check(B)
    clock.t = 31.0
    box.check(A)
    limiter = SenderLimiter(2)
    limiter.acquire(A)
    limiter.acquire(A)
    with pytest.raises(RequestError, match="per-sender"):
        limiter.acquire(A)
    limiter.acquire(B)  # another sender is not slowed down
    limiter.release(A)
    limiter.acquire(A)
    assert limiter.held(A) == 2 and limiter.refused == 1


def test_authorized_set():
    s = _AuthorizedSet()
    assert s.allows(A)  # inactive: everyone
    s.set([A])
    assert s.allows(A) and not s.allows(B)
    s.set([])
    assert not s.allows(A)
    s.set(None)
    assert s.allows(B)


def test_init_private_writes_then_reuses_the_secret_file(tmp_path):
    from swarm.cli.commands.init import _make_private

    spec = RunSpec.from_yaml(os.path.join(EXAMPLES, "tiny.yaml"))
    path = str(tmp_path / "tiny.secret")
    private, secret, created = _make_private(spec, path)
    assert created and private.access.private and read_secret_file(path) == secret
    assert RunAuth.from_spec(private, secret).private
    again, secret2, created2 = _make_private(spec, path)  # a restarted owner keeps its run
    assert not created2 and secret2 == secret and again.spec_hash == private.spec_hash
    with pytest.raises(ConfigError, match="--secret-file"):
        _make_private(spec, None)
    with pytest.raises(ConfigError, match="needs a run spec"):
        _make_private(None, path)


def test_cli_flags_read_the_secret_file_not_the_command_line(tmp_path):
    import argparse

    from swarm.cli.commands import peer as peer_cmd
    from swarm.cli.commands import train as train_cmd

    secret = generate_secret()
    path = tmp_path / "s"
    write_secret_file(path, secret)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    peer_cmd.register(sub)
    train_cmd.register(sub)
    args = parser.parse_args(
        ["train", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run", "r", "--secret-file", str(path)]
    )
    assert train_cmd.config_from_args(args).secret == secret
    args = parser.parse_args(["peer", "--initial-peers", "x", "--run", "r", "--secret-file", str(path)])
    assert args.secret_file == str(path)
    # there is no flag that takes the secret itself: argparse reads `--secret` as --secret-file, and
    # a secret given as a path is refused without echoing it
    args = parser.parse_args(
        ["peer", "--initial-peers", "x", "--run", "r", "--secret", format_secret(secret)]
    )
    with pytest.raises(ConfigError, match="not the secret itself") as e:
        load_secret(args.secret_file)
    assert secret.hex() not in str(e.value)
