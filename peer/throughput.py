"""Self-measurement: how many tokens per second this peer pushes through a stage (forward + backward).

The number is what the peer announces and what placement and routing weigh peers by, so it must be
measured the way the peer will compute: the stage's real module, one micro-batch of the run's
shape, forward and backward, under the same autocast. It is a short benchmark (a one-sequence
warm-up, then timed passes for about half of ``budget_s``; under 2 s on CPU by default) and is cached per (device name, spec hash,
stage) in ``~/.cache/swarmpipe/throughput.json``, so restarts are instant. Delete that file to
re-measure (e.g. after changing hardware drivers).

Served throughput (note "served throughput")
--------------------------------------------
The benchmark only *seeds* the announced figure: a peer measured while its machine was busy (or
idle) would otherwise announce a wrong number for as long as it runs, and placement and routing
weigh peers by it. :class:`ServedRate` keeps an exponential moving average of what the peer
actually serves: for every training micro-batch, its tokens over the seconds the compute worker
spent on its forward and backward tasks (model, codecs, any emulated slowdown; the time it sat in
the queue does not count). The peer folds the micro-batches of each announce period into the
average with weight ``1 - exp(-dt / tau_s)`` (``tau_s`` = 15 s: a seed 4x off is within 5 % of
reality after a minute of traffic) and announces the result; on shutdown it writes the average
back into the cache (:func:`store_throughput`), so the next start is seeded with what was served.
A declared ``--throughput`` is announced as is.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no lock (peers of one machine may then lose each other's figure)
    fcntl = None  # type: ignore[assignment]

from swarm.run.cache import default_cache_dir
from swarm.run.model import autocast_dtype, build_stage, lm_loss
from swarm.run.spec import RunSpec

__all__ = ["measure_throughput", "store_throughput", "default_cache_dir", "device_name", "ServedRate"]

logger = logging.getLogger(__name__)


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
    weights = None
    if spec.pretrained is not None:  # the checkpoint's values do not change the speed; drawing them is slow
        from swarm.run.pretrained import placeholder_weights

        weights = placeholder_weights(spec, stage)
    module = build_stage(spec, stage, device=device, weights=weights)
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
    cache = _read_cache(path / "throughput.json")
    if isinstance(cache.get(key), (int, float)) and cache[key] > 0:
        return float(cache[key])
    value = _bench(spec, stage, device, budget_s)
    _write_cache(path, key, value)
    return value


def store_throughput(
    spec: RunSpec,
    stage: int,
    device: torch.device | str,
    value: float,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Replace the cached figure of ``stage`` on ``device`` by ``value`` (what the peer served)."""
    if not (math.isfinite(value) and value > 0):
        return
    device = torch.device(device)
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    _write_cache(path, f"{device_name(device)}|{spec.spec_hash}|{stage}", value)


def _read_cache(cache_file: Path) -> dict[str, float]:
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: Path, key: str, value: float) -> None:
    """Read-modify-write of one key under an exclusive lock: peers of one machine that stop together
    would otherwise overwrite each other's figures."""
    cache_file = path / "throughput.json"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(path / ".throughput.lock", "a") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            cache = _read_cache(cache_file)
            cache[key] = value
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path)
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, cache_file)
    except OSError as e:  # a read-only home must not stop a peer
        logger.warning("could not cache the throughput measurement in %s: %s", cache_file, e)


class ServedRate:
    """EMA of the tokens/s of forward+backward a peer serves (note "served throughput"). Pure.

    ``add(tokens, seconds)`` takes one training micro-batch (its forward and backward compute
    seconds together); ``fold(now)`` folds what was added since the last fold into the average and
    returns the current figure. Windows with less than ``min_busy_s`` of work wait for more.
    """

    def __init__(self, seed: float, *, now: float, tau_s: float = 15.0, min_busy_s: float = 0.2):
        if not (math.isfinite(seed) and seed > 0):
            raise ValueError(f"seed throughput must be a positive number of tokens/s, got {seed!r}")
        if not (math.isfinite(tau_s) and tau_s > 0):
            raise ValueError(f"tau_s must be a positive number of seconds, got {tau_s!r}")
        self.value = float(seed)
        self.tau_s = tau_s
        self.min_busy_s = min_busy_s
        self.samples = 0  # micro-batches folded in so far
        self._tokens = 0
        self._seconds = 0.0
        self._count = 0
        self._last = now

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and math.isfinite(seconds) and seconds > 0:
            self._tokens += tokens
            self._seconds += seconds
            self._count += 1

    def fold(self, now: float) -> float:
        if self._tokens <= 0:
            self._last = now  # an idle window: the next samples weigh by the window they fill
            return self.value
        if self._seconds < self.min_busy_s:
            return self.value  # too little work to trust: keep collecting
        dt = min(max(now - self._last, 0.0), 4 * self.tau_s)
        weight = 1.0 - math.exp(-dt / self.tau_s)
        sample = self._tokens / self._seconds
        self.value = (1.0 - weight) * self.value + weight * sample
        self.samples += self._count
        self._tokens, self._seconds, self._count = 0, 0.0, 0
        self._last = now
        return self.value
