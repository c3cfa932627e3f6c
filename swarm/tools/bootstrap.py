"""The long-lived node behind ``swarm init``: an entry point to the swarm that keeps a run listed.

A bootstrap node is a DHT node whose address others pass as ``--initial-peers``. With a run spec
it also owns the run: it publishes the spec signed with its key, lists the run in the swarm's
registry, and re-publishes both before they expire (``refresh_interval_s``). Without a spec it is
a plain entry point (several runs can share one swarm and its bootstrap).

From Python (``swarm demo`` and tests)::

    with Bootstrap(BootstrapConfig(spec=RunSpec.from_yaml("examples/tiny.yaml"))) as boot:
        print(boot.join_commands())
        boot.serve(stop_event)          # refresh + status lines until stop_event is set

From a shell: ``swarm init examples/tiny.yaml`` (see ``swarm/cli/commands/init.py``).

With ``keeper=KeeperConfig(...)`` (``swarm init`` sets one unless ``--no-keeper``) the owner also keeps
recent snapshots of every stage (``swarm/tools/keeper.py``): loaded and declared in ``start``, taken by a
background thread that ``serve`` starts.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from swarm.dht.membership import REGISTRY_EXPIRATION_S, SPEC_EXPIRATION_S, Membership
from swarm.dht.network import DHTConfig, start_dht, visible_maddrs
from swarm.errors import ConfigError, SwarmError
from swarm.tools.status import RunStatus, gather_run_status, status_line

if TYPE_CHECKING:
    import hivemind

    from swarm.run.spec import RunSpec
    from swarm.tools.keeper import Keeper, KeeperConfig

__all__ = ["BootstrapConfig", "Bootstrap"]


@dataclass(frozen=True, kw_only=True)
class BootstrapConfig:
    dht: DHTConfig = field(default_factory=DHTConfig)
    """How the node listens; ``initial_peers`` non-empty = a new run in an existing swarm."""
    spec: RunSpec | None = None
    """The run to own and publish; None = a plain bootstrap node."""
    refresh_interval_s: float = 30.0
    """Re-publish spec and registry entry this often; must stay well below their expirations."""
    status_interval_s: float = 10.0
    """Seconds between status lines in ``serve``."""
    spec_expiration_s: float = SPEC_EXPIRATION_S
    registry_expiration_s: float = REGISTRY_EXPIRATION_S
    secret: bytes | None = field(default=None, repr=False)
    """The join secret of a private run (``spec.access.private``): the owner checks peers' proofs too."""
    secret_file: str | None = None
    """Where the secret is stored; the join commands point joiners to a copy of it."""
    keeper: KeeperConfig | None = None
    """Keep snapshots of every stage of ``spec`` (swarm/tools/keeper.py); None = no keeper."""

    def __post_init__(self) -> None:
        for name in ("refresh_interval_s", "status_interval_s", "spec_expiration_s", "registry_expiration_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive number of seconds")
        shortest = min(self.spec_expiration_s, self.registry_expiration_s)
        if self.refresh_interval_s > shortest / 2:
            raise ConfigError(
                f"refresh_interval_s={self.refresh_interval_s} must be at most half the shortest expiration "
                f"({shortest} s), or the run vanishes from the DHT between refreshes"
            )


class Bootstrap:
    """A DHT entry point that owns (publishes and refreshes) at most one run. Close it in ``finally``."""

    def __init__(self, cfg: BootstrapConfig) -> None:
        self.cfg = cfg
        self.dht: hivemind.DHT | None = None
        self.membership: Membership | None = None
        self._last_refresh = -math.inf
        self.last_status: RunStatus | None = None
        self.keeper: Keeper | None = None

    # --------------------------------------------------------------------------- lifecycle

    def start(self) -> Bootstrap:
        """Start the DHT node and publish the run (if any). Safe to ``close`` after a failure."""
        if self.dht is not None:
            raise ConfigError("this Bootstrap is already started")
        self.dht = start_dht(self.cfg.dht)
        try:
            spec = self.cfg.spec
            self.membership = Membership(self.dht, spec.run_id if spec else None)
            if spec is not None:
                from swarm.dht.auth import RunAuth

                self.membership.set_auth(RunAuth.from_spec(spec, self.cfg.secret))
                self._refuse_taken_run_id(spec)
            self.refresh()
            if spec is not None and self.cfg.keeper is not None:
                from swarm.tools.keeper import Keeper

                self.keeper = Keeper(self.dht, self.membership, spec, self.cfg.keeper).start()
        except BaseException:
            self.close()
            raise
        return self

    def _refuse_taken_run_id(self, spec: RunSpec) -> None:
        """In an existing swarm, a run id already listed with another spec belongs to someone else."""
        _, membership = self._require()
        taken = [
            e for e in membership.list_runs() if e.run_id == spec.run_id and e.spec_hash != spec.spec_hash
        ]
        if taken:
            raise ConfigError(
                f"run id {spec.run_id!r} is already used in this swarm by {taken[0].owner} with spec "
                f"{taken[0].spec_hash} (yours is {spec.spec_hash}); choose another run_id in the spec file, "
                "or join that run with `swarm peer --run ...` instead of starting it again"
            )

    def close(self) -> None:
        """Shut the DHT node down (its records expire by themselves). Idempotent."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.close()
        dht, self.dht, self.membership = self.dht, None, None
        if dht is not None:
            dht.shutdown()

    def __enter__(self) -> Bootstrap:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require(self) -> tuple[hivemind.DHT, Membership]:
        if self.dht is None or self.membership is None:
            raise ConfigError("the Bootstrap is not running: call start() (or use it as a context manager)")
        return self.dht, self.membership

    # ------------------------------------------------------------------------------ output

    @property
    def maddrs(self) -> list[str]:
        """This node's addresses for ``--initial-peers``, best first (announced, then non-loopback)."""
        dht, _ = self._require()
        found = visible_maddrs(dht)
        announced = [m for m in found if any(m.startswith(a + "/") for a in self.cfg.dht.announce_maddrs)]
        remote = [m for m in found if m not in announced and not m.startswith(("/ip4/127.", "/ip6/::1/"))]
        return announced + remote + [m for m in found if m not in announced and m not in remote]

    def join_commands(self) -> list[str]:
        """The exact commands that join this run (or this swarm, for a plain bootstrap)."""
        address = self.maddrs[0]
        spec = self.cfg.spec
        if spec is None:
            return [f"swarm init RUN.yaml --initial-peers {address}", f"swarm runs --initial-peers {address}"]
        secret = ""
        if spec.access is not None and spec.access.private:
            # the secret itself is printed once by `swarm init`, never put on a command line
            secret = f" --secret-file {self.cfg.secret_file or 'SECRET_FILE'}"
        return [
            f"swarm peer --initial-peers {address} --run {spec.run_id}{secret}",
            f"swarm train --initial-peers {address} --run {spec.run_id}{secret}",
            f"swarm status --initial-peers {address} --run {spec.run_id}",
        ]

    # ------------------------------------------------------------------------------ duties

    def refresh(self) -> RunStatus | None:
        """Re-publish spec and registry entry (with the current peer count); returns the run's status.

        A plain bootstrap has nothing to publish and returns None.
        """
        _, membership = self._require()
        spec = self.cfg.spec
        if spec is None:
            return None
        membership.publish_spec(spec, expiration_s=self.cfg.spec_expiration_s)
        peers = 0
        if self.last_status is not None:
            peers = self.last_status.num_peers
        membership.register_run(spec, peers=peers, expiration_s=self.cfg.registry_expiration_s)
        self._last_refresh = time.monotonic()
        return self.last_status

    def status(self) -> str:
        """One status line: the run's coverage and progress, or the runs a plain bootstrap sees."""
        _, membership = self._require()
        if self.cfg.spec is None:
            runs = membership.list_runs()
            names = ", ".join(sorted({e.run_id for e in runs})) or "none"
            return f"bootstrap: {len(runs)} runs registered ({names})"
        self.last_status = gather_run_status(membership, spec_timeout_s=1.0)
        line = status_line(self.last_status)
        if self.keeper is not None:
            held = " ".join(
                f"{s}:v{snap.version}" if snap else f"{s}:-" for s, snap in enumerate(self.keeper.held)
            )
            line += f" | snapshots {held}"
        return line

    def serve(self, stop: threading.Event, out: Callable[[str], None] = print) -> None:
        """Refresh and print status lines until ``stop`` is set.

        DHT trouble (``SwarmError``) is printed and retried at the next tick: a bootstrap should
        outlive a bad moment of the network.
        """
        tick = min(self.cfg.status_interval_s, self.cfg.refresh_interval_s)
        if self.keeper is not None and not self.keeper.running:
            self.keeper.start_background(out)
        last_line = time.monotonic()
        while not stop.wait(tick):
            try:
                now = time.monotonic()
                if now - last_line >= self.cfg.status_interval_s - 1e-3:
                    last_line = now
                    out(self.status())
                if now - self._last_refresh >= self.cfg.refresh_interval_s - 1e-3:
                    self.refresh()
            except SwarmError as e:
                out(f"warning: {e}")
