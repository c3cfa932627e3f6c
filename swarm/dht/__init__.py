"""The DHT side: how processes of a run find each other and what they publish.

- ``network``: the one place a hivemind DHT is started (validators, identity, socket prefix).
- ``records``: the DHT records (peer, run, progress, spec, snapshot index, stage event) and keys.
- ``membership``: the one DHT owner per process (serialised calls, signed records, readers).
- ``auth``: private runs (join secret, record proofs, request signatures, gates, penalties).
- ``placement``: which stage a peer claims and when it moves (pure functions).
- ``snapshots``: stage snapshots on disk and the rules for restoring lost stage state.
- ``processes``: the hivemind child processes and socket files a process leaves behind.

Imports the run layer, ``swarm.errors``/``swarm.atomic`` and ``compression`` (docs/ARCHITECTURE.md).
"""
