"""The software version, carried in every DHT record so peers can tell each other apart."""

__version__ = "0.1.0"
