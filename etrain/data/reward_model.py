"""A reward given as a Hugging Face sequence-classification directory (LlamaForSequenceClassification, Mistral's or
Qwen2's with one label: what reward models trained with TRL or OpenRLHF are saved as). Its trunk is our Llama
family's model, read by the family's names from safetensors alone (nothing in the directory runs code: no pickle
is read, its template renders in Jinja's sandbox); its `score` head maps the last token's hidden state to the
score, as transformers pools it. A conversation is the prompt as the user's message and the response as the
assistant's, rendered with the directory's chat template where it has one, else the prompt and the response
joined."""

from __future__ import annotations

import json
import posixpath

import fsspec
import torch

from etrain.core.config import ConfigError
from etrain.core.hf import Weights, check_against, files
from etrain.core.models import by_architecture, make_model
from etrain.core.storage import STORAGE_ERRORS, describe

CAUSAL = {  # a classifier's architecture -> its trunk's causal-LM architecture (the family's format reads that)
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
}
BATCH = 8  # conversations scored a forward at a time


def is_reward_model(spec: str) -> bool:
    """Whether `spec` is a directory whose config.json names a sequence classifier."""
    try:
        fs, root = fsspec.core.url_to_fs(spec)
        path = posixpath.join(root, "config.json")
        if not fs.isfile(path):
            return False
        architectures = json.loads(fs.cat_file(path)).get("architectures") or []
    except (*STORAGE_ERRORS, ValueError, AttributeError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in architectures)


class RewardModel:
    def __init__(self, directory: str):
        from etrain.data.tokenizer import read_file

        fs, root = fsspec.core.url_to_fs(directory)
        path = posixpath.join(root, "config.json")
        try:
            config = json.loads(fs.cat_file(path))
            self.tokenizer = read_file(directory)
        except (*STORAGE_ERRORS, ValueError) as e:
            raise ConfigError(f"reward model {directory} cannot be read: {describe(e)}") from None
        arch = (config.get("architectures") or [""])[0]
        if arch not in CAUSAL:
            raise ConfigError(
                f"reward model {path}: architecture {arch} is not supported; supported: {', '.join(CAUSAL)}"
            )
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if labels != 1:
            raise ConfigError(
                f"reward model {path} has {labels} labels: a reward model scores with one (num_labels=1, as TRL's "
                "and OpenRLHF's are saved)"
            )
        fmt = by_architecture(CAUSAL[arch]).hf
        try:
            model_cfg = fmt.read_config(config, path, CAUSAL[arch])
        except KeyError as e:
            raise ConfigError(f"reward model {path} has no {e.args[0]!r}, which a {arch} config holds") from None
        torch.manual_seed(0)  # the language-model head it lacks: made, never used
        self.model = make_model(model_cfg).eval()
        self.score_head, self.seq_len = self._load(directory, fmt), model_cfg.seq_len
        self.template = _template(directory)

    def _load(self, directory: str, fmt) -> torch.nn.Linear:
        """The trunk's weights into the model, and the score head; ConfigError naming a tensor missing or of
        another shape."""
        weights, state = Weights(directory, fmt), self.model.state_dict()
        trunk = {name: t for name, t in state.items() if name != "head.weight"}  # a classifier has no LM head
        check_against(weights, {name: t.shape for name, t in trunk.items()}, directory)
        for name, t in trunk.items():
            t.copy_(weights[name])
        held = files(directory)
        if "score.weight" not in held:
            raise ConfigError(f"reward model {directory} holds no tensor score.weight (the classifier's head)")
        weight = held["score.weight"].tensor("score.weight")
        if weight.shape != (1, self.model.cfg.d_model):
            raise ConfigError(
                f"reward model {directory}: score.weight has shape {tuple(weight.shape)}, not (1, "
                f"{self.model.cfg.d_model})"
            )
        head = torch.nn.Linear(self.model.cfg.d_model, 1, bias="score.bias" in held)
        with torch.no_grad():
            head.weight.copy_(weight)
            if head.bias is not None:
                head.bias.copy_(held["score.bias"].tensor("score.bias"))
        return head

    def text(self, prompt: str, response: str) -> list[int]:
        """The conversation's tokens: the last seq_len of them (the response is what is scored)."""
        if self.template is not None:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            ids = self.tokenizer.tokenizer.encode(self.template.render(messages), add_special_tokens=False).ids
        else:
            ids = self.tokenizer.tokenizer.encode(prompt + response, add_special_tokens=True).ids
        return ids[-self.seq_len :] or [self.tokenizer.eos]  # nothing to read: the end of text alone

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Each conversation's score: the head on the hidden state of its last token (right-padded in a batch:
        causal attention keeps the padding out of every real token)."""
        rows = [self.text(p, r) for p, r in zip(prompts, responses)]
        scores = []
        for start in range(0, len(rows), BATCH):
            part = rows[start : start + BATCH]
            lengths = torch.tensor([len(r) for r in part])
            batch = torch.zeros(len(part), int(lengths.max()), dtype=torch.long)
            for i, r in enumerate(part):
                batch[i, : len(r)] = torch.tensor(r)
            hidden = self.model.norm(self.model.trunk(batch))
            last = hidden[torch.arange(len(part)), lengths - 1]
            scores += self.score_head(last.float()).squeeze(-1).tolist()
        return scores


def _template(directory: str):
    from etrain.data.chat import ChatError, read_template

    try:
        return read_template(directory)
    except ChatError:
        return None
