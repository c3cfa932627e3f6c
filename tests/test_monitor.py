"""swarm monitor: snapshot and rendering (pure), the HTTP server, and a live swarm in a headless browser.

The browser test starts a bootstrap and a few DHT nodes on loopback that announce PeerRecords and
publish trainer progress, serves the monitor, and loads the page in Debian's chromium
(``--dump-dom`` and ``--screenshot``; the screenshot's path is printed). Tests never install
anything: without chromium on PATH the browser test skips with the reason (``make browser``
installs it, see README's "Tests").
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from swarm.dht.records import PeerRecord
from swarm.errors import ConfigError
from swarm.run.spec import RunSpec
from swarm.tools.monitor import (
    MonitorConfig,
    MonitorServer,
    MonitorState,
    line_chart_svg,
    render_page,
    render_prometheus,
)
from swarm.tools.status import RunStatus, StageStatus
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"
B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _pid(i: int) -> str:
    return "Qm" + "".join(B58[(i * 7 + k * 13) % len(B58)] for k in range(44))


def _spec(stages: int = 3) -> RunSpec:
    d = RunSpec.from_yaml(TINY).to_dict()
    d["stages"] = stages
    return RunSpec.from_dict(d)


def _rec(
    spec: RunSpec, peer_id: str, stage: int, throughput: float, state: str = "online", **kw
) -> PeerRecord:
    fields = dict(queue=2, version=7, codecs=("blockwise8",), software="0.1.0")
    fields.update(kw)
    return PeerRecord(
        peer_id=peer_id,
        run_id=spec.run_id,
        stage=stage,
        state=state,
        throughput=throughput,
        spec_hash=spec.spec_hash,
        **fields,
    )


def _status(
    spec: RunSpec, peers_by_stage: list[list[PeerRecord]], *, tokens=0, loss=None, tps=0.0
) -> RunStatus:
    progress = {
        "trainers": {"t1": {"tokens": tokens, "steps": tokens // 1024, "loss": loss, "tokens_per_s": tps}}
        if tokens
        else {},
        "tokens": tokens,
        "steps": tokens // 1024,
        "tokens_per_s": tps,
        "loss": loss,
    }
    stages = tuple(
        StageStatus(stage=s, layers=spec.stage_layers(s), peers=tuple(peers_by_stage[s]))
        for s in range(spec.num_stages)
    )
    return RunStatus(run_id=spec.run_id, spec_hash=spec.spec_hash, stages=stages, progress=progress)


class _Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ----------------------------------------------------------------------------------- pure parts


def test_config_rejects_bad_values_with_the_rule():
    for kwargs, match in (
        ({"port": 70000}, "TCP port"),
        ({"port": True}, "TCP port"),
        ({"host": ""}, "address to bind"),
        ({"poll_interval_s": 0}, "poll_interval_s"),
        ({"refresh_s": float("nan")}, "refresh_s"),
        ({"history": 1}, "history"),
        ({"run_id": "bad.run"}, "run id"),
        ({"secret": bytes(32)}, "needs run_id"),
    ):
        with pytest.raises(ConfigError, match=match):
            MonitorConfig(**kwargs)
    assert MonitorConfig(port=0, run_id="tiny").host == "127.0.0.1"


def test_state_keeps_a_bounded_history_and_first_sightings():
    spec = _spec(3)
    a, b = _pid(1), _pid(2)
    clock = _Clock()
    state = MonitorState(history=3, clock=clock)
    assert state.snapshot()["runs"] == [] and state.snapshot()["monitor"]["polls"] == 0

    peers = [[_rec(spec, a, 0, 100.0)], [_rec(spec, b, 1, 50.0)], []]
    state.update([(_status(spec, peers, tokens=1024, loss=5.0, tps=10.0), spec)])
    clock.t += 30
    # Same progress again: no new sample (a stalled run does not fill the history).
    snap = state.update([(_status(spec, peers, tokens=1024, loss=5.0, tps=10.0), spec)])
    [run] = snap["runs"]
    assert len(run["history"]) == 1 and snap["monitor"]["polls"] == 2
    assert run["stages"][0]["peers"][0]["seen_for_s"] == 30.0
    assert run["uncovered_stages"] == [2] and run["bottleneck_tokens_per_s"] == 0.0

    for i in range(5):
        clock.t += 10
        state.update([(_status(spec, peers, tokens=2048 * (i + 1), loss=4.0 - i * 0.1, tps=20.0), spec)])
    run = state.snapshot()["runs"][0]
    assert [h["tokens"] for h in run["history"]] == [6144, 8192, 10240], "oldest samples are dropped"
    assert [h["losses"] for h in run["history"]] == [{"t1": pytest.approx(x)} for x in (3.8, 3.7, 3.6)]
    assert 'data-series="t1"' in render_page(state.snapshot())  # the trainer's loss line

    # b leaves stage 1 and comes back: its "seen for" starts again; a's keeps counting.
    state.update([(_status(spec, [peers[0], [], []]), spec)])
    clock.t += 5
    run = state.update([(_status(spec, peers), spec)])["runs"][0]
    assert run["stages"][1]["peers"][0]["seen_for_s"] == 0.0
    assert run["stages"][0]["peers"][0]["seen_for_s"] == 85.0

    state.error("the DHT did not answer get swarmpipe_runs within 20 s")
    snap = state.snapshot()
    assert snap["monitor"]["errors"] == 1 and snap["runs"], "the last good data stays"
    assert "did not answer" in render_page(snap)


def test_page_shows_every_stage_and_peer_and_escapes_peer_strings():
    spec = _spec(3)
    a, b, c = _pid(1), _pid(2), _pid(3)
    state = MonitorState(clock=_Clock())
    peers = [
        [_rec(spec, a, 0, 120.5), _rec(spec, c, 0, 80.0, state="joining", queue=5)],
        [_rec(spec, b, 1, 60.25, state="leaving", software="<script>alert(1)</script>")],
        [],
    ]
    snap = state.update([(_status(spec, peers, tokens=4096, loss=3.25, tps=512.0), spec)])
    page = render_page(snap, refresh_s=2.0)
    for pid in (a, b, c):
        assert f'data-peer="{pid}"' in page
    assert page.count("UNCOVERED") == 3  # stage 2 (no peers), stage 1 (only a leaving peer, row + total)
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert (
        'class="stage uncovered" data-stage="1"' in page and 'class="stage uncovered" data-stage="2"' in page
    )
    assert 'class="stage" data-stage="0"' in page
    assert "setInterval(tick, 2000)" in page and "3.2500" in page
    run = snap["runs"][0]
    # Bytes per token: fp32 reference 2 * (3 - 1) * 128 * 4; blockwise8 is ~4x smaller each way.
    assert run["bytes_per_token"]["uncompressed"] == 2048.0
    assert 400 < run["bytes_per_token"]["nominal"] < 600 and run["bytes_per_token"]["measured"] is None
    assert run["stages"][0]["throughput"] == 200.5 and run["stages"][0]["active_peers"] == 2
    assert json.loads(json.dumps(snap)) == snap


def test_measured_bytes_per_token_comes_from_trainers_that_report_it():
    spec = _spec(2)
    status = _status(
        spec, [[_rec(spec, _pid(1), 0, 1.0)], [_rec(spec, _pid(2), 1, 1.0)]], tokens=1024, loss=2.0
    )
    status.progress["trainers"] = {
        "t1": {"tokens": 1024, "steps": 1, "loss": 2.0, "tokens_per_s": 1.0, "bytes_per_token": 300.0},
        "t2": {"tokens": 0, "steps": 0, "loss": None, "tokens_per_s": 0.0, "bytes_per_token": 500.0},
        "t3": {"tokens": 0, "steps": 0, "loss": None, "tokens_per_s": 0.0},
    }
    run = MonitorState(clock=_Clock()).update([(status, spec)])["runs"][0]
    assert run["bytes_per_token"]["measured"] == 400.0
    assert run["bottleneck_tokens_per_s"] == 1.0


def test_prometheus_text_has_typed_gauges_and_escaped_labels():
    spec = _spec(2)
    a = _pid(4)
    peers = [[_rec(spec, a, 0, 42.0, queue=3, version=9)], []]
    snap = MonitorState(clock=_Clock()).update(
        [(_status(spec, peers, tokens=2048, loss=4.5, tps=99.0), spec)]
    )
    text = render_prometheus(snap)
    lines = text.splitlines()
    assert text.endswith("\n") and "# TYPE swarm_peer_queue gauge" in lines
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")
    }
    assert samples[f'swarm_peer_queue{{run="tiny",stage="0",peer="{a}",state="online"}}'] == 3
    assert samples['swarm_stage_covered{run="tiny",stage="1"}'] == 0
    assert (
        samples['swarm_run_loss{run="tiny"}'] == 4.5
        and samples['swarm_run_uncovered_stages{run="tiny"}'] == 1
    )
    assert samples['swarm_run_bytes_per_token{run="tiny",kind="uncompressed"}'] == 1024
    # Every sample line belongs to a family declared just before it.
    declared = {line.split()[2] for line in lines if line.startswith("# TYPE")}
    assert all(re.split(r"[{ ]", line)[0] in declared for line in lines if not line.startswith("#"))
    assert "swarm_monitor_polls 1" in lines  # no empty braces on unlabelled samples


def test_chart_is_valid_svg_and_says_when_it_waits_for_data():
    ns = "{http://www.w3.org/2000/svg}"
    empty = line_chart_svg([("t1", [(0.0, 1.0)])], title="loss", x_label="minutes")
    assert "waiting for data" in empty
    ET.fromstring(empty)
    pts = [(0.0, 5.5), (1.0, 4.0), (2.5, 3.1), (3.0, float("nan"))]
    root = ET.fromstring(line_chart_svg([("t1", pts)], title="loss <1>", x_label="m"))
    [line] = root.iter(f"{ns}polyline")
    assert len(line.get("points").split()) == 3  # the NaN point is left out
    assert any(t.text == "loss <1>" for t in root.iter(f"{ns}text"))
    assert not [t for t in root.iter(f"{ns}text") if t.get("class") == "legend"], "one line: no legend"
    flat = line_chart_svg([("t1", [(0.0, 2.0), (1.0, 2.0)])], title="flat", x_label="m")  # zero y range
    ET.fromstring(flat)
    # Several trainers: one line each, with a legend; a shared x range places them in time.
    two = ET.fromstring(
        line_chart_svg(
            [("a", [(0.0, 3.0), (1.0, 2.0)]), ("b<", [(5.0, 4.0), (6.0, 3.5)])],
            title="loss",
            x_label="s",
            x_range=(0.0, 10.0),
        )
    )
    lines = list(two.iter(f"{ns}polyline"))
    assert [x.get("data-series") for x in lines] == ["a", "b<"]
    assert float(lines[1].get("points").split()[0].split(",")[0]) > 250  # x = 5 of 0..10 is mid-plot
    assert {t.text for t in two.iter(f"{ns}text") if t.get("class") == "legend"} == {"a", "b<"}


# ------------------------------------------------------------------------------ the HTTP server


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


@pytest.mark.integration
def test_server_serves_page_json_metrics_and_404():
    spec = _spec(2)
    state = MonitorState(clock=_Clock())
    state.update([(_status(spec, [[_rec(spec, _pid(5), 0, 10.0)], []], tokens=1024, loss=3.0), spec)])
    server = MonitorServer(state, host="127.0.0.1", port=0, refresh_s=1.0, prometheus=True)
    try:
        url = server.url
        assert url.startswith("http://127.0.0.1:")
        code, ctype, body = _get(url)
        assert code == 200 and ctype.startswith("text/html") and _pid(5) in body
        code, ctype, body = _get(url + "api/status")
        assert code == 200 and ctype == "application/json"
        assert json.loads(body)["runs"][0]["uncovered_stages"] == [1]
        code, _, body = _get(url + "fragment")
        assert code == 200 and "<html" not in body and "UNCOVERED" in body
        code, ctype, body = _get(url + "metrics")
        assert code == 200 and ctype.startswith("text/plain") and "swarm_run_peers" in body
        code, _, body = _get(url + "nope")
        assert code == 404 and "/api/status" in body
        # The port is taken: a second server says so and names the flag to change.
        with pytest.raises(ConfigError, match="--port"):
            MonitorServer(
                state,
                host="127.0.0.1",
                port=int(url.rsplit(":", 1)[1].strip("/")),
                refresh_s=1.0,
                prometheus=False,
            )
    finally:
        server.close()
    no_metrics = MonitorServer(state, host="127.0.0.1", port=0, refresh_s=1.0, prometheus=False)
    try:
        assert _get(no_metrics.url + "metrics")[0] == 404
    finally:
        no_metrics.close()


def test_cli_flags_map_to_the_config():
    from swarm.cli import build_parser
    from swarm.cli.commands.monitor import config_from_args

    maddr = "/ip4/127.0.0.1/tcp/4001/p2p/QmWcs14zqAdEZtLLGwoFcCRp18SE78VmhZgGqmnVBuiRhz"
    args = build_parser().parse_args(
        [
            "monitor",
            "--initial-peers",
            maddr,
            "--run",
            "tiny",
            "--port",
            "0",
            "--history",
            "50",
            "--no-prometheus",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.run_id == "tiny" and cfg.port == 0 and cfg.history == 50 and not cfg.prometheus
    assert cfg.dht.client_mode and cfg.dht.initial_peers == (maddr,) and cfg.host == "127.0.0.1"
    args = build_parser().parse_args(["monitor", "--initial-peers", maddr, "--poll-interval-s", "-1"])
    with pytest.raises(ConfigError, match="poll_interval_s"):
        config_from_args(args)


# --------------------------------------------------------------------- live swarm + real browser


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:  # tests never install anything; README, "Tests", says how to get the browser test
        pytest.skip("chromium is not on PATH for the browser test (`make browser` installs it)")
    return found


def _browser(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
    ]
    return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=90)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_monitor_page_of_a_live_swarm_in_a_headless_browser(tmp_path):
    from swarm.dht.membership import Membership
    from swarm.dht.network import DHTConfig, start_dht
    from swarm.tools.bootstrap import Bootstrap, BootstrapConfig
    from swarm.tools.monitor import Monitor

    chromium = _chromium()
    spec = _spec(3)
    boot = Bootstrap(BootstrapConfig(spec=spec, refresh_interval_s=5.0))
    dhts: list = []
    monitor = None
    try:
        boot.start()
        initial = tuple(boot.maddrs)
        members = []
        for _ in range(3):
            dht = start_dht(DHTConfig(initial_peers=initial))
            dhts.append(dht)
            m = Membership(dht, spec.run_id)
            m.fetch_spec(timeout_s=10)
            members.append(m)
        a, b, c = members
        # Stages 0 and 1 are served (a and c on stage 0), stage 2 is not.
        assert a.announce(_rec(spec, a.peer_id, 0, 1500.0, version=12), expiration_s=60)
        assert c.announce(
            _rec(spec, c.peer_id, 0, 900.0, state="joining", queue=0, version=0), expiration_s=60
        )
        assert b.announce(_rec(spec, b.peer_id, 1, 2100.0, queue=4, version=12), expiration_s=60)

        monitor = Monitor(
            MonitorConfig(
                dht=DHTConfig(initial_peers=initial, client_mode=True),
                run_id=spec.run_id,
                port=_free_port(),
                poll_interval_s=0.3,
                refresh_s=1.0,
            )
        )
        monitor.start()

        # A trainer's loss falls while the monitor polls: the monitor keeps the curve itself (each
        # value is published once the monitor has sampled the one before, so every one is a point).
        def last_tokens() -> int | None:
            runs = monitor.state.snapshot()["runs"]
            return runs[0]["history"][-1]["tokens"] if runs and runs[0]["history"] else None

        for i in range(6):
            a.publish_progress(
                "trainer-1",
                tokens=8192 * (i + 1),
                steps=8 * (i + 1),
                loss=5.5 - 0.4 * i,
                tokens_per_s=900.0 + 40 * i,
            )
            wait_until(lambda n=8192 * (i + 1): last_tokens() == n, 30, f"the monitor's sample {i + 1}")

        def seen() -> dict | None:
            runs = json.loads(_get(monitor.url + "api/status")[2])["runs"]
            return runs[0] if runs and len(runs[0]["history"]) >= 4 and runs[0]["peers"] == 3 else None

        run = wait_until(seen, 30, "the monitor to see the swarm's 3 peers")
        assert run["uncovered_stages"] == [2]
        assert {p["peer_id"] for p in run["stages"][0]["peers"]} == {a.peer_id, c.peer_id}
        assert [p["peer_id"] for p in run["stages"][1]["peers"]] == [b.peer_id]
        assert run["progress"]["loss"] is not None and run["model"]["n_layers"] == 4

        dom = _browser(chromium, tmp_path / "profile", "--dump-dom", monitor.url)
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        for peer in (a, b, c):
            assert f'data-peer="{peer.peer_id}"' in html
        for stage in range(3):
            assert f'data-stage="{stage}"' in html
        assert 'class="stage uncovered" data-stage="2"' in html and "1 of 3 stages uncovered" in html
        assert "<polyline" in html and "swarm monitor · tiny" in html

        shot = tmp_path / "monitor.png"
        res = _browser(
            chromium,
            tmp_path / "profile",
            f"--screenshot={shot}",
            "--window-size=1280,1250",
            "--hide-scrollbars",
            monitor.url,
        )
        assert res.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, res.stderr[-2000:]
        print(f"monitor screenshot: {shot}")
    finally:
        if monitor is not None:
            monitor.close()
        for dht in dhts:
            dht.shutdown()
        boot.close()
