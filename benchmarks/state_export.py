"""CPU a donor spends handing one stage's state to hivemind's averager process for a download.

    python -m benchmarks.state_export            # examples/bench.yaml, stage 1, 5 rounds
    python -m benchmarks.state_export --spec S --stage 0 --rounds 9

A state download starts in the donor's process: ``get_current_state`` returns the state, and hivemind
pickles it through a pipe to its averager process (``MPFuture``), where torch moves a tensor that is not in
shared memory into shared memory (hivemind sets the ``file_system`` sharing strategy). This measures both
processes' CPU for the two ways the donor can hand it over (peer/averaging.py, note "state in shared
memory"):

- ``separate``: each state tensor copied to CPU, concatenated into one float32 tensor, then moved into
  shared memory by the pipe (before session 20);
- ``shared``: copied once, straight into one flat float32 tensor allocated in shared memory, whose handle
  the pipe passes (since session 20).

The receiving side does what hivemind's ``rpc_download_state`` does first with the tensor: serialise it
(``numpy().tobytes()``). Rounds alternate between the two ways; the figures are medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _receiver(conn: Any) -> None:  # the averager process's side
    while True:
        t0 = time.process_time()  # waiting for the pipe takes no CPU; unpickling (mapping) does
        msg = conn.recv()
        if msg is None:
            return
        [flat] = msg
        n = len(flat.numpy().tobytes())
        del flat, msg
        conn.send((n, time.process_time() - t0))


def run(spec_path: str, stage: int, rounds: int) -> dict[str, Any]:
    import hivemind.utils.mpfuture  # noqa: F401 -- sets torch's sharing strategy as in a peer
    import torch
    import torch.multiprocessing as tmp

    from peer.averaging import _flatten
    from peer.compute import StageCompute
    from peer.state_stream import flatten_into, shared_empty
    from swarm.run.spec import RunSpec

    spec = RunSpec.from_yaml(spec_path)
    compute = StageCompute(spec, stage)
    numel = sum(t.numel() for t in compute.optimizer.state_tensors())
    ways = {
        "separate": lambda: _flatten_separate(compute),
        "shared": lambda: _flatten(
            compute.export_state(copy=lambda live: [flatten_into(live, shared_empty)])[1]
        ),
    }
    ctx = tmp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    got: dict[str, dict[str, list[float]]] = {
        w: {"donor_s": [], "receiver_s": [], "wall_s": []} for w in ways
    }
    try:
        for r in range(rounds):
            for way in ways if r % 2 == 0 else reversed(list(ways)):
                w0, c0 = time.perf_counter(), time.process_time()
                flat = ways[way]()
                parent.send([flat])
                del flat
                n, receiver_s = parent.recv()
                assert n == numel * 4, (n, numel)
                got[way]["donor_s"].append(time.process_time() - c0)
                got[way]["receiver_s"].append(receiver_s)
                got[way]["wall_s"].append(time.perf_counter() - w0)
    finally:
        parent.send(None)
        proc.join(10)
    return {
        "spec": spec_path,
        "stage": stage,
        "state_mb": numel * 4 / 2**20,
        "rounds": rounds,
        "torch": torch.__version__,
        "medians": {w: {k: statistics.median(v) for k, v in d.items()} for w, d in got.items()},
        "all": got,
    }


def _flatten_separate(compute: Any) -> Any:
    import torch

    _, tensors = compute.export_state()
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(HERE.parent / "examples" / "bench.yaml"))
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give at least 1")
    res = run(args.spec, args.stage, args.rounds)
    print(f"stage {res['stage']} state: {res['state_mb']:.0f} MB, {res['rounds']} rounds (medians)")
    print("| way | donor CPU s | receiver CPU s | wall s |")
    print("|---|---|---|---|")
    for way, m in res["medians"].items():
        print(f"| {way} | {m['donor_s']:.3f} | {m['receiver_s']:.3f} | {m['wall_s']:.3f} |")
    if args.out:
        import json

        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
