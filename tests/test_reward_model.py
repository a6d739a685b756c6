"""A reward as a Hugging Face sequence-classification directory (issue 43, item 4): the scores equal transformers'
for the same conversations, rendered with the directory's chat template where it has one; what is not a one-label
classifier of a supported family, or not safe to read, is refused by name. No Ray: the rewarder's scoring is the
same call (tests/test_ppo_run.py runs one in a run)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from etrain.core.config import ConfigError
from etrain.data import rewards
from etrain.data.reward_model import RewardModel, is_reward_model

from helpers import chat
from helpers.reward_model import reward_dir, theirs


@pytest.mark.parametrize("template", [None, "chatml", "llama3"])
def test_a_reward_model_scores_as_transformers_does(template, rng, tmp_path, monkeypatch):
    path, model = reward_dir(rng, tmp_path / "rm", template)
    ours = RewardModel(str(path))
    words = chat.WORDS
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(11)]
    responses = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 9))) for _ in range(11)]
    got = ours.score(prompts, responses)  # 11: a batch of 8 and one of 3, each right-padded
    for prompt, response, score in zip(prompts, responses, got):
        if template is None:
            expected = theirs(model, ours.tokenizer, prompt + response, True)
        else:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            expected = theirs(model, ours.tokenizer, ours.template.render(messages), False)
        assert score == pytest.approx(expected, abs=1e-4), (prompt, response)
    assert len(set(got)) > 1  # the scores tell the conversations apart
    task = rewards.load(str(path))  # the rewarder's task: the directory, scored in batches
    assert is_reward_model(str(path)) and rewards.score_all(task, prompts, responses) == got
    monkeypatch.chdir(tmp_path)
    assert rewards.resolve("rm") == str(path)  # stored absolute: the rewarder runs elsewhere


def _config(path, **change):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | change))


def _drop_score(path):
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "score.weight"}, path / "model.safetensors")


def _pickle_instead(path):
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()


def _reshape_layer(path):
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 3)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "spoil, named",
    [
        (lambda p: _config(p, id2label={"0": "bad", "1": "good"}), "has 2 labels: a reward model scores with one"),
        (lambda p: _config(p, architectures=["GPT2ForSequenceClassification"]), "GPT2ForSequenceClassification is not"),
        (_drop_score, "holds no tensor score.weight"),
        (_pickle_instead, "holds no model.safetensors"),  # a pickle is never read
        (_reshape_layer, "model.layers.0.mlp.up_proj.weight has shape (7, 3)"),
        (lambda p: (p / "tokenizer.json").unlink(), "cannot be read"),
    ],
    ids=["two-labels", "gpt2", "no-score", "pickle", "shape", "no-tokenizer"],
)
def test_a_reward_model_that_is_not_one_or_not_safe_is_refused_by_name(spoil, named, rng, tmp_path):
    path, _ = reward_dir(rng, tmp_path / "rm")
    spoil(path)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        rewards.load(str(path))
