"""Memory of a peer of a --from-pretrained run: it holds only its stage, never the whole checkpoint.

Run (from the repository root)::

    python -m benchmarks.pretrained_memory            # ~430 MB float32 checkpoint: results/pretrained_memory.json
    python -m benchmarks.pretrained_memory --quick    # a small checkpoint (a smoke test of the script)

What runs: a random Llama checkpoint (swarm/tools/toy_checkpoint.py; 16 layers, d_model 768, grouped-query
attention, sharded safetensors) is written to ``--work``. For each case a bootstrap (this process, no
keeper) publishes a run spec derived from it, and one ``swarm peer --weights DIR --stage S`` process
starts; nothing else can send it state, so it reads its stage's tensors from the checkpoint (memory-mapped,
digest-checked), builds its stage and optimizer, starts its averager and goes online. While it starts
(and for 2 s after it is online) the script samples, every 0.2 s, the proportional set size (PSS) of the
peer's whole process tree (the peer, its hivemind DHT and averager processes, p2pd) and records the
peak; the kernel's own peak (VmHWM) of the peer process is recorded too.

Cases: a middle stage (1) of the 4-stage run (no embedding or head), the last stage of the 4-stage
run (layers + LM head), and the single stage of a 1-stage run (the whole model in one peer, same code
path). For reference, in fresh processes: ``transformers.AutoModelForCausalLM.from_pretrained`` of the
whole checkpoint, ``safetensors.torch.load_file`` of every shard, and a process that only imports what a
peer imports. Target (issue 15): a peer serving 1 of 4 stages peaks at <= 40% of loading the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from swarm.tools.toy_checkpoint import ToyLlama, make_toy_llama

FULL = ToyLlama(
    vocab_size=4096,
    d_model=768,
    n_layers=16,
    n_heads=12,
    n_kv_heads=4,
    ffn_hidden=2048,
    max_position_embeddings=512,
    max_shard_size="100MB",
)
QUICK = ToyLlama(vocab_size=512, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=352)
BASE = {
    "codecs": {"activations": "none", "gradients": "none"},
    "optimizer": {"name": "adamw", "lr": 1e-4},
    "micro_batch_size": 1,
}


def _children(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc's parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def _kib(path: str, field: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeSampler:
    """Peak PSS of a process tree and VmHWM of its root, sampled in a thread every ``period_s``."""

    def __init__(self, pid: int, period_s: float = 0.2):
        self.pid, self.period_s = pid, period_s
        self.peak_pss_kib = 0
        self.vm_hwm_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = sum(_kib(f"/proc/{p}/smaps_rollup", "Pss") for p in _children(self.pid))
            self.peak_pss_kib = max(self.peak_pss_kib, total)
            self.vm_hwm_kib = max(self.vm_hwm_kib, _kib(f"/proc/{self.pid}/status", "VmHWM"))
            self._stop.wait(self.period_s)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure_peer(ckpt: Path, stages: int, stage: int, timeout_s: float) -> dict[str, Any]:
    """Start a bootstrap for a ``stages``-stage run of ``ckpt`` and one ``--weights`` peer of ``stage``."""
    from swarm.run.pretrained import spec_from_pretrained
    from swarm.tools.bootstrap import Bootstrap, BootstrapConfig

    spec = spec_from_pretrained(ckpt, base=BASE, stages=stages, seq_len=128, run_id=f"mem{stages}")
    cmd = [sys.executable, "-m", "swarm.cli", "peer", "--run", spec.run_id, "--stage", str(stage)]
    cmd += ["--weights", str(ckpt), "--throughput", "1000", "--no-rebalance", "--device", "cpu"]
    with Bootstrap(BootstrapConfig(spec=spec)) as boot:
        env = dict(os.environ, HIVEMIND_LOGLEVEL="WARNING", PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [*cmd, "--initial-peers", boot.maddrs[0]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            start_new_session=True,
        )
        online, lines = None, []
        try:
            with TreeSampler(proc.pid) as sampler:
                assert proc.stdout is not None
                for line in proc.stdout:
                    lines.append(line)
                    if "serving stage" in line:
                        online = time.monotonic() - t0
                        time.sleep(2.0)
                        break
                    if time.monotonic() - t0 > timeout_s:
                        break
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if online is None:
        raise RuntimeError("the peer did not come online:\n" + "".join(lines[-30:]))
    return {
        "case": f"peer, stage {stage} of {stages}",
        "stage_params": spec.n_params(stage),
        "online_s": round(online, 1),
        "peak_tree_pss_mib": round(sampler.peak_pss_kib / 1024),
        "peer_vm_hwm_mib": round(sampler.vm_hwm_kib / 1024),
    }


# Both loaders may leave tensors memory-mapped and untouched (not resident): each reference sums every
# tensor once, so the whole model is in memory, as it is for a process that uses it.
_REFERENCE = {
    "imports of a peer only": "import torch, hivemind, peer.server, swarm.run.pretrained",
    "transformers from_pretrained (whole model)": (
        "import torch, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32); "
        "s = sum(float(p.sum()) for p in m.parameters())"
    ),
    "safetensors load_file (whole model)": (
        "import glob, torch, safetensors.torch as st; "
        "w = [st.load_file(f) for f in sorted(glob.glob(DIR + '/*.safetensors'))]; "
        "s = sum(float(t.sum()) for d in w for t in d.values())"
    ),
}


def measure_reference(name: str, ckpt: Path) -> dict[str, Any]:
    """Peak RSS (VmHWM) of a fresh process that runs one line of ``_REFERENCE``. (Not ``ru_maxrss``: Linux
    carries the parent's peak over ``fork`` + ``exec`` into it.)"""
    code = _REFERENCE[name].replace("DIR", repr(str(ckpt)))
    code += "\nprint([ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0].split()[1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {"case": name, "peak_rss_mib": round(int(out.stdout.split()[-1]) / 1024)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small checkpoint (smoke test)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/swarmpipe-pretrained-memory"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pretrained_memory.json"))
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    ckpt = args.work / ("quick" if args.quick else "full")
    if not (ckpt / "config.json").exists():
        make_toy_llama(ckpt, shape)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    rows = [measure_reference(name, ckpt) for name in _REFERENCE]
    for stages, stage in ((4, 1), (4, 3), (1, 0)):
        rows.append(measure_peer(ckpt, stages, stage, args.timeout_s))
        print(rows[-1], flush=True)
    by = {r["case"]: r for r in rows}
    whole_peer = by["peer, stage 0 of 1"]["peak_tree_pss_mib"]
    loaded = by["transformers from_pretrained (whole model)"]["peak_rss_mib"]
    result = {
        "checkpoint": {"dir": str(ckpt), "safetensors_mib": round(size / 2**20), "shape": shape.__dict__},
        "rows": rows,
        "ratios": {
            stage: {
                "vs peer serving the whole model": round(by[case]["peak_tree_pss_mib"] / whole_peer, 3),
                "vs transformers loading the whole model": round(by[case]["peak_tree_pss_mib"] / loaded, 3),
            }
            for stage, case in (("middle", "peer, stage 1 of 4"), ("last", "peer, stage 3 of 4"))
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
