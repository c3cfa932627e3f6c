import subprocess
import sys

from swarm.cli import main
from swarm.version import __version__


def test_version_flag(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert __version__ in capsys.readouterr().out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "swarm.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "swarmpipe" in out.stdout
