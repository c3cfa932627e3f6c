"""Sampling text from a run's current model, one token per trip through the swarm.

    swarm generate --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID --run demo --prompt "def " \\
        --max-new-tokens 80 --temperature 0.8

Each new token is one ``FORWARD`` in mode ``generate`` along a route drawn like a trainer's: the
last stage answers with a ``REPORT`` of kind ``result`` whose payload is the encoded logits of the
last position, ``(1, vocab)``. There is no key/value cache: every step re-sends the last
``seq_len`` tokens, which is simple and stateless for the peers (what matters here is watching
the swarm's model learn, not generation speed). A broken route is retried on a new one.
"""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swarm.client.routing import NoPeersError, Router, RoutingConfig
from swarm.errors import ConfigError, PeerFailure, RequestError, SwarmError
from swarm.train.data import load_tokenizer

if TYPE_CHECKING:
    from swarm.client.link import SwarmLink
    from swarm.wire.protocol import Report

__all__ = ["GenerateConfig", "sample_next", "generate", "generate_async"]


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    initial_peers: tuple[str, ...]
    run_id: str
    prompt: str
    max_new_tokens: int = 64
    """Tokens to sample after the prompt."""
    temperature: float = 0.8
    """Softmax temperature; 0 = always the most likely token (greedy)."""
    top_k: int | None = None
    """Sample only among the k most likely tokens; None = all."""
    seed: int = 0
    tokenizer: str | None = None
    """Local tokenizer.json matching the run's; None = bytes, or for a run that continues a checkpoint
    its tokenizer (the copy this machine remembers; see ``swarm.train.data.load_tokenizer``)."""
    step_timeout_s: float = 30.0
    """Seconds one token's trip through the swarm may take before it is retried elsewhere."""
    max_attempts: int = 3
    host_maddrs: tuple[str, ...] = ()
    spec_timeout_s: float = 30.0
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    secret: bytes | None = field(default=None, repr=False)
    """Join secret of a private run (``swarm.dht.auth.load_secret``); None for a public run."""

    def __post_init__(self) -> None:
        if not self.initial_peers:
            raise ConfigError("generate needs --initial-peers: the address `swarm init` printed")
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k!r} must be >= 1 or None")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts={self.max_attempts!r} must be >= 1")


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_k: int | None, generator: torch.Generator
) -> int:
    """One token id from ``(vocab,)`` logits."""
    logits = logits.float().flatten()
    if not torch.isfinite(logits).all():
        raise RequestError("the swarm returned non-finite logits; the model may have diverged")
    if temperature == 0:
        return int(torch.argmax(logits))
    if top_k is not None and top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = torch.where(logits < cutoff, torch.full_like(logits, -math.inf), logits)
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


async def _one_step(
    link: SwarmLink, router: Router, ids: list[int], cfg: GenerateConfig, inbox: dict[str, asyncio.Future]
) -> torch.Tensor:
    """Logits ``(vocab,)`` of the next token after ``ids``, retried on new routes."""
    from compression import decode_any

    seq_len = link.spec.model.seq_len
    tokens = torch.tensor([ids[-seq_len:]], dtype=torch.long)  # (1, T)
    last_error: Exception | None = None
    avoid: set[str] = set()
    for attempt in range(cfg.max_attempts):
        stages = await link.stage_records()
        try:
            route = router.route(stages, avoid=frozenset(avoid))
        except NoPeersError as e:
            raise SwarmError(
                f"cannot generate: {e}; start a peer with `swarm peer --initial-peers "
                f"{cfg.initial_peers[0]} --run {cfg.run_id} --stage {e.stage}`"
            ) from None
        mb_id = f"gen.{secrets.token_hex(4)}-{len(ids)}-{attempt}"
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        inbox[mb_id] = future
        try:
            await link.send_forward(
                route=route,
                mb_id=mb_id,
                mode="generate",
                tokens=tokens,
                targets=None,
                timeout_s=cfg.step_timeout_s,
            )
            report, payload = await asyncio.wait_for(future, timeout=cfg.step_timeout_s)
            if report.kind == "failed":
                raise PeerFailure(f"route broke at stage {report.stage}: {report.reason}", peer=report.peer)
            logits = decode_any(payload)
            for pid in route:
                router.on_success(pid)
            return logits.reshape(-1, logits.shape[-1])[-1]  # (vocab,)
        except (PeerFailure, RequestError, asyncio.TimeoutError) as e:
            last_error = e
            blamed = getattr(e, "peer", None)
            for pid in route:
                if pid == blamed:
                    router.on_failure(pid)
                else:
                    router.release(pid)
            avoid.update([blamed] if blamed in route else route)
        finally:
            inbox.pop(mb_id, None)
    raise SwarmError(f"generation failed after {cfg.max_attempts} routes; last error: {last_error}")


async def generate_async(cfg: GenerateConfig, *, on_text: Callable[[str], None] | None = None) -> str:
    """Sample ``max_new_tokens`` after ``prompt``; ``on_text`` receives each new piece as it arrives."""
    from swarm.client.link import SwarmLink

    link = await SwarmLink.open(
        initial_peers=cfg.initial_peers,
        run_id=cfg.run_id,
        host_maddrs=cfg.host_maddrs,
        spec_timeout_s=cfg.spec_timeout_s,
        secret=cfg.secret,
    )
    try:
        tokenizer = load_tokenizer(
            cfg.tokenizer, vocab_size=link.spec.model.vocab_size, pretrained=link.spec.pretrained
        )
        inbox: dict[str, asyncio.Future] = {}

        def on_report(report: Report, payload: bytes) -> None:
            future = inbox.get(report.mb_id)
            if future is not None and not future.done() and report.kind in ("result", "failed"):
                future.set_result((report, payload))

        link.on_report = on_report
        router = Router(cfg.routing, clock=time.monotonic, rng=random.Random(cfg.seed))
        gen = torch.Generator().manual_seed(cfg.seed)
        ids = tokenizer.encode(cfg.prompt) or tokenizer.encode("\n")
        new: list[int] = []
        shown = ""
        for _ in range(cfg.max_new_tokens):
            logits = await _one_step(link, router, ids + new, cfg, inbox)
            new.append(sample_next(logits, temperature=cfg.temperature, top_k=cfg.top_k, generator=gen))
            text = tokenizer.decode(new)
            if on_text is not None and text.startswith(shown):
                on_text(text[len(shown) :])
                shown = text
        return tokenizer.decode(new)
    finally:
        await link.close()


def generate(cfg: GenerateConfig, *, on_text: Callable[[str], None] | None = None) -> str:
    """Blocking :func:`generate_async`."""
    return asyncio.run(generate_async(cfg, on_text=on_text))
