"""Check a GPU stage peer's compute path: a stage on CUDA under autocast, forward/backward through the runtime.

Run (on a machine with CUDA)::

    python examples/gpu_peer.py --spec examples/tiny.yaml --stage 0 --micro-batches 64

It builds one stage of the run spec on ``cuda`` with the spec's autocast (bf16 where supported),
pushes ``--micro-batches`` training micro-batches through the same single-worker compute queue a
live peer uses (forward with weight stashing, then backward with the stashed version, local
optimizer steps), and prints tokens/s and peak GPU memory. Without CUDA it exits with status 2 and
says so; ``--allow-cpu`` runs the same path on the CPU (a smoke test of the script itself).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from peer.compute import StageCompute
from peer.runtime import ComputeQueue
from swarm.run.model import autocast_dtype
from swarm.run.spec import RunSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="examples/tiny.yaml", help="run spec YAML")
    parser.add_argument("--stage", type=int, default=0, help="stage to build")
    parser.add_argument("--micro-batches", type=int, default=32, help="training micro-batches to run")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when CUDA is absent")
    args = parser.parse_args(argv)

    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        print("no CUDA device found: this script checks the GPU path of a stage peer. Run it on a machine "
              "with an NVIDIA GPU and a CUDA build of torch, or pass --allow-cpu for a CPU smoke test.",
              file=sys.stderr)  # fmt: skip
        return 2

    spec = RunSpec.from_yaml(args.spec)
    compute = StageCompute(spec, args.stage, device=device)
    queue = ComputeQueue(max_queue=max(2, args.micro_batches), forward_gate=compute.forward_allowed)
    compute.on_gate_change = queue.notify
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, autocast {autocast_dtype(spec, device)}, stage {args.stage} "
          f"(layers {spec.stage_layers(args.stage)}), optimizer {spec.optimizer.name} ({spec.optimizer.mode})")  # fmt: skip

    b, t = spec.micro_batch_size, spec.model.seq_len
    gen = torch.Generator().manual_seed(0)
    done = threading.Event()
    finished = [0]

    def forward_then_backward(i: int) -> None:
        tokens = torch.randint(0, spec.model.vocab_size, (b, t), generator=gen)
        # what arrives from the previous stage: (B, T, width), width = d_model or the subspace rank
        x = tokens if compute.is_first else torch.randn(b, t, compute.width, generator=gen)
        targets = torch.randint(0, spec.model.vocab_size, (b, t), generator=gen)
        res = compute.forward(f"mb{i}", x, "train", targets=targets, tokens=tokens)
        if not compute.is_last:  # the gradient of our output would come from the next stage
            compute.backward(f"mb{i}", torch.randn(res.output.shape, generator=gen) * 1e-3)
        finished[0] += 1
        if finished[0] == args.micro_batches:
            done.set()

    queue.start()
    try:
        forward_then_backward(-1)  # warm-up (kernels, allocator); not timed
        finished[0] = 0
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for i in range(args.micro_batches):
            queue.submit("forward", lambda waited, i=i: forward_then_backward(i))
        if not done.wait(timeout=600):
            print("timed out waiting for the compute worker", file=sys.stderr)
            return 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        queue.close()
    tokens = args.micro_batches * b * t
    print(f"{args.micro_batches} micro-batches ({tokens} tokens) forward+backward in {elapsed:.2f} s: "
          f"{tokens / elapsed:,.0f} tokens/s; weight version {compute.version}, queue peak {queue.stats.peak}")  # fmt: skip
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
