"""Self-measurement: how many tokens per second this peer pushes through a stage (forward + backward).

The number is what the peer announces and what placement and routing weigh peers by, so it must be
measured the way the peer will compute: the stage's real module, one micro-batch of the run's
shape, forward and backward, under the same autocast. It is a short benchmark (a one-sequence
warm-up, then timed passes for about half of ``budget_s``; under 2 s on CPU by default) and is cached per (device name, spec hash,
stage) in ``~/.cache/swarmpipe/throughput.json``, so restarts are instant. Delete that file to
re-measure (e.g. after changing hardware drivers).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from swarm.model import autocast_dtype, build_stage, lm_loss
from swarm.spec import RunSpec

__all__ = ["measure_throughput", "default_cache_dir", "device_name"]

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/swarmpipe`` or ``~/.cache/swarmpipe``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "swarmpipe"


def device_name(device: torch.device) -> str:
    """A cache key for the hardware: the GPU model, or ``cpu-<threads>``."""
    if device.type == "cuda":
        return f"cuda-{torch.cuda.get_device_name(device)}"
    return f"{device.type}-{torch.get_num_threads()}threads"


def _bench(spec: RunSpec, stage: int, device: torch.device, budget_s: float) -> float:
    """Tokens/s of forward+backward, spending about ``budget_s`` seconds in total.

    The first (warm-up) pass uses one sequence; its time picks how many sequences the timed passes
    use (up to the run's micro-batch size), so a slow CPU measures on fewer sequences instead of
    overrunning the budget, and a GPU measures on full micro-batches.
    """
    module = build_stage(spec, stage, device=device)
    amp = autocast_dtype(spec, device)
    seq = spec.model.seq_len
    gen = torch.Generator().manual_seed(0)

    def once(batch: int) -> float:
        if stage == 0:
            x = torch.randint(0, spec.model.vocab_size, (batch, seq), generator=gen).to(device)
        else:
            x = torch.randn(batch, seq, spec.model.d_model, generator=gen).to(device).requires_grad_(True)
        targets = torch.randint(0, spec.model.vocab_size, (batch, seq), generator=gen).to(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            out = module(x)
        loss = lm_loss(out, targets) if module.is_last else out.float().square().mean()
        loss.backward()
        module.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    once(1)  # warm-up: allocator, kernels, lazy init
    one = once(1)
    batch = max(1, min(spec.micro_batch_size, int(budget_s / 4 / max(one, 1e-6))))
    tokens, spent = 0, 0.0
    while spent < budget_s / 2 and tokens < 20 * batch * seq:
        spent += once(batch)
        tokens += batch * seq
    return tokens / spent


def measure_throughput(
    spec: RunSpec,
    stage: int,
    device: torch.device | str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    budget_s: float = 1.5,
) -> float:
    """Tokens/s of forward+backward of ``stage`` on ``device`` (cached; measured within ``budget_s``)."""
    device = torch.device(device)
    key = f"{device_name(device)}|{spec.spec_hash}|{stage}"
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_file = path / "throughput.json"
    cache: dict[str, float] = {}
    try:
        cache = json.loads(cache_file.read_text())
        if isinstance(cache, dict) and isinstance(cache.get(key), (int, float)) and cache[key] > 0:
            return float(cache[key])
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    value = _bench(spec, stage, device, budget_s)
    cache[key] = value
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path)
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, cache_file)
    except OSError as e:  # a read-only home must not stop a peer
        logger.warning("could not cache the throughput measurement in %s: %s", cache_file, e)
    return value
