"""The command line answers at once: no Ray or torch behind `--help`, `config` or `status RUN`, defaults and
examples in every `--help`, and the status of a run read from its directory, also once it has ended."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etrain.cli import _parser, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [["--help"], ["config", "-c", "tiny"], ["status", "--help"], ["train", "--help"]])
def test_the_cli_loads_neither_ray_nor_torch_to_answer(argv):
    code = (
        f"import sys; from etrain.cli import main\ntry: main({argv!r})\nexcept SystemExit: pass\n"
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr


def test_every_command_shows_its_defaults_and_an_example():
    commands = _parser()._subparsers._group_actions[0].choices
    for name, parser in commands.items():
        text = parser.format_help()
        assert "examples:\n  etrain " in text or "examples:\n  ray " in text, name
    assert "(default: 30.0)" in commands["train"].format_help() and "(default: 2.0)" in commands["status"].format_help()


def status_file(run_dir: Path, phase: str, **more) -> None:
    run_dir.mkdir()
    st = {
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "phase": phase,
        "failure": None,
        "step": 40,
        "total_steps": 40,
        "eta_s": None,
        "elapsed_s": 12.0,
        "loss": 2.5,
        "eval_loss": 2.6,
        "tokens_per_s": 1000.0,
        "mfu": None,
        "last_checkpoint": None,
        "world_size": 2,
        "wanted": 2,
        "autoscaling": False,
        "warm_pool_ready": 0,
        "warm_pool_starting": 0,
        "recoveries": 0,
        "generation": 1,
        "draining_nodes": [],
        "balanced": False,
        "comm": "allreduce",
        "members": [],
        "updated": time.time(),
        **more,
    }
    (run_dir / "status.json").write_text(json.dumps(st))


def test_status_of_an_ended_run_is_read_from_its_directory(tmp_path, capsys):
    status_file(tmp_path / "done", "finished")
    assert main(["status", str(tmp_path / "done")]) == 0  # the live view stops: the job has ended
    assert "(the job has ended)" in capsys.readouterr().out
    status_file(tmp_path / "broke", "failed", failure="lost workers more than cluster.max_recoveries=3 times", step=17)
    assert main(["status", str(tmp_path / "broke"), "--once"]) == 0
    out = capsys.readouterr().out
    assert "the job failed: lost workers more than" in out and "step 17/40" in out
    status_file(tmp_path / "quiet", "running", updated=time.time() - 120)
    assert main(["status", str(tmp_path / "quiet"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["updated_s_ago"] > 100
    (tmp_path / "empty").mkdir()
    assert main(["status", str(tmp_path / "empty")]) == 2


def test_status_tells_nodes_apart_that_share_their_first_characters(tmp_path, capsys):
    """Issue 27, defect 14: Ray's fake nodes share the first 8 characters of their ids, and `etrain status` showed
    two nodes as one (`node ffffffff` twice). Each is shown by as many characters as tell them apart."""
    a, b = "ffffffff" + "0" * 10 + "a1" + "9" * 36, "ffffffff" + "0" * 10 + "b2" + "9" * 36
    members = [{"rank": r, "node": n, "pid": 10 + r, "speed": None} for r, n in enumerate([a, b])]
    status_file(tmp_path / "two", "running", members=members, draining_nodes=[b])
    assert main(["status", str(tmp_path / "two"), "--once"]) == 0
    out = capsys.readouterr().out
    assert f"rank 0: node {a[:19]} " in out and f"rank 1: node {b[:19]} " in out
    assert f"draining nodes (preemption or health): {b[:19]}" in out
    status_file(tmp_path / "one", "running", members=members[:1])
    assert main(["status", str(tmp_path / "one"), "--once"]) == 0
    assert f"rank 0: node {a[:8]} " in capsys.readouterr().out  # alone: the usual 8
