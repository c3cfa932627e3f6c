"""Benchmarks (not tests): each module runs with ``python -m benchmarks.NAME`` and writes
``benchmarks/results/NAME.json`` plus its section of ``BENCHMARKS.md``.

- ``codecs.py``: every codec of ``compression`` vs hivemind's own codecs on activation-shaped tensors.
"""
