"""The client side of the data plane: a process that sends micro-batches into the swarm.

- ``link``: ``SwarmLink``, a process's endpoint in a run (DHT node, spec, P2P serving ``REPORT``/``INFO``).
- ``routing``: the choice of a route of peers, one per stage (stochastic wiring, backoff, caps).
- ``liveness``: failure detection for what the client has in flight (pure).

Used by the trainer and by ``swarm generate``; never imports ``peer/`` (docs/ARCHITECTURE.md).
"""
