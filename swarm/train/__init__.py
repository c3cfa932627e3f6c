"""Training: the trainer that drives micro-batches through routes, and what it needs around it.

- ``trainer``: ``Trainer``/``TrainerConfig``, the loop, failure reactions, resume.
- ``pacing``: how many micro-batches the trainer keeps in flight (async mode).
- ``accounting``: the ledger of micro-batches and attempts.
- ``data``: the token stream (byte-level corpora, held-out windows).
- ``metrics``, ``logging_sinks``: metrics.jsonl, the progress line, plots, TensorBoard/W&B.
- ``reference``: the same model trained in one process, the yardstick for a swarm.

Never imports ``peer/`` (docs/ARCHITECTURE.md).
"""
