"""The run: what every process of one training run agrees on, with no networking.

- ``spec``: the run spec (typed, validated config dataclasses, canonical bytes and hash).
  Its sections are in ``spec_model``, ``spec_training``, ``spec_access``, its file reader in ``spec_file``.
- ``fields``: config fields declared once (rule, default, error hint), for the spec and every command's config.
- ``limits``: id patterns and size limits shared with the DHT records and the peers.
- ``init``: the seeded, machine-independent initialisation every weight is drawn with.
- ``model``: the decoder split into pipeline stages (``build_stage``, ``build_model``).
- ``subspace``: subspace-constrained runs and their exact stage-boundary coding.
- ``pretrained``: runs that continue a Hugging Face Llama checkpoint (config, per-stage reads, digests).
- ``cache``: where this machine caches throughputs and run tokenizers.
- ``optimizer``: the per-stage optimizer (Muon, AdamW, Nesterov) that stage peers step and that the
  one-process reference training and exports share.

Imports only ``swarm.errors`` and ``compression`` (docs/ARCHITECTURE.md).
"""
