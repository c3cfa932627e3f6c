"""Training: the trainer that drives micro-batches through routes, and what it needs around it.

- ``trainer``: ``Trainer``, the entry point (``TrainerConfig`` and the names below re-exported there).
- ``config``: ``TrainerConfig``.
- ``loop``: one session's loop: fill routes, wait for events, react, close steps.
- ``events``: what wakes the loop (reports, acks, failed sends, probe answers, refreshes); its tasks.
- ``policy``: ``mode: sync`` windows or ``mode: async`` pacing, one object per session.
- ``pacing``: how many micro-batches the trainer keeps in flight (async mode).
- ``failures``: ``REACTIONS`` to each failure code; closing broken attempts.
- ``probing``: failure detection (probes of silent peers, holding checks).
- ``routes``: routable peers, staleness caps, waiting for an empty stage.
- ``steps``: the step in progress, step and eval records; ``output``: terminal, metrics.jsonl, summary.
- ``background``: stage records and progress through the DHT; ``resume``: continuing a killed trainer.
- ``accounting``: the ledger of micro-batches and attempts.
- ``data``: the token stream (byte-level corpora, held-out windows).
- ``metrics``, ``logging_sinks``: metrics.jsonl, the progress line, plots, TensorBoard/W&B.
- ``reference``: the same model trained in one process, the yardstick for a swarm.

Never imports ``peer/`` (docs/ARCHITECTURE.md).
"""
