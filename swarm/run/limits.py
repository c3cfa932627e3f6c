"""Identifier rules and size limits that the spec, the DHT records and the peers share, written once.

Patterns are compiled and meant for ``fullmatch``. They sit in ``swarm/run`` (no imports, no torch)
because every layer that needs them (``swarm.dht``, ``peer``, the tools) may import it.
"""

from __future__ import annotations

import re

__all__ = ["RUN_ID_RE", "PEER_ID_RE", "SPEC_HASH_RE", "SHA256_HEX_RE", "MAX_SPEC_BYTES", "MAX_STAGES"]

RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A run id: it names DHT keys and hivemind averager prefixes, which must not contain '.'."""
PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")
"""A libp2p peer id in base58 (the alphabet without 0, O, I and l)."""
SPEC_HASH_RE = re.compile(r"[0-9a-f]{16}")
"""``RunSpec.spec_hash`` (also the shape of an access ``secret_check``): 16 lowercase hex chars."""
SHA256_HEX_RE = re.compile(r"[0-9a-f]{64}")
"""A sha256 digest in lowercase hex (the pretrained stage and tokenizer digests)."""

MAX_SPEC_BYTES = 16 * 1024
"""Largest run spec as JSON. A DHT value of ~45 KB crashes the DHT process (docs/HIVEMIND.md, "DHT");
real specs are well under 2 KB, so anything above this is refused before it is parsed or stored."""
MAX_STAGES = 256
"""Most stages of a run: every stage's key is spelled out in the DHT schema, which needs a bound."""
