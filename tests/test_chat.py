"""Chat data (etrain/data/chat.py): records rendered with the model's own template, the loss on the assistant's
answers alone, conversations packed whole; bad records and templates refused by name; a template read from a file
reaches nothing but its messages. Unit tier: no Ray, no process group."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from etrain.core.models.shared import IGNORED, inputs_and_targets, next_token_loss
from etrain.data import chat
from etrain.data.shards import ShardReader

from helpers import chat as fixtures


@pytest.fixture(scope="module")
def tok():
    return fixtures.tokenizer()


@pytest.mark.parametrize("template", sorted(fixtures.TEMPLATES))
def test_the_targets_are_the_answers_and_their_end_of_turn_and_nothing_else(template, tok, tmp_path, rng):
    """For drawn conversations, in both templates and both places a template is kept: the tokens the loss counts
    decode to the assistant's messages, each with the template's end of turn (and what the template writes after
    it), in order; all the tokens decode to the rendered conversation."""
    draw = random.Random(rng.randrange(2**31))
    for where in ("config", "jinja"):
        directory = fixtures.model_dir(tmp_path / where / template, template, where, tok)
        t = chat.read_template(str(directory))
        for _ in range(20):
            messages = fixtures.conversation(draw)
            text, spans = chat.answer_spans(t, messages)
            tokens = chat.encode(tok, text, spans)
            ids = np.where(tokens < 0, -tokens - 1, tokens)
            assert tok.tokenizer.decode(ids.tolist(), skip_special_tokens=False) == text
            answers = tok.tokenizer.decode(tokens[tokens >= 0].tolist(), skip_special_tokens=False)
            eos = fixtures.EOS[template]
            # ChatML's line break after its end of turn comes with the answer: it is the template's, not the user's
            assert answers.replace(eos + "\n", eos) == "".join(
                m["content"] + eos for m in messages if m["role"] == "assistant"
            )


def test_prompt_and_completion_is_a_user_turn_and_its_answer(tok, tmp_path):
    data = tmp_path / "pc.jsonl"
    data.write_text(json.dumps({"prompt": "what is two plus three", "completion": "five"}) + "\n")
    (messages,) = chat.read_records(str(data))
    assert messages == [{"role": "user", "content": "what is two plus three"}, {"role": "assistant", "content": "five"}]


BAD_LINES = {
    "not json": "{not json",
    "a list": "[1, 2]",
    "no assistant": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    "a role": json.dumps({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    "content not text": json.dumps({"messages": [{"role": "assistant", "content": 3}]}),
    "neither form": json.dumps({"text": "plain"}),
    "completion not text": json.dumps({"prompt": "a", "completion": None}),
}


@pytest.mark.parametrize("bad", sorted(BAD_LINES))
def test_a_bad_record_is_refused_by_its_line_number_before_anything_is_written(bad, tmp_path, rng):
    good = json.dumps({"prompt": "a", "completion": "b"})
    lines = [good] * rng.randint(1, 6)
    at = rng.randint(0, len(lines))
    lines.insert(at, BAD_LINES[bad])
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    directory = fixtures.model_dir(tmp_path / "model", "chatml")
    with pytest.raises(chat.ChatError, match=rf"line {at + 1}: "):
        chat.prepare_chat(str(data), str(directory), 64, str(out), 0.1)
    assert not out.exists()


CRAFTED = {  # what the sandbox does: refuses the call, or gives an attribute it will not show as undefined (nothing)
    "python internals": ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "refused"),
    "a method that mutates": ("{% set _ = messages.append(1) %}{{ messages }}", "refused"),
    "an attribute of a function": ("{{ raise_exception.__globals__ }}{{ messages.__init__ }}", ""),
}


@pytest.mark.parametrize("crafted", sorted(CRAFTED))
def test_a_crafted_template_reaches_nothing_beyond_its_messages(crafted, tmp_path):
    """A template comes from storage: Jinja's immutable sandbox refuses its reach for Python's internals or a
    change to the messages (the refusal names the template), or shows nothing of them."""
    text, expected = CRAFTED[crafted]
    directory = fixtures.model_dir(tmp_path / "m", "chatml")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": text}))
    t = chat.read_template(str(directory))
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    if expected == "refused":
        with pytest.raises(chat.ChatError, match="tokenizer_config.json fails to render"):
            t.render(messages)
    else:
        assert t.render(messages) == expected
    assert messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_a_model_without_a_template_and_a_template_that_rewrites_earlier_turns_are_refused(tmp_path):
    bare = fixtures.model_dir(tmp_path / "bare", "chatml")
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(chat.ChatError, match="has no chat template"):
        chat.read_template(str(bare))
    rewriting = fixtures.model_dir(tmp_path / "rewriting", "chatml")
    config = json.loads((rewriting / "tokenizer_config.json").read_text())
    # Like the templates that drop earlier turns' reasoning: the last message is rendered differently.
    config["chat_template"] = "{% for m in messages %}{{ m['content'] if loop.last else '...' }}{% endfor %}"
    (rewriting / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(chat.ChatError, match="rewrites earlier turns"):
        chat.answer_spans(chat.read_template(str(rewriting)), messages)


def test_a_conversation_longer_than_a_row_is_refused_by_its_record_number(tmp_path, rng):
    lines = [json.dumps({"prompt": "a", "completion": "b"})] * 5
    long_at = rng.randrange(5)
    lines[long_at] = json.dumps({"prompt": "the cat " * 40, "completion": "sat"})
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines))
    refusal = rf"1 of 5 conversations do not fit a row of 97 .*: record {long_at + 1} \("
    with pytest.raises(chat.ChatError, match=refusal):
        chat.prepare_chat(str(data), str(fixtures.model_dir(tmp_path / "m", "chatml")), 96, str(tmp_path / "o"), 0.2)


def test_prepared_chat_packs_whole_conversations_holds_some_out_and_reads_back(tok, tmp_path, rng):
    """Every conversation lands whole in one row of one split (the held-out ones in eval), in order, a row's rest
    padded as context; the rows read back through the shard reader to inputs and targets whose counted positions
    are the answers' tokens."""
    draw = random.Random(rng.randrange(2**31))
    conversations = [fixtures.conversation(draw) for _ in range(draw.randint(12, 40))]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    directory = fixtures.model_dir(tmp_path / "m", draw.choice(sorted(fixtures.TEMPLATES)), tok=tok)
    seq_len = draw.choice([192, 256, 384])
    manifest = chat.prepare_chat(str(data), str(directory), seq_len, str(tmp_path / "out"), 0.25)
    assert manifest["targets"] == chat.TARGETS and manifest["token_dtype"] == "int32"
    t = chat.read_template(str(directory))
    expected = [chat.encode(tok, *chat.answer_spans(t, m)) for m in conversations]
    held = [i for i in range(len(conversations)) if i % 4 == 3]
    for split, ids in (("train", [i for i in range(len(conversations)) if i not in held]), ("eval", held)):
        reader = ShardReader(str(tmp_path / "out" / "manifest.json"), split)
        rows = reader.get(np.arange(len(reader)))
        # the model's end of text fills a row's end only: the conversations' tokens are the rest, in order
        pad = -chat.read_file(str(directory)).eos - 1
        stream = [v for row in rows for v in np.trim_zeros(row - pad, "b") + pad]
        assert stream == [v for i in ids for v in expected[i].tolist()]
        assert all(row[0] != pad for row in rows)  # no empty row
        x, y = inputs_and_targets(torch.from_numpy(rows.astype(np.int64)))
        assert (x >= 0).all()
        counted = y[y != IGNORED]
        assert counted.tolist() == [v for row in rows for v in row[1:].tolist() if v >= 0]


def test_the_loss_is_each_rows_mean_over_its_answers_and_a_row_without_any_counts_zero(rng):
    """The loss ignores context positions whatever they hold, weighs rows alike however many answer tokens each
    has, gives 0 (not NaN) for a row without any, and is the same split into micro-batches of any size."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(6, 9, 11, generator=g)
    targets = torch.randint(0, 11, (6, 9), generator=g)
    counted = torch.rand(6, 9, generator=g) < 0.4
    counted[2] = False  # a row of context alone
    masked = torch.where(counted, targets, IGNORED)
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(6, 9)
    rows = [per_token[r][counted[r]].mean() if counted[r].any() else torch.tensor(0.0) for r in range(6)]
    torch.testing.assert_close(next_token_loss(logits, masked), torch.stack(rows).mean())
    other = torch.where(counted, targets, torch.randint(0, 11, (6, 9), generator=g))  # other context, same answers
    assert torch.isfinite(next_token_loss(logits, masked))
    torch.testing.assert_close(
        next_token_loss(logits, torch.where(counted, other, IGNORED)), next_token_loss(logits, masked)
    )
    split = rng.choice([1, 2, 3])
    parts = [next_token_loss(a, b) * len(a) / 6 for a, b in zip(logits.split(split), masked.split(split))]
    torch.testing.assert_close(sum(parts), next_token_loss(logits, masked))
    # Pre-training rows (no context marked): the plain mean over every position.
    torch.testing.assert_close(next_token_loss(logits, targets), per_token.mean())


def test_chat_data_is_prepared_once_per_content_and_a_changed_file_gets_its_own(tmp_path, rng):
    """`etrain finetune --data` prepares under run.root/chat-data/ by what the shards are made of: asked again, the
    same directory, untouched; a changed file, template or seq_len, another one, the first left as it was."""
    directory = fixtures.model_dir(tmp_path / "m", rng.choice(sorted(fixtures.TEMPLATES)))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(8)))
    root = str(tmp_path / "runs")
    first = chat.prepared(str(data), str(directory), 64, 0.25, root)
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs" / "chat-data").rglob("*")}
    assert chat.prepared(str(data), str(directory), 64, 0.25, root) == first
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs" / "chat-data").rglob("*")} == stamps
    assert chat.prepared(str(data), str(directory), 96, 0.25, root) != first
    data.write_text(data.read_text() + json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    changed = chat.prepared(str(data), str(directory), 64, 0.25, root)
    assert changed != first and json.loads(open(first).read())["splits"]["train"]["samples"] >= 1
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs" / "chat-data").rglob("*") if p in stamps} == stamps


def test_finetune_data_refusals_name_the_problem_and_leave_no_run_behind(tmp_path, capsys):
    """A bad record is refused before Ray starts (exit 2), named by its line, and no run directory is left."""
    from etrain.cli import main

    directory = fixtures.model_dir(tmp_path / "m", "chatml")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{broken\n")
    llama = ["model.family=llama", "model.vocab_size=320", "model.n_kv_head=2", "model.seq_len=64"]
    _write_hf_model(directory, llama)
    sets = [x for s in [f"run.root={tmp_path / 'runs'}"] for x in ("--set", s)]
    assert main(["finetune", "--from", str(directory), "--data", str(data), *sets, "--no-progress"]) == 2
    assert "line 2: " in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not [p for p in (tmp_path / "runs").iterdir() if p.name != "chat-data"]


def _write_hf_model(directory, overrides: list[str]) -> None:
    """Our tiny model of `overrides` written as a Hugging Face directory beside the tokenizer already there."""
    from etrain.core import hf
    from etrain.core.config import load_config
    from etrain.core.models import make_model

    cfg = load_config("tiny", overrides)
    hf.write(make_model(cfg.model).state_dict(), cfg.model, directory)
