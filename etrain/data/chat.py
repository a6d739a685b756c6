"""Chat records into training rows whose loss falls on the assistant's answers alone.

A record is `{"messages": [{"role", "content"}, ...]}` or `{"prompt", "completion"}` (a user turn and the
assistant's answer). It is rendered with the model's own chat template (`chat_template.jinja`, or
`tokenizer_config.json`'s `chat_template`) in Jinja's immutable sandbox, as `transformers` renders it: a template
read from storage reaches no Python object beyond the messages. An answer is the text one more assistant message
adds to the conversation rendered up to it with the generation prompt, so it ends with the template's own end of
turn and the model learns to stop.

Rows store a token `t` that the loss predicts as `t` and any other (the system's and user's turns, the template's
framing, a row's padding) as `-t - 1`, in int32: the shard, cache and order logic stays as for pre-training, and
`inputs_and_targets` (etrain/core/models/shared.py) turns a row back into inputs and targets. Conversations are
packed whole, one after another, a row padded when the next does not fit; one longer than a row is refused by its
line number rather than cut.
"""

from __future__ import annotations

import functools
import hashlib
import json
import posixpath
from dataclasses import dataclass

import fsspec
import numpy as np

from etrain.core.errors import UsageError
from etrain.data.shards import SplitWriter, write_manifest
from etrain.data.tokenizer import FILE, TokenizerFile, read_file

ROLES = ("system", "user", "assistant")
DTYPE = "int32"  # signed: a negative token is context, not a target
TARGETS = "answers"  # the manifest's `targets`: what the loss counts (absent: every token)


class ChatError(UsageError):
    """Chat data or a chat template that cannot be used; the message names the line or file and what to do."""


def read_records(uri: str) -> list[list[dict]]:
    """Each line's conversation as messages; every bad line named by number before anything is written."""
    try:
        with fsspec.open(uri, "r", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ChatError(f"chat data {uri} not found") from None
    conversations, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            conversations.append(_messages(json.loads(line)))
        except (ValueError, TypeError, KeyError) as e:
            bad.append(f"line {number}: {e}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ChatError(
            f"chat data {uri}: {'; '.join(bad[:5])}{more}. Each line is a JSON object: "
            '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} '
            'or {"prompt": "...", "completion": "..."}'
        )
    if not conversations:
        raise ChatError(f"chat data {uri} holds no records")
    return conversations


def _messages(record) -> list[dict]:
    if not isinstance(record, dict):
        raise ValueError(f"a {type(record).__name__}, not an object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages is not a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"a message must be {{role: {' | '.join(ROLES)}, content: text}}, got {m!r:.80}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("no assistant message: nothing to learn")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    raise ValueError("neither messages nor prompt and completion (text)")


@dataclass(frozen=True)
class Template:
    source: str  # the file it was read from
    text: str
    specials: dict  # bos_token, eos_token: the names a template may print

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        from jinja2.exceptions import TemplateError

        try:
            compiled = _compiled(self.text)
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.specials)
        except TemplateError as e:
            raise ChatError(f"chat template {self.source} fails to render: {e}") from None

    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@functools.lru_cache(maxsize=8)
def _compiled(text: str):
    """The template in Jinja's immutable sandbox, with transformers' options and its `raise_exception`."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(text)
    except TemplateError as e:
        raise ChatError(f"the chat template does not parse: {e}") from None


def read_template(directory: str) -> Template:
    """The chat template kept with a model's tokenizer: `chat_template.jinja`, else tokenizer_config.json's."""
    fs, root = fsspec.core.url_to_fs(str(directory))
    config_path = posixpath.join(root, "tokenizer_config.json")
    config = json.loads(fs.cat_file(config_path)) if fs.isfile(config_path) else {}
    specials = {}
    for name in ("bos_token", "eos_token"):
        value = config.get(name)
        specials[name] = (value.get("content") if isinstance(value, dict) else value) or ""
    jinja = posixpath.join(root, "chat_template.jinja")
    if fs.isfile(jinja):
        return Template(posixpath.join(str(directory), "chat_template.jinja"), fs.cat_file(jinja).decode(), specials)
    text = config.get("chat_template")
    if isinstance(text, list):  # named templates: the default one
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(text, str) or not text:
        raise ChatError(
            f"{directory} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); "
            "chat data is rendered with the model's own template: add one beside its tokenizer"
        )
    _compiled(text)
    return Template(config_path, text, specials)


def answer_spans(template: Template, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant answers."""
    text = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        asked = template.render(messages[:i], add_generation_prompt=True)
        answered = template.render(messages[: i + 1])
        if not (answered.startswith(asked) and text.startswith(answered)):
            raise ChatError(
                f"chat template {template.source} renders a conversation's start differently once it goes on (it "
                "rewrites earlier turns): the answers cannot be told apart from the rest; use a template whose "
                "rendering of a conversation begins with that of its first turns"
            )
        spans.append((len(asked), len(answered)))
    return text, spans


def encode(tok: TokenizerFile, text: str, spans: list[tuple[int, int]]) -> np.ndarray:
    """The conversation's tokens, signed: a token that starts inside an answer is a target (`t`), any other is
    context (`-t - 1`). The template writes its own specials (BOS, turn markers), so none are added."""
    encoded = tok.tokenizer.encode(text, add_special_tokens=False)
    ids = np.array(encoded.ids, dtype=np.int64)
    starts = np.array([start for start, _ in encoded.offsets], dtype=np.int64)
    target = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        target |= (starts >= a) & (starts < b)
    return np.where(target, ids, -ids - 1).astype(DTYPE)


def pack(conversations: list[np.ndarray], row_len: int, pad: int) -> tuple[np.ndarray, list[list[int]]]:
    """Whole conversations, in order, into rows of `row_len`, a row's rest padded with `pad` as context; and the
    conversations (their indices) each row holds."""
    rows, row, members, held = [], [], [], []
    for i, tokens in enumerate(conversations):
        if len(row) + len(tokens) > row_len:
            rows.append(row + [-pad - 1] * (row_len - len(row)))
            members.append(held)
            row, held = [], []
        row, held = row + tokens.tolist(), held + [i]
    if row:
        rows.append(row + [-pad - 1] * (row_len - len(row)))
        members.append(held)
    return np.array(rows, dtype=DTYPE).reshape(-1, row_len), members


def held_out(n: int, eval_fraction: float) -> list[int]:
    """Which of `n` conversations are held out for evaluation: every k-th (k = 1 / eval_fraction), at least one."""
    every = max(2, round(1 / eval_fraction)) if eval_fraction > 0 else n + 1
    return [i for i in range(n) if i % every == every - 1] or [n - 1]


def prompt_tokens(directory: str, message: str) -> list[int]:
    """`message` as a user's turn, with the template's generation prompt after it: what a chat answer follows."""
    text = read_template(directory).render([{"role": "user", "content": message}], add_generation_prompt=True)
    return read_file(directory).tokenizer.encode(text, add_special_tokens=False).ids


def prepare_chat(
    data: str,
    model_dir: str,
    seq_len: int,
    out: str,
    eval_fraction: float,
    tok: TokenizerFile | None = None,
    template: Template | None = None,
) -> dict:
    """`data` (chat records) rendered with `model_dir`'s template and tokenizer (`tok` and `template` where already
    read) into shards under `out`, the conversations `held_out` for evaluation. Returns the manifest."""
    tok, template = tok or read_file(model_dir), template or read_template(model_dir)
    conversations = read_records(data)
    encoded = [encode(tok, *answer_spans(template, messages)) for messages in conversations]
    row_len = seq_len + 1
    long = [i for i, t in enumerate(encoded) if len(t) > row_len]
    if long:
        named = ", ".join(f"record {i + 1} ({len(encoded[i])} tokens)" for i in long[:5])
        raise ChatError(
            f"chat data {data}: {len(long)} of {len(encoded)} conversations do not fit a row of {row_len} tokens "
            f"(model.seq_len + 1): {named}{' ...' if len(long) > 5 else ''}; shorten or drop them, or train at a "
            "longer model.seq_len"
        )
    if not any((t >= 0).any() for t in encoded):
        raise ChatError(f"chat data {data}: no answer renders to a token; check the template {template.source}")
    held = held_out(len(encoded), eval_fraction)
    if len(held) == len(encoded):
        raise ChatError(f"chat data {data}: {len(encoded)} record(s) leave nothing to train on beside the held out")
    splits, out_of_train = {}, set(held)
    for split, ids in (("train", [i for i in range(len(encoded)) if i not in out_of_train]), ("eval", held)):
        writer = SplitWriter(out, split, row_len, DTYPE, 128 << 20)
        rows, members = pack([encoded[i] for i in ids], row_len, tok.eos)
        writer.add(rows, [[f"{data}#{ids[j] + 1}" for j in row] for row in members])
        writer.flush()
        splits[split] = writer.shards
    specials = json.dumps(template.specials)
    kept = {FILE: tok.text, "chat_template.jinja": template.text, "tokenizer_config.json": specials}
    for name, text in kept.items():  # what a run on these shards generates with: its tokenizer, template, specials
        with fsspec.open(posixpath.join(out, name), "w") as f:
            f.write(text)
    return write_manifest(
        out,
        seq_len=seq_len,
        dtype=DTYPE,
        vocab_size=tok.vocab_size,
        tokenizer=tok.manifest(),
        splits=splits,
        source={"chat": data, "template": template.source, "template_sha256": template.sha256()},
        targets=TARGETS,
    )


def prepared(data: str, model_dir: str, seq_len: int, eval_fraction: float, root: str) -> str:
    """The manifest of `data` prepared for this model (its tokenizer and template, seq_len, held-out share) under
    `root`/chat-data/, named by what it was made from: made once, reused by every run that asks the same, and a
    changed file is a new directory (nothing prepared before is overwritten)."""
    fs, _ = fsspec.core.url_to_fs(data)
    try:
        content = fs.cat_file(data)
    except FileNotFoundError:
        raise ChatError(f"chat data {data} not found") from None
    tok, template = read_file(model_dir), read_template(model_dir)
    made_of = [hashlib.sha256(content).hexdigest(), tok.sha256, template.sha256(), str(seq_len), repr(eval_fraction)]
    name = f"{posixpath.basename(data).rsplit('.', 1)[0]}-{hashlib.sha256(' '.join(made_of).encode()).hexdigest()[:12]}"
    out = posixpath.join(root, "chat-data", name)
    manifest = posixpath.join(out, "manifest.json")
    if not fsspec.core.url_to_fs(manifest)[0].isfile(manifest):
        prepare_chat(data, model_dir, seq_len, out, eval_fraction, tok, template)
    return manifest
