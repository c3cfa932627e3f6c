"""User tools built on the layers below (each behind one ``swarm`` command).

- ``bootstrap``: the node behind ``swarm init``; ``keeper``: stage snapshots that outlive peers.
- ``status``: the per-stage status view; ``monitor``: the live web page (its parts: ``monitor_state``,
  ``monitor_page``, ``monitor_chart``, ``monitor_metrics``, ``monitor_server``, ``monitor_assets``).
- ``generation``: ``swarm generate``; ``export``: getting the model out.
- ``demo``: the local swarm behind ``swarm demo`` / ``make demo``.
- ``toy_checkpoint``: a small random Hugging Face Llama checkpoint (tests, example, benchmark).

May import every layer below, ``peer/`` included (docs/ARCHITECTURE.md).
"""
