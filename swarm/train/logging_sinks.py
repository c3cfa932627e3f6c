"""Optional metric sinks for the trainer: TensorBoard and Weights & Biases, next to ``metrics.jsonl``.

``metrics.jsonl`` (swarm/train/metrics.py) always exists; these sinks copy the same numbers to tools people
already watch. Both packages are optional and imported only when asked for; a missing one raises
``ConfigError`` naming the pip package, before training starts.

Use (the trainer's whole integration)::

    sinks = make_sinks(["tensorboard", "wandb"], out_dir, run_id, spec.to_dict())  # before training
    sinks.write(record)         # wherever a metrics.jsonl record is written (step and eval records)
    sinks.close()               # in ``finally``

``write(record)`` takes a ``metrics.jsonl`` record as is (its ``step`` is the x axis);
``log(step, metrics)`` takes any mapping. Nested dicts are flattened with ``/``
(``bytes_per_token/fwd_bytes_0``); strings, None, NaN and bookkeeping keys (``type``, ``step``,
``wall``) are skipped, so a record can be passed without preparation.

- ``tensorboard``: event files under ``OUT/tensorboard`` (``tensorboard --logdir OUT``), written
  with ``torch.utils.tensorboard`` (needs ``pip install tensorboard``); flushed every few seconds
  and at ``close``.
- ``wandb``: a W&B run named after the run id, with the run spec as its config, files under
  ``OUT/wandb``. Mode: ``WANDB_MODE`` when set; otherwise ``online`` when an API key is configured
  (``WANDB_API_KEY`` or ``wandb login``), else ``offline`` (sync later with ``wandb sync OUT/wandb``).
  If going online fails (no network), it falls back to offline with a warning. Offline runs also
  turn off W&B's system-metrics and machine-info probes, which may contact cloud metadata services.

A sink that fails while training (disk full, a W&B service crash) is reported once and switched
off: losing a dashboard must not stop a training run; ``metrics.jsonl`` keeps the data.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from swarm.errors import ConfigError

__all__ = ["SINK_NAMES", "MetricSink", "MultiSink", "make_sinks", "flatten_metrics", "wandb_mode"]

logger = logging.getLogger(__name__)

SINK_NAMES = ("tensorboard", "wandb")
_SKIP_KEYS = frozenset({"type", "step", "wall"})
_FLUSH_S = 5  # TensorBoard flush period: a crash loses at most this much (JSONL loses nothing)


class MetricSink(Protocol):
    """Where scalar metrics go: ``log(step, metrics)``, ``write(record)``, ``close()``."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numbers of ``metrics`` by ``/``-joined key; everything else is left out (see module doc)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not prefix and key in _SKIP_KEYS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, prefix=f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def _missing(package: str, name: str) -> ConfigError:
    return ConfigError(
        f"--log {name} needs the `{package}` package, which is not installed; install it with "
        f"`pip install {package}` (or drop `--log {name}`: metrics.jsonl is always written)"
    )


class _Sink:
    """Shared behaviour: ``write`` = ``log`` of a record; failures switch the sink off once."""

    name = "sink"
    errors: tuple[type[BaseException], ...] = (OSError, RuntimeError, ValueError)
    """What a failing writer raises (a subclass adds its package's error type)."""

    def __init__(self) -> None:
        self.failed: str | None = None

    def write(self, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            self.log(step, record)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.failed is not None:
            return
        scalars = flatten_metrics(metrics)
        if not scalars:
            return
        try:
            self._log(step, scalars)
        # Writers fail in their own ways (OSError from a full disk, RuntimeError or a wandb.Error
        # from a dead service): one warning, then this sink is off. metrics.jsonl still has it all.
        except self.errors as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        self.failed = f"{type(e).__name__}: {e}"
        logger.warning(
            "metric sink %s failed and is switched off (metrics.jsonl still has everything): %s",
            self.name,
            self.failed,
        )

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardSink(_Sink):
    """Scalars as TensorBoard event files under ``log_dir``."""

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike[str]):
        super().__init__()
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it; check first for a clear error)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=_FLUSH_S)

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


def wandb_mode(env: Mapping[str, str] | None = None) -> str:
    """``WANDB_MODE`` if set, else ``online`` with a configured API key, else ``offline``."""
    env = os.environ if env is None else env
    mode = env.get("WANDB_MODE", "").strip().lower()
    if mode:
        if mode not in ("online", "offline", "disabled", "dryrun", "run"):
            raise ConfigError(
                f"WANDB_MODE={mode!r} is not a W&B mode; use online, offline or disabled (or unset it)"
            )
        return {"dryrun": "offline", "run": "online"}.get(mode, mode)
    if env.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        if netrc.netrc().authenticators("api.wandb.ai"):  # what `wandb login` writes
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class WandbSink(_Sink):
    """Scalars to a Weights & Biases run (online, or offline files to sync later)."""

    name = "wandb"

    def __init__(
        self, out_dir: str | os.PathLike[str], run_id: str, config: Mapping[str, Any] | None, *, project: str
    ):
        super().__init__()
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb") from None
        self._wandb = wandb
        self.errors = (*_Sink.errors, wandb.Error)
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mode = wandb_mode()
        kwargs = dict(
            project=project, name=run_id, group=run_id, config=dict(config or {}), dir=str(self.dir)
        )
        try:
            self._run = wandb.init(mode=self.mode, settings=self._settings(self.mode), **kwargs)
        except wandb.Error as e:
            if self.mode != "online":
                raise ConfigError(f"W&B could not start a {self.mode} run in {self.dir}: {e}") from None
            logger.warning(
                "W&B could not go online (%s); logging offline instead (sync later with `wandb sync %s`)",
                e,
                self.dir / "wandb",
            )
            self.mode = "offline"
            self._run = wandb.init(mode="offline", settings=self._settings("offline"), **kwargs)

    def _settings(self, mode: str) -> Any:
        # console="off": W&B would otherwise wrap stdout and garble the trainer's progress line.
        extra = {}
        if mode != "online":
            extra = {"x_disable_stats": True, "x_disable_machine_info": True, "x_disable_meta": True}
        return self._wandb.Settings(console="off", silent=True, disable_git=True, **extra)

    @property
    def run_dir(self) -> Path:
        """The run's own directory (``.../wandb/offline-run-*`` or ``run-*``)."""
        return Path(self._run.dir).parent

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
        # W&B runs one `wandb-core` service per process; stop it unless someone else's run uses it.
        if self._wandb.run is None:
            self._wandb.teardown()


class MultiSink:
    """Fans ``log``/``write``/``close`` out to several sinks (none at all is fine: then it does nothing)."""

    def __init__(self, sinks: Sequence[MetricSink]):
        self.sinks = list(sinks)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except getattr(sink, "errors", _Sink.errors) as e:  # closing must reach every sink
                logger.warning("closing metric sink %s failed: %s", getattr(sink, "name", sink), e)
        self.sinks = []

    def __enter__(self) -> MultiSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_names(names: Sequence[str] | str) -> list[str]:
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for item in names:
        if not isinstance(item, str):
            raise ConfigError(f"--log {item!r}: expected sink names from {', '.join(SINK_NAMES)}")
        for name in item.replace(",", " ").split():
            name = name.strip().lower()
            if name in ("jsonl", "json"):
                continue  # always written anyway
            if name not in SINK_NAMES:
                raise ConfigError(
                    f"--log {name!r} is not a metric sink; choose from {', '.join(SINK_NAMES)} "
                    "(metrics.jsonl is always written)"
                )
            if name not in out:
                out.append(name)
    return out


def make_sinks(
    names: Sequence[str] | str,
    out_dir: str | os.PathLike[str] | None,
    run_id: str,
    config: Mapping[str, Any] | None = None,
    *,
    wandb_project: str = "swarmpipe",
) -> MultiSink:
    """The sinks named in ``names`` (e.g. ``["tensorboard", "wandb"]`` or ``"tensorboard,wandb"``).

    ``out_dir`` is the trainer's output directory (TensorBoard under ``OUT/tensorboard``, W&B under
    ``OUT/wandb``); ``config`` (e.g. ``spec.to_dict()``) becomes the W&B run config. Raises
    ``ConfigError`` for an unknown name or a missing package, having created nothing.
    """
    wanted = _parse_names(names)
    if wanted and out_dir is None:
        raise ConfigError(f"--log {' '.join(wanted)} needs an output directory (--out DIR)")
    # Check every import before creating anything, so a missing package leaves no half-made sinks.
    for name in wanted:
        try:
            __import__(name)
        except ImportError:
            raise _missing(name, name) from None
    sinks: list[MetricSink] = []
    try:
        for name in wanted:
            assert out_dir is not None
            if name == "tensorboard":
                sinks.append(TensorBoardSink(Path(out_dir) / "tensorboard"))
            else:
                sinks.append(WandbSink(out_dir, run_id, config, project=wandb_project))
    except BaseException:
        MultiSink(sinks).close()
        raise
    return MultiSink(sinks)
