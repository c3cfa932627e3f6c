"""Metric sinks: flattening, name parsing, missing packages, TensorBoard files read back, W&B offline.

TensorBoard and W&B are optional dependencies: their tests skip cleanly when the package is absent.
The W&B test runs in offline mode with every W&B directory inside ``tmp_path``.
"""

from __future__ import annotations

import json
import logging
import math
import sys

import pytest

from swarm.errors import ConfigError
from swarm.train.logging_sinks import MultiSink, _Sink, flatten_metrics, make_sinks, wandb_mode
from swarm.train.metrics import step_record


def _record(step: int, loss: float) -> dict:
    return step_record(
        step=step,
        elapsed_s=1.5 * step,
        loss=loss,
        tokens=1024 * step,
        step_tokens=1024,
        step_stats={"fwd_bytes_0": 262144.0, "bwd_bytes_0": 131072.0, "hops": 3.0},
        completed=step,
        dropped=0,
        inflight=2,
        tokens_per_s=500.0 + step,
    )


def test_flatten_keeps_finite_numbers_and_nests_with_slashes():
    flat = flatten_metrics(_record(3, 4.25))
    assert flat["loss"] == 4.25 and flat["tokens"] == 3072 and flat["tokens_per_s"] == 503.0
    assert flat["bytes_per_token/fwd_bytes_0"] == 256.0 and flat["bytes_per_token/bwd_bytes_0"] == 128.0
    assert flat["bytes_per_token_total"] == 384.0
    assert not {"type", "step", "wall"} & set(flat)
    odd = {"a": None, "b": "text", "c": float("nan"), "d": True, "e": {"f": math.inf, "g": 2}, "step": 5}
    assert flatten_metrics(odd) == {"e/g": 2.0}


def test_names_are_checked_before_anything_is_created(tmp_path):
    with pytest.raises(ConfigError, match="choose from tensorboard, wandb"):
        make_sinks(["tensorboard", "mlflow"], tmp_path, "tiny")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="output directory"):
        make_sinks("wandb", None, "tiny")
    none = make_sinks([], None, "tiny")
    none.write(_record(1, 1.0))  # no sinks: nothing happens
    none.close()
    assert make_sinks("jsonl", None, "tiny").sinks == []  # always written anyway


def test_missing_package_names_the_pip_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ConfigError, match="pip install wandb"):
        make_sinks("tensorboard,wandb", tmp_path, "tiny")
    assert not (tmp_path / "tensorboard").exists(), "no half-made sinks"
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        make_sinks(["tensorboard"], tmp_path, "tiny")


def test_a_failing_sink_warns_once_and_is_switched_off(caplog):
    class Full(_Sink):
        name = "full-disk"

        def __init__(self):
            super().__init__()
            self.calls = 0
            self.closed = False

        def _log(self, step, scalars):
            self.calls += 1
            raise OSError(28, "No space left on device")

        def close(self):
            self.closed = True

    class Keeps(_Sink):
        name = "keeps"

        def __init__(self):
            super().__init__()
            self.seen = []

        def _log(self, step, scalars):
            self.seen.append((step, scalars["loss"]))

        def close(self):
            pass

    full, keeps = Full(), Keeps()
    sinks = MultiSink([full, keeps])
    with caplog.at_level(logging.WARNING, logger="swarm.train.logging_sinks"):
        for step in (1, 2, 3):
            sinks.write(_record(step, 5.0 - step))
    assert full.calls == 1 and "No space left" in full.failed
    assert keeps.seen == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert sum("switched off" in r.message for r in caplog.records) == 1
    sinks.close()
    assert full.closed


def test_wandb_mode_follows_env_then_api_key_then_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    monkeypatch.delenv("NETRC", raising=False)
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "x" * 40}) == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "x"}) == "disabled"
    assert wandb_mode({"WANDB_MODE": "dryrun"}) == "offline"
    with pytest.raises(ConfigError, match="WANDB_MODE"):
        wandb_mode({"WANDB_MODE": "sometimes"})


def test_tensorboard_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is optional: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = make_sinks(["tensorboard"], tmp_path, "tiny")
    try:
        for step in range(1, 6):
            sinks.write(_record(step, 6.0 - 0.5 * step))
        sinks.write({"type": "eval", "step": 5, "eval_loss": 3.75, "eval_micro_batches": 4})
    finally:
        sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "tokens_per_s", "bytes_per_token/fwd_bytes_0", "eval_loss"} <= tags
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [e.value for e in loss] == pytest.approx([5.5, 5.0, 4.5, 4.0, 3.5])
    assert acc.Scalars("eval_loss")[0].value == pytest.approx(3.75)


def _wandb_records(path):
    """Records of a ``.wandb`` file: a 7-byte file header, then leveldb-log chunks in 32 KiB blocks
    (crc32 4, length 2, type 1: full / first / middle / last), each payload a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last chunk: one record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@pytest.mark.slow  # starts W&B's wandb-core service process
def test_wandb_offline_run_records_the_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional: pip install wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    sinks = make_sinks(["wandb"], out, "tiny", {"run_id": "tiny", "model": {"d_model": 128}})
    [sink] = sinks.sinks
    try:
        assert sink.mode == "offline"
        for step in range(1, 4):
            sinks.write(_record(step, 5.0 - step))
    finally:
        sinks.close()
    run_dir = sink.run_dir
    assert run_dir.parent == out / "wandb" and run_dir.name.startswith("offline-run-")
    [run_file] = run_dir.glob("*.wandb")  # the offline run's record file (what `wandb sync` uploads)
    records = _wandb_records(run_file)
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item
            }
            history.append(row)
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["loss"] for h in history] == [4.0, 3.0, 2.0]
    assert history[-1]["bytes_per_token/fwd_bytes_0"] == 256.0 and history[-1]["tokens_per_s"] == 503.0
    config = {}
    for r in records:  # the config travels in the run record, and in config records if it changes
        kind = r.WhichOneof("record_type")
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        config.update({item.key: json.loads(item.value_json) for item in updates})
    assert config["model"] == {"d_model": 128} and config["run_id"] == "tiny"
