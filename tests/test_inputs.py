"""Issue 27, defect 7 and its kin: bad input (a run name, a drill's telemetry, the data, the cluster's address, a
run that cannot go on) is refused before Ray starts, with exit code 2, and leaves nothing behind: no run directory,
no file written into what the user gave."""

from __future__ import annotations

import json
import os

import pytest

from etrain.cli import main
from etrain.core import checkpoint
from etrain.core.config import load_config, override
from etrain.core.models import make_model
from etrain.core.models.gpt.model import GPT
from etrain.core.ports import free_port
from etrain.driver.export import export


def train(tmp_path, *sets: str) -> int:
    args = ["train", "--config", "tiny", "--no-progress", "--set", f"run.root={tmp_path / 'runs'}"]
    return main([*args, *(x for s in sets for x in ("--set", s))])


@pytest.mark.parametrize(
    "sets, said",
    [
        (["run.name=../x"], "config key 'run.name': must be one directory name inside run.root"),
        (["run.name=."], "config key 'run.name': must be one directory name inside run.root"),
        (["run.name=" + "名" * 100], "config key 'run.name': is 300 bytes long; a directory name takes at most 255"),
        (["health.script=HERE/missing.jsonl"], "missing.jsonl' cannot be read"),
        (["health.script=HERE/drill.jsonl"], "line 1: `xid` input should be a valid list (got 79)"),
        (["data.source=HERE/nowhere/manifest.json"], "nowhere/manifest.json"),
        ([f"cluster.address=127.0.0.1:{free_port()}"], "(Connection refused); its head is not running"),
    ],
    ids=["outside-root", "the-root", "too-long", "script-missing", "script-values", "data", "address"],
)
def test_bad_input_is_refused_before_ray_starts_and_leaves_no_run_directory(tmp_path, capsys, sets, said):
    (tmp_path / "drill.jsonl").write_text('{"step": 5, "rank": 0, "xid": 79}\n')
    assert train(tmp_path, *(s.replace("HERE", str(tmp_path)) for s in sets)) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()  # nothing made, inside or out


@pytest.fixture
def finished_run(tmp_path):
    """A run directory as a finished `etrain train` leaves one: its config, a final checkpoint, its summary."""
    run = tmp_path / "done"
    run.mkdir()
    cfg = load_config("tiny", ["train.steps=7", "run.name=done", f"run.root={tmp_path}"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    meta = {"cursor": 7 * 16, "config_hash": cfg.hash(), "config": cfg.model_dump()}
    checkpoint.save(str(run / "checkpoints"), 7, {"model.pt": GPT(cfg.model).state_dict()}, meta, keep=3)
    (run / "summary.json").write_text(json.dumps({"steps": 7, "wall_s": 12.5}))
    return run


def test_resuming_a_finished_run_is_refused_and_changes_nothing(finished_run, capsys):
    """Issue 27, defect 10: `--resume` of a finished run started Ray and overwrote summary.json's timings."""
    before = {p.name: p.read_bytes() for p in finished_run.iterdir() if p.is_file()}
    assert main(["train", "--resume", str(finished_run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "has trained all of its train.steps=7" in err and "--set train.steps=N (N > 7)" in err, err
    assert {p.name: p.read_bytes() for p in finished_run.iterdir() if p.is_file()} == before
    assert main(["train", "--resume", str(finished_run), "--set", "train.steps=5", "--no-progress"]) == 2
    assert {p.name: p.read_bytes() for p in finished_run.iterdir() if p.is_file()} == before  # not even config.yaml


def test_resuming_an_export_is_refused_and_writes_nothing_into_it(finished_run, tmp_path, capsys):
    """Issue 27, defect 7: `--resume` of an export directory started Ray and wrote driver.log and status.json
    into the export."""
    out = tmp_path / "exported"
    export(finished_run, out, merge=False)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["train", "--resume", str(out), "--set", "train.steps=9", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is an export of" in err and "etrain finetune --from" in err, err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert "steps: 7" in (out / "config.yaml").read_text()


def test_a_config_of_one_directory_name_in_any_language_is_accepted():
    cfg = load_config("tiny", ["run.name=模型-🚀"])
    assert override(cfg, {"run.name": "a" * 255}).run.name == "a" * 255


def test_export_refuses_a_dangling_link_and_writes_files_as_its_neighbours(finished_run, tmp_path, capsys):
    """Issue 41, defect 10: `--out` through a dangling symbolic link made directories at the link's target, and the
    Hugging Face export's weights were written 0600 (safetensors' own choice) beside 0644 files."""
    target, link = tmp_path / "elsewhere" / "deep", tmp_path / "link"
    link.symlink_to(target)
    assert main(["export", str(finished_run), "--out", str(link)]) == 2
    assert "is a symbolic link to" in capsys.readouterr().err and not (tmp_path / "elsewhere").exists()

    cfg = load_config("tiny", ["model.family=llama", "model.n_kv_head=2", "model.tie_weights=false"])
    run = tmp_path / "llama"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    meta = {"cursor": 0, "config_hash": cfg.hash(), "config": cfg.model_dump()}
    checkpoint.save(str(run / "checkpoints"), 1, {"model.pt": make_model(cfg.model).state_dict()}, meta, keep=1)
    for fmt in ("run", "hf"):
        out = tmp_path / f"out-{fmt}"
        assert main(["export", str(run), "--out", str(out), "--format", fmt]) == 0
        mask = os.umask(0)
        os.umask(mask)
        modes = {p.relative_to(out): oct(p.stat().st_mode & 0o777) for p in out.rglob("*") if p.is_file()}
        assert set(modes.values()) == {oct(0o666 & ~mask)}, modes  # a plain file's, whatever the umask


def test_a_finished_run_whose_final_checkpoint_is_corrupt_may_resume(finished_run):
    """`--resume` of a finished run is refused (nothing to train), but not when its final checkpoint fails
    verification: then the run did not keep its end, and the resume goes back past it (naming it) and trains the
    steps again, instead of telling the user to raise train.steps."""
    from etrain.core.config import ConfigError
    from etrain.driver.job import check_resume

    cfg = load_config(str(finished_run / "config.yaml"), [])
    with pytest.raises(ConfigError, match="has trained all of its train.steps=7"):
        check_resume(finished_run, cfg)
    part = finished_run / "checkpoints" / "step-00000007" / "model.pt"
    part.write_bytes(part.read_bytes()[:100])
    check_resume(finished_run, cfg)  # no refusal: the coordinator takes it from here
