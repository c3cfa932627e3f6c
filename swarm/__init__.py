"""swarm: everything about the swarm as a whole.

Map of modules (grown by the issues that build them):
- ``errors``: the exception hierarchy for user and peer input.
- ``version``: the software version.
- ``cli`` and ``commands/``: the ``swarm`` command line.
"""

from swarm.errors import ConfigError, PeerFailure, RecordError, RequestError, StageUnavailableError, SwarmError
from swarm.version import __version__

__all__ = [
    "__version__",
    "SwarmError",
    "ConfigError",
    "RecordError",
    "RequestError",
    "StageUnavailableError",
    "PeerFailure",
]
