import re

import pytest

from etrain.cli import main
from etrain.core.config import PRESET_DIR, ConfigError, load_config


def test_presets_all_validate():
    names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    assert {"tiny", "small", "gpu-1b"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert cfg.timeouts.collective_s < cfg.timeouts.step_s < cfg.timeouts.join_s


def test_override_sets_typed_value():
    cfg = load_config("tiny", ["train.steps=7", "optim.lr=1e-4", "model.positions=learned"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.model.positions) == (7, 1e-4, "learned")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stepz=3", "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
        ("trian.steps=3", "unknown config key 'trian' (did you mean 'train'?)"),
        ("train.steps=abc", "config key 'train.steps': Input should be a valid integer"),
        ("train.steps=0", "config key 'train.steps': Input should be greater than or equal to 1"),
        ("model.positions=alibi", "config key 'model.positions'"),
        ("model.d_model=130", "must be a multiple of model.n_head"),
        ("timeouts.step_s=30", "timeouts must nest: collective_s < step_s < join_s"),
        ("train.precision=fp16", "fp16 needs a GPU"),
        ("comm.compression=gzip", "config key 'comm.compression'"),
        ("comm.zero=true checkpoint.every=0", "comm.zero needs checkpoint.every > 0"),
        ("comm.mode=ps train.batch_scaling=linear", "comm.mode=ps needs train.batch_scaling=constant"),
        ("comm.mode=ps comm.zero=true", "comm.zero and comm.compression apply to allreduce only"),
        ("comm.mode=ps train.global_batch=15", "make train.global_batch=15 a multiple of cluster.num_workers=2"),
        ("balance.slow_below=1.5", "config key 'balance.slow_below'"),
        ("faults=[{rank: 0, step: 1, kind: slow, factor: 0.5}]", "config key 'faults.0.factor'"),
        ("train", "must look like section.key=value"),
        # issue 15, defect 9: values that used to pass
        ("optim.lr=.inf", "config key 'optim.lr': Input should be a finite number"),
        ("train.steps=true", "config key 'train.steps': must be a number, not true"),
        ("faults=[{rank: 5, step: 3}]", "faults[0].rank=5 never fires: the run has at most 2 worker(s)"),
        ("train=3", "is a section"),
        ("comm.mode=diloco comm.compression=topk", "comm.mode=diloco does not support comm.compression=topk"),
        ("comm.mode=diloco comm.zero=true", "comm.mode=diloco does not support comm.zero"),
        ("comm.mode=diloco parallel.tp=2", "comm.mode=diloco with parallel.tp × parallel.pp × parallel.shard > 1"),
        ("comm.diloco.inner_steps=0", "config key 'comm.diloco.inner_steps'"),
        ("comm.mode=ps faults=[{rank: 0, step: 1, kind: link, gbps: 1}]", "comm.mode=ps, parallel layouts and PPO"),
        ("parallel.tp=2 faults=[{rank: 0, step: 1, kind: link, gbps: 1}]", "leave the link fault out"),
        ("faults=[{rank: 0, step: 1, kind: link}]", "a link fault needs `gbps`"),
        ("faults=[{rank: 0, step: 1, kind: kill, gbps: 1}]", "`gbps` applies to link faults, not kill"),
        ("faults=[{rank: 0, step: 1, kind: link, gbps: 0}]", "config key 'faults.0.gbps'"),
        ("ppo.algorithm=grpo", "set ppo.group to 2 or more"),  # issue 43: GRPO's groups
        ("ppo.algorithm=grpo ppo.group=5", "ppo.rollouts=32 is not a multiple of ppo.group=5"),
        ("ppo.algorithm=gspo", "config key 'ppo.algorithm'"),
    ],
)
def test_bad_override_names_key_and_problem(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", re.split(r" (?=\w[\w.]*=)", override))  # at each key=, not inside a fault's value
    assert expected in str(err.value)


def test_bad_value_error_shows_the_value():
    with pytest.raises(ConfigError, match="got 'alibi'"):
        load_config("tiny", ["model.positions=alibi"])


def test_unknown_preset_suggests_name():
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        load_config("tny")


def test_yaml_file_with_unknown_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  n_layers: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'model.n_layer'"):
        load_config(str(path))


@pytest.mark.parametrize(
    "argv",
    [
        ["config", "-c", "tiny", "--set", "train.stepz=1"],
        ["config", "-c", "nope.yaml"],
        ["train", "--resume", "/nonexistent/run"],
    ],
)
def test_cli_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "etrain: error:" in capsys.readouterr().err


def test_cli_unknown_flag_exits_2():
    with pytest.raises(SystemExit) as e:
        main(["train", "--bogus"])
    assert e.value.code == 2


def test_config_hash_ignores_where_it_runs():
    a = load_config("tiny")
    assert a.hash() == load_config("tiny", ["cluster.num_workers=1", "run.root=/elsewhere", "train.steps=999"]).hash()
    assert a.hash() != load_config("tiny", ["optim.lr=1e-4"]).hash()


def test_resume_refuses_changes_to_what_is_trained(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(load_config("tiny").to_yaml())
    assert main(["train", "--resume", str(tmp_path), "--set", "optim.lr=1"]) == 2
    assert "optim.lr cannot change on resume" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path), "--config", "tiny"]) == 2


def test_config_states_the_models_memory_and_warns_beyond_this_machine(capsys):
    """Issue 15, defect 9: `etrain config` accepted a model of 10^22 parameters without a word."""
    assert main(["config", "-c", "tiny"]) == 0
    err = capsys.readouterr().err
    assert (
        f"model: {load_config('tiny').model.param_count():,} parameters; about 0.03 GiB per worker" in err
        and "warning" not in err
    )
    assert main(["config", "-c", "tiny", "--set", "model.d_model=1048576"]) == 0
    assert "warning: that is more than this machine's" in capsys.readouterr().err


def test_param_count_matches_the_model():
    from etrain.core.models.gpt.model import GPT

    for overrides in (
        [],
        ["model.positions=learned", "model.tie_weights=false"],
        ["model.n_layer=3", "model.d_model=96", "model.n_head=3"],
    ):
        cfg = load_config("tiny", overrides)
        assert cfg.model.param_count() == GPT(cfg.model).num_params()
