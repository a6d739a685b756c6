"""PPO's and GRPO's objectives (etrain/core/ppo.py, grpo.py) against the formulas written out longhand, on small
hand-made rollouts; a step's responses split over the workers in whole groups."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from etrain.control.ppo_step import groups_split
from etrain.core.grpo import group_advantages, kl_penalty
from etrain.core.ppo import AdaptiveKL, boosted, entropy, gae, moments, policy_loss, token_rewards, value_loss, whiten
from etrain.data import tokenizer

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # two responses of 3 and 2 tokens


def test_rewards_are_the_kl_penalty_at_every_token_and_the_score_at_the_last():
    logp, ref = torch.full((2, 4), -1.0), torch.full((2, 4), -1.5)
    rewards = token_rewards(torch.tensor([2.0, -1.0]), logp, ref, MASK, beta=0.1)
    expected = torch.tensor([[-0.05, -0.05, 1.95, 0.0], [-0.05, -1.05, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)


def test_gae_is_the_discounted_sum_of_td_errors_within_each_response():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(2, 4, generator=gen) * MASK, torch.randn(2, 4, generator=gen) * MASK
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(rewards, values, MASK, gamma, lam)
    for b in range(2):
        n = int(MASK[b].sum())
        v = values[b, :n].tolist() + [0.0]  # nothing after the last token
        deltas = [rewards[b, t].item() + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            expected = sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t))
            assert advantages[b, t].item() == pytest.approx(expected, rel=1e-5)
            assert returns[b, t].item() == pytest.approx(expected + v[t], rel=1e-5)
        assert advantages[b, n:].abs().sum() == 0 and returns[b, n:].abs().sum() == 0


def test_whitening_over_two_workers_uses_the_moments_of_both():
    a, b = torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[4.0, 5.0, 0.0, 0.0]])
    ma, mb = MASK[:1], MASK[1:]
    sums = moments(a, ma) + moments(b, mb)  # what an all-reduce of each worker's moments gives
    everything = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    expected = (everything - everything.mean()) / (everything.std() + 1e-8)
    got = torch.cat([whiten(a, sums, ma)[0, :3], whiten(b, sums, mb)[0, :2]])
    torch.testing.assert_close(got, expected)
    assert whiten(a, sums, ma)[0, 3] == 0  # padding stays zero


def test_the_policy_loss_clips_the_ratio_and_counts_the_clipped_tokens():
    old = torch.zeros(2, 4)
    new = torch.log(torch.tensor([[1.1, 1.5, 0.5, 9.0], [0.9, 1.0, 9.0, 9.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0], [-1.0, 2.0, 5.0, 5.0]])
    loss, clipped = policy_loss(new, old, adv, MASK, clip=0.2)
    # per token: min(r A, clip(r) A), negated: 1.1; 1.2 (clipped); -0.8 (clipped); -0.9 (r A); 2.0
    expected = -(1.1 + 1.2 - 0.8 - 0.9 + 2.0) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6) and clipped.item() == pytest.approx(2 / 5)


def test_the_value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors():
    old = torch.zeros(1, 4)
    values, returns = torch.tensor([[0.5, 0.1, -0.5, 0.0]]), torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    loss = value_loss(values, old, returns, MASK[:1], clip=0.2)
    # clipped values 0.2, 0.1, -0.2: errors max(0.25, 0.64), max(0.81, 0.81), max(0.25, 0.64)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 0.64) / 3, rel=1e-6)


def test_entropy_of_a_uniform_distribution_is_log_of_its_size():
    assert entropy(torch.zeros(2, 4, 7), MASK).item() == pytest.approx(torch.log(torch.tensor(7.0)).item())


def test_a_step_above_the_kl_target_is_penalised_by_a_power_of_its_overshoot_and_below_it_by_beta():
    assert boosted(0.05, kl=3.0, target=6.0, gain=4) == 0.05  # below the target: beta as it is
    assert boosted(0.05, kl=12.0, target=6.0, gain=4) == pytest.approx(0.05 * 16)  # twice the target: 2^4
    assert boosted(0.05, kl=12.0, target=6.0, gain=0) == 0.05  # gain 0: Ziegler's law alone


def test_the_kl_coefficient_moves_towards_the_target_with_a_clipped_error():
    kl = AdaptiveKL(beta=0.1, target=6.0, horizon=10_000)
    assert kl.update(kl=12.0, samples=1000) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # error 1.0, clipped to 0.2
    assert kl.update(kl=5.7, samples=1000) == pytest.approx(0.1 * 1.02 * (1 - 0.05 * 0.1))


def test_prompts_are_left_padded_with_the_separator_and_a_response_ends_at_its_first():
    from etrain.worker.rollout import prompt_tokens, response_mask, response_texts

    rows = prompt_tokens(["ab", "abcdef"], 4, tokenizer.BYTE_CODEC)
    assert rows.tolist() == [[0, 0, 97, 98], [99, 100, 101, 102]]  # cut to the last 4 bytes
    responses = torch.tensor([[49, 50, 0, 51], [49, 50, 51, 52]])
    mask = response_mask(responses, tokenizer.EOT)
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]  # the separator counts, what follows it does not
    assert response_texts(responses, mask, tokenizer.BYTE_CODEC) == ["12", "1234"]


def test_rollouts_speak_the_runs_tokenizer_not_bytes(tmp_path):
    """Issue 41, defect 5: PPO encoded prompts and decoded responses as bytes whatever the model's vocabulary, and
    a response token above 255 failed the step (`bytes must be in range(0, 256)`). With a BPE's codec the prompt is
    its tokens, padded with its end of document, and a response of ids far above 255 decodes to its text."""
    from etrain.worker.rollout import prompt_tokens, response_mask, response_texts

    tok = tokenizer.train_bpe(iter(["x = 1234 and y = 5678; " * 8] * 16), vocab_size=300)
    (tmp_path / tokenizer.FILE).write_text(tok.text)
    codec = tokenizer.file_codec(str(tmp_path))
    ids = codec.encode("x = 12")
    rows = prompt_tokens(["x = 12"], len(ids) + 2, codec)
    assert rows.tolist() == [[codec.eos, codec.eos, *ids]]
    answer = codec.encode(" 5678; y")
    assert max(answer) > 255
    responses = torch.tensor([[*answer, codec.eos, answer[0]]])
    mask = response_mask(responses, codec.eos)
    assert mask.sum() == len(answer) + 1
    assert response_texts(responses, mask, codec) == [" 5678; y"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_advantages_are_each_score_against_its_groups_mean_and_spread(seed):
    """Issue 43, item 4: the advantage of a response is (score - mean) / std over its prompt's group alone."""
    gen = torch.Generator().manual_seed(seed)
    group = int(torch.randint(2, 9, (), generator=gen))
    print(f"seed {seed}: group {group}")
    scores = torch.randn(group * 5, generator=gen)
    scores[:group] = 0.5  # a group whose responses all scored alike teaches nothing
    advantages = group_advantages(scores, group)
    assert advantages[:group].abs().max() == 0
    for g in range(1, 5):
        own = scores[g * group : (g + 1) * group].tolist()
        mean = sum(own) / group
        std = (sum((x - mean) ** 2 for x in own) / (group - 1)) ** 0.5
        for i, x in enumerate(own):
            assert advantages[g * group + i].item() == pytest.approx((x - mean) / (std + 1e-4), rel=1e-5)


def test_grpo_kl_penalty_is_k3_never_negative_and_zero_with_zero_gradient_at_the_reference():
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(2, 4, generator=gen)
    logp = (ref + torch.randn(2, 4, generator=gen)).requires_grad_()
    value = kl_penalty(logp, ref, MASK)
    d = (ref - logp.detach()) * MASK
    assert value.item() == pytest.approx(((d.exp() - d - 1) * MASK).sum().item() / MASK.sum().item(), rel=1e-6)
    assert value.item() > 0
    at_ref = ref.clone().requires_grad_()
    same = kl_penalty(at_ref, ref, MASK)
    same.backward()
    assert same.item() == 0 and at_ref.grad.abs().max() == 0


@pytest.mark.parametrize("seed", range(4))
def test_a_steps_responses_go_to_the_workers_in_whole_groups_each_once(seed):
    rng = random.Random(seed)
    group, workers = rng.randint(1, 8), rng.randint(1, 6)
    count = group * rng.randint(workers, 12)
    cursor = group * rng.randint(0, 50)
    print(f"seed {seed}: group {group}, workers {workers}, count {count}, cursor {cursor}")
    shares = groups_split(cursor, count, group, workers)
    assert len(shares) == workers and all(len(s) and len(s) % group == 0 for s in shares)
    assert sorted(np.concatenate(shares).tolist()) == list(range(cursor, cursor + count))
    for share in shares:  # each worker's prompts: whole groups of one prompt each
        prompts = share // group
        assert all((prompts[i : i + group] == prompts[i]).all() for i in range(0, len(share), group))
    with pytest.raises(ValueError, match="ppo.group"):
        groups_split(2 * cursor + 1, 2 * count, 2, workers)  # a cursor inside a group
