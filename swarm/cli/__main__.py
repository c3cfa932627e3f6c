"""``python -m swarm.cli ...``: the ``swarm`` console script."""

import sys

from swarm.cli.main import main

sys.exit(main())
