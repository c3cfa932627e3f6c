"""The ``swarm codecs`` subcommand lists every codec and validates specs."""

from __future__ import annotations

from swarm.cli import main


def test_codecs_lists_every_codec_with_ratio(capsys):
    assert main(["codecs", "--params"]) == 0
    out = capsys.readouterr().out
    for name in ("none", "fp16", "bf16", "int8", "blockwise8", "blockwise4", "lowrank"):
        assert f"\n{name} " in out
    assert "3.94x" in out and "block=int" in out


def test_codecs_check_spec(capsys):
    assert main(["codecs", "--check", "lowrank:ratio=16,factors=blockwise8,ef=1"]) == 0
    assert "lowrank:ratio=16,iters=2,factors=blockwise8,ef=1" in capsys.readouterr().out
    assert main(["codecs", "--check", "blockwize8"]) == 1
    assert "unknown codec 'blockwize8'" in capsys.readouterr().err
