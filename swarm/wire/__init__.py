"""The wire: the data-plane protocol trainers and stage peers both speak (``protocol``), and the
channels that carry its small messages (``channel``: one long-lived stream per pair of peers).

It sits below both sides, so neither imports the other. Imports only ``swarm.errors``
(docs/ARCHITECTURE.md).
"""
