"""The wire: the data-plane protocol trainers and stage peers both speak (``protocol``).

It sits below both sides, so neither imports the other. Imports only ``swarm.errors``
(docs/ARCHITECTURE.md).
"""
