"""Benchmarks (not tests): each runs with ``python -m benchmarks.NAME``, writes its JSON under
``benchmarks/results/`` and its own section of ``BENCHMARKS.md`` (machine, exact command, table, reading).

- ``codecs.py``: every codec of ``compression`` vs hivemind's codecs on activation-shaped tensors.
- ``netlab.py``: network namespaces with rate-limited links, so benchmarks can run over slow links.
- ``pipelining_baseline.py``: ``torch.distributed.pipelining`` over gloo, the baseline to beat.
- ``single_process.py``: the same model trained in one process (the compute-bound limit).
- ``links.py``: the swarm vs. the baselines over shaped links (throughput, bytes, memory, convergence).
- ``time_to_target.py`` (report: ``time_to_target_report.py``): measured runs of 1F1B and swarm
  configurations to the held-out loss one process reaches after N tokens, at shaped rates;
  ``pipe_heldout.py`` evaluates a pipelining run through its pipeline.
- ``markdown.py``: each benchmark rewrites only its own section of ``BENCHMARKS.md``.
- ``convergence.py``: held-out loss of loopback swarms (1/2/4 peers per stage, sync/async, codecs,
  subspace, churn) vs. the same training in one process, over seeds and two corpora.
- ``report.py``: what every report shares (machine description, table cells, smoothed curves).
- ``async_replay.py``: a one-peer-per-stage swarm replayed in one process: async vs sync vs one
  process, per stage optimizer (does staleness cost quality?).
- ``subspace_convergence.py``: subspace-constrained models (k = d/32, d/100) vs. the ordinary model.
- ``bubbles.py``: pipeline bubbles with emulated compute (each stage owns its time): GPipe, 1F1B and the
  swarm's sync and async modes, efficiency and utilisation per stage vs. (S-1)/(M+S-1).
- ``busy.py``: a torch pipelining stage with emulated busy time, a compute device and its busy count.
- ``gpu_check.py``: a 4-stage 152M swarm on one GPU vs. torch pipelining there, and CUDA vs. CPU numerics
  (skips without CUDA; ``--device cpu --tiny`` is its dry path).
"""
