"""Speculative decoding's pure parts: n-gram drafts, the acceptance rule's distribution, the
policy's choice of k, and the flags' refusals."""

from __future__ import annotations

import argparse

import pytest
import torch

from server.config.speculative import add_speculative_flags, speculative_from_args
from server.errors import UsageError
from workers.contract import WorkerConfig, WorkerConfigError
from workers.sampling.params import SamplingParams
from workers.spec.ngram import NgramProposer
from workers.spec.policy import SpecPolicy, ineligible
from workers.spec.rejection import accept_greedy, accept_sampled, draw

# -- n-gram drafts -------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_tail():
    p = NgramProposer(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # tail (5? no) ... longest tail found earlier: [2, 3] (n=3 `5 2 3` is new); latest match at 6
    assert p.propose(tokens, 2) == [7, 8]
    assert p.propose(tokens, 10) == [7, 8, 5, 2, 3]  # up to the end of the tokens
    assert p.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence of any tail
    assert p.propose([5], 3) == [] and p.propose([1, 1], 0) == []


def test_ngram_prefers_a_longer_match_over_a_later_shorter_one():
    p = NgramProposer(1, 3)
    tokens = [4, 5, 6, 1, 2, 0, 6, 9, 4, 5, 6]  # `6` last seen at 6 (then 9); `4 5 6` at 0 (then 1)
    assert p.propose(tokens, 2) == [1, 2]
    assert NgramProposer(1, 1).propose(tokens, 2) == [9, 4]


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError, match="`3..2`"):
        NgramProposer(3, 2)


# -- acceptance ----------------------------------------------------------------------------------

def test_greedy_accepts_the_prefix_that_matches_the_argmax():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == 2
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accept_greedy([1, 2], [3]) == 0


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _critical(df: int) -> float:
    """The 0.999 quantile of chi-square with `df` degrees of freedom (a false alarm 1 run in 1000)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        return {3: 16.27, 4: 18.47, 5: 20.52}[df]
    return float(chi2.ppf(0.999, df))


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """Over many seeded draws, the first emitted token (draft accepted, or the correction) is
    distributed as the target p, whichever token was drafted, and the draft is accepted with
    probability p(draft); the second position, reached only after an acceptance, is p' too."""
    p = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])
    p2 = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1])
    logprobs = torch.stack([p.log(), p2.log()])  # [k+1 = 2, V]
    first, second = torch.zeros(5), torch.zeros(5)
    g = torch.Generator().manual_seed(1234)
    draws = 20000
    accepted = 0
    for _ in range(draws):
        out = accept_sampled(logprobs, [draft], g)
        assert 1 <= len(out) <= 2
        first[out[0]] += 1
        if len(out) == 2:
            assert out[0] == draft
            accepted += 1
            second[out[1]] += 1
    assert _chi_square(first, p) < _critical(4)
    assert _chi_square(second, p2) < _critical(4)
    assert abs(accepted / draws - float(p[draft])) < 0.02


def test_plain_sampling_and_verification_draw_the_same_token_from_the_same_seed():
    """One uniform per emitted token, the sampler's inverse CDF: a seed gives the same tokens."""
    logprobs = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    plain = [draw(logprobs[j], torch.rand(1, generator=g1)) for j in range(3)]
    drafts = plain[:2]  # the drafts plain sampling would emit: all accepted, then the bonus
    assert accept_sampled(logprobs, drafts, g2) == plain


# -- policy --------------------------------------------------------------------------------------

def test_policy_turns_speculation_off_in_a_full_batch_and_for_poor_acceptance():
    policy = SpecPolicy(max_k=4, max_rows=4)
    assert policy.choose(rows=1, drafted=0, accepted=0, remaining=100, generated=1).k == 4
    assert policy.choose(rows=1, drafted=0, accepted=0, remaining=3, generated=1).k == 2  # never past max_tokens
    full = policy.choose(rows=5, drafted=0, accepted=0, remaining=100, generated=1)
    assert full.k == 0 and "5 decode rows" in full.reason
    poor = policy.choose(rows=1, drafted=40, accepted=2, remaining=100, generated=33)
    assert poor.k == 0 and "acceptance 0.05" in poor.reason
    assert policy.choose(rows=1, drafted=40, accepted=2, remaining=100, generated=32).k == 4  # a probe
    assert policy.choose(rows=1, drafted=0, accepted=0, remaining=1, generated=1).k == 0


def test_grammar_and_alternatives_never_speculate():
    assert "grammar" in ineligible(SamplingParams.create(max_new_tokens=4), True)
    assert "top_n_tokens" in ineligible(SamplingParams.create(max_new_tokens=4, top_n_tokens=2), False)
    assert ineligible(SamplingParams.create(max_new_tokens=4, repetition_penalty=1.2), False) is None


# -- configuration -------------------------------------------------------------------------------

def _parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_speculative_flags(parser)
    return speculative_from_args(parser.parse_args(list(argv)))


def test_flags_reach_the_worker_config_and_bad_values_are_named():
    assert _parse().mode == "auto"
    value = _parse("--speculative", "ngram", "--num-speculative-tokens", "3")
    assert (value.mode, value.num_tokens) == ("ngram", 3)
    with pytest.raises(UsageError, match=r"`--speculative eagle` is not a method. Accepted: auto, off, ngram, suffix"):
        _parse("--speculative", "eagle")
    with pytest.raises(UsageError, match=r"`--speculative mtp` is not available.*Accepted: auto, off, ngram"):
        _parse("--speculative", "mtp")
    with pytest.raises(UsageError, match=r"`--num-speculative-tokens 0` is out of range"):
        _parse("--num-speculative-tokens", "0")
    config = WorkerConfig.from_json(WorkerConfig(socket="s", speculative="ngram", num_speculative_tokens=2).to_json())
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 2)
    assert WorkerConfig(socket="s", speculative="suffix").speculative == "suffix"
    with pytest.raises(WorkerConfigError, match="`--speculative mtp`"):
        WorkerConfig(socket="s", speculative="mtp")
