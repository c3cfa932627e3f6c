"""benchmarks/cpu_by_process.py's pure parts: naming threads from a ``py-spy dump`` and telling a peer's
forked DHT process from its averager."""

from __future__ import annotations

import pytest

from benchmarks.cpu_by_process import _child_role, parse_dump

DUMP = """Process 2941: python -m swarm.cli peer --stage 0
Python v3.11.7 (/usr/bin/python3.11)

Thread 2941 (idle): "MainThread"
    select (selectors.py:468)
    run_forever (base_events.py:608)
    run (peer.py:40)
    <module> (__main__.py:7)
Thread 2983 (active): "replica-rounds-0"
    newton_schulz (optimizer.py:126)
    ReplicaRounds._run (replicas.py:200)
    Thread.run (threading.py:982)
    Thread._bootstrap_inner (threading.py:1045)
    Thread._bootstrap (threading.py:1002)
"""


def test_parse_dump_names_each_thread_by_its_python_name_and_entry_function():
    assert parse_dump(DUMP) == {2941: "MainThread | <module>", 2983: "replica-rounds-0 | ReplicaRounds._run"}
    assert parse_dump("") == {}


def test_child_role_tells_the_dht_process_from_the_averager():
    assert _child_role({1: "Thread-3 (_run_internal) | DecentralizedAverager._run_internal"}) == "averager"
    assert _child_role({1: "asyncio_0 | DHT.run_in_background", 2: "MainThread | main"}) == "dht"
    assert _child_role({1: "MainThread | main"}) == "child"


def test_window_must_be_two_increasing_times(capsys):
    from benchmarks.cpu_by_process import main

    assert main(["--window", "60", "--", "true"]) == 2
    assert "START:END" in capsys.readouterr().err
    assert main(["--threads", "--window", "90:30", "--", "true"]) == 2
    assert "START must be >= 0 and below END" in capsys.readouterr().err


@pytest.mark.integration
def test_it_counts_system_time_and_the_page_faults_of_a_process_that_touches_new_memory(capsys):
    """A child that touches 64 MiB of new memory page by page for over a second is seen with its faults."""
    import sys

    from benchmarks.cpu_by_process import main

    touch = (
        "import mmap, time; m = mmap.mmap(-1, 64 << 20); "
        "[m.__setitem__(i, 1) for i in range(0, 64 << 20, 4096)]; time.sleep(1.5)"
    )
    assert main(["--", sys.executable, "-c", touch]) == 0
    out = capsys.readouterr().out
    assert "(of which system, minor page faults)" in out
    faults = [
        int(line.rsplit(",", 1)[1].strip(" )"))
        for line in out.splitlines()
        if line.endswith(")") and "%" in line
    ]
    assert faults and max(faults) >= 16384  # 64 MiB in 4 KiB pages


@pytest.mark.integration
def test_a_process_that_exited_keeps_the_kind_it_had_while_it_ran():
    """A child seen alive, then left unreaped (a zombie: its command line reads empty) while its parent
    sleeps, still counts under its kind, not under an empty or unknown one."""
    import sys

    from benchmarks.cpu_by_process import measure

    burn = "import time; t = time.process_time(); exec('while time.process_time() - t < 1.5: pass')"
    parent = (
        "import subprocess, sys, time; "
        f"c = subprocess.Popen([sys.executable, '-c', {burn!r}, 'demo']); "
        "time.sleep(4.0); c.wait()"
    )
    rc, totals, _, _ = measure([sys.executable, "-c", parent], every_s=0.2)
    assert rc == 0
    assert totals.get("demo", 0.0) >= 1.0, totals
    assert not {"", "?"} & set(totals), totals
