"""Process hygiene of command entry points (swarm/dht/processes.py)."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp, os, signal, sys, time
    from swarm.dht.processes import reap_children

    def stubborn():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a forked hivemind child
        time.sleep(600)

    if __name__ == "__main__":
        mp.set_start_method("fork")
        p = mp.Process(target=stubborn)  # non-daemon: multiprocessing's exit hook would join it forever
        p.start()
        print(p.pid, flush=True)
        killed = reap_children(grace_s=0.5)
        print("killed", len(killed), flush=True)
    """
)


@pytest.mark.integration
def test_reap_children_kills_a_stubborn_child_so_the_process_can_exit():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    child_pid = int(out.split()[0])
    assert "killed 1" in out
    assert proc.returncode == 0
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.integration
def test_sigterm_interrupts_a_command_like_ctrl_c():
    code = "from swarm.dht.processes import terminate_as_interrupt\nimport os, signal, time\nterminate_as_interrupt()\n"
    code += "try:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\nexcept KeyboardInterrupt:\n    print('cleaned up')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "cleaned up"


@pytest.mark.integration
def test_remove_stale_sockets_removes_only_files_nobody_listens_on():
    import socket
    import tempfile

    from swarm.dht.processes import remove_stale_sockets

    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sp-") as d:  # unix socket paths are short
        prefix = os.path.join(d, "x-")
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            live.bind(prefix + "p2pd-live.sock")
            live.listen(1)
            stale.bind(
                prefix + "p2pclient-dead.sock"
            )  # bound, never listened on, closed: like a killed process
            stale.close()
            other = os.path.join(d, "y-p2pd-dead.sock")  # another prefix: not ours to touch
            s2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s2.bind(other)
            s2.close()
            assert remove_stale_sockets(prefix) == [prefix + "p2pclient-dead.sock"]
            assert sorted(os.listdir(d)) == ["x-p2pd-live.sock", "y-p2pd-dead.sock"]
            assert remove_stale_sockets(prefix) == []
            if sys.platform.startswith("linux"):  # known listening from /proc/net/unix: never connected to
                live.setblocking(False)
                with pytest.raises(BlockingIOError):
                    live.accept()
        finally:
            live.close()
            stale.close()


ORPHAN_SCRIPT = textwrap.dedent(
    """
    import time, torch
    from swarm.dht.network import DHTConfig, start_dht
    from peer.averaging import StageAverager

    dht = start_dht(DHTConfig())
    shapes = [torch.zeros(4)]
    averager = StageAverager.create(
        dht, run_id="orphans", spec_hash="0", stage=0, shapes=shapes, grad_shapes=[s.shape for s in shapes],
        state_fn=lambda: ({}, shapes),
    )
    averager.wait_ready(30)
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.integration
def test_a_sigkilled_process_leaves_no_dht_averager_or_p2pd_behind():
    env = dict(os.environ, HIVEMIND_LOGLEVEL="ERROR")
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        children = psutil.Process(proc.pid).children(recursive=True)
        names = sorted(c.name() for c in children)
        assert len(children) >= 3 and any("p2pd" in n for n in names), names  # DHT, averager, p2pd
        proc.kill()  # SIGKILL: no handler, no finally, no atexit runs in the parent
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (left := [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert left == [], f"left behind after SIGKILL: {[(c.pid, c.name()) for c in left]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_listening_paths_reads_the_listening_flag_of_proc_net_unix():
    from swarm.dht.processes import listening_paths

    text = (
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 3558720 /tmp/p-p2pclient-a.sock\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 3550812 /tmp/p-p2pd-connected.sock\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 3550813\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 3558721 /tmp/with space.sock\n"
    )
    assert listening_paths(text) == {"/tmp/p-p2pclient-a.sock", "/tmp/with space.sock"}


def test_alive_in_groups_finds_this_process_and_nothing_in_an_empty_group():
    from swarm.dht.processes import alive_in_groups

    me = os.getpgid(0)
    found = alive_in_groups([me])
    assert found and (os.getpid() in found or me in found)
    assert alive_in_groups([]) == []
