"""Speculative decoding's pure parts: n-gram drafts, the acceptance rule's distribution, the
policy's choice of k, and the flags' refusals."""

from __future__ import annotations

import argparse

import pytest
import torch

from server.config.speculative import add_speculative_flags, speculative_from_args
from server.errors import UsageError
from workers.contract import DEFAULT_MODEL_DIR, WorkerConfig
from workers.sampling.params import SamplingParams
from workers.spec.cost import StepCosts
from workers.spec.ngram import NgramProposer
from workers.spec.policy import PLAIN_SAMPLES, REFRESH, Row, SpecPolicy, expected_tokens, ineligible, row_rate
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

def test_a_rows_limit_stops_at_max_tokens_and_for_poor_acceptance():
    policy = SpecPolicy(max_k=4)
    assert policy.row_limit(drafted=0, accepted=0, remaining=100, generated=1).k == 4
    assert policy.row_limit(drafted=0, accepted=0, remaining=3, generated=1).k == 2  # never past max_tokens
    poor = policy.row_limit(drafted=40, accepted=2, remaining=100, generated=33)
    assert poor.k == 0 and "acceptance 0.05" in poor.reason
    assert policy.row_limit(drafted=40, accepted=2, remaining=100, generated=32).k == 4  # a probe
    assert policy.row_limit(drafted=0, accepted=0, remaining=1, generated=1).k == 0


def test_the_fixed_rule_turns_speculation_off_above_its_rows():
    policy = SpecPolicy(max_k=4, max_rows=4)
    costs = StepCosts()
    assert policy.choose(1, [Row(3, 0.5)], costs, 1).k == 4
    full = policy.choose(5, [Row(3, 0.5)], costs, 1)
    assert full.k == 0 and "5 decode rows" in full.reason
    assert policy.choose(1, [], costs, 1).k == 0


def _device(per_row: float, per_token: float, rows=range(1, 33), tokens=(1, 2, 4, 8, 32, 128, 256)) -> StepCosts:
    """Costs of a device whose plain step is 10 ms + `per_row` a row and speculative step 12 ms +
    `per_token` a query token, measured at a few sizes."""
    costs = StepCosts()
    for b in rows:
        for _ in range(PLAIN_SAMPLES):
            costs.record("plain", b, 0.010 + per_row * b)
    for n in tokens:
        costs.record("spec", n, 0.012 + per_token * n)
    return costs


def test_k_is_chosen_from_the_devices_measured_costs_and_off_under_load():
    """A memory-bound device (a query token nearly free) drafts the most; a compute-bound one,
    whose every query token costs as much as a row, drafts less; both stop in a full batch."""
    policy = SpecPolicy(max_k=6)
    rows = [Row(6, 0.8)]
    gpu, cpu = _device(0.0002, 0.0002), _device(0.004, 0.004)
    on_gpu, on_cpu = policy.choose(1, rows, gpu, 1), policy.choose(1, rows, cpu, 1)
    assert on_gpu.k == 6 and on_gpu.cause == "measured" and "tokens/s" in on_gpu.reason
    assert 0 < on_cpu.k < on_gpu.k
    full = [Row(6, 0.8)] * 32
    assert policy.choose(32, full, gpu, 1).k > 0  # nearly free tokens pay even in a full batch
    off = policy.choose(32, full, cpu, 1)
    assert off.k == 0 and off.cause == "cost" and "32 decode rows" in off.reason
    poor = policy.choose(1, [Row(6, 0.05)], cpu, 1)  # drafts that are rarely right never pay
    assert poor.k == 0
    assert policy.choose(32, full, cpu, REFRESH).k == 0  # no probe in a full batch
    probe = policy.choose(1, [Row(6, 0.05)], cpu, REFRESH)  # a small one is probed now and then
    assert (probe.k, probe.cause) == (6, "measuring")


def test_each_row_drafts_as_far_as_its_own_acceptance_pays():
    """Rows that accept well draft further than rows that rarely do, in the same step; the step's
    k is the largest. Guards the per-row `ks` of `SpecPolicy.choose`."""
    policy = SpecPolicy(max_k=6)
    cpu = _device(0.004, 0.004)
    decision = policy.choose(2, [Row(6, 0.95), Row(6, 0.3)], cpu, 1)
    good, poor = decision.ks
    assert good > poor and decision.k == good and "tokens/s" in decision.reason
    alone = policy.choose(1, [Row(6, 0.95)], cpu, 1)
    assert alone.ks == (alone.k,) and alone.k >= good


def test_the_line_is_trusted_only_near_the_sizes_measured():
    """A batch far larger than any speculative step measured does not speculate on an extrapolation,
    not even to measure it (a probe in a full batch is what a saturated worker cannot afford)."""
    policy = SpecPolicy(max_k=4)
    costs = _device(0.0002, 0.0002, tokens=(2, 4, 8))
    assert policy.choose(2, [Row(4, 0.8)] * 2, costs, 1).k == 4  # 10 query tokens: near enough
    far = policy.choose(32, [Row(4, 0.8)] * 32, costs, 1)
    assert far.k == 0 and "not near 33" in far.reason  # even one draft in the whole batch
    assert policy.choose(32, [Row(4, 0.8)] * 32, costs, REFRESH).k == 0
    assert policy.choose(8, [Row(4, 0.8)] * 8, costs, 1).k > 0  # 8 + 8 query tokens: near enough


def test_unmeasured_paths_are_measured_first():
    policy = SpecPolicy(max_k=4)
    costs = StepCosts()
    assert policy.choose(2, [Row(4, 0.5)], costs, 1).cause == "measuring"  # the plain step at 2 rows first
    for _ in range(PLAIN_SAMPLES):
        costs.record("plain", 2, 0.01)
        costs.record("plain", 16, 0.02)
    explore = policy.choose(2, [Row(3, 0.5)], costs, 1)
    assert (explore.k, explore.cause) == (3, "measuring")
    assert policy.choose(16, [Row(3, 0.5)], costs, 1).k == 0  # a large batch waits for the measurement
    costs.record("spec", 3, 0.012)
    costs.record("spec", 9, 0.016)
    assert costs.estimate("spec", 6).seconds == pytest.approx(0.014) and not costs.estimate("spec", 6).measured
    assert policy.choose(2, [Row(3, 0.9)], costs, 1).cause == "measured"


def test_expected_tokens_and_row_rates():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 3) == 4
    assert row_rate(0, 0, 0.6) == pytest.approx(0.6)  # no drafts of its own: the method's rate
    assert row_rate(100, 10, 0.6) < 0.15


def test_grammar_and_alternatives_never_speculate():
    assert "grammar" in ineligible(SamplingParams.create(max_new_tokens=4), True)
    assert "top_n_tokens" in ineligible(SamplingParams.create(max_new_tokens=4, top_n_tokens=2), False)
    assert ineligible(SamplingParams.create(max_new_tokens=4, repetition_penalty=1.2), False) is None


# -- configuration -------------------------------------------------------------------------------

def _parse(*argv: str, model_dirs=()):
    parser = argparse.ArgumentParser()
    add_speculative_flags(parser)
    return speculative_from_args(parser.parse_args(list(argv)), model_dirs)


def test_flags_reach_the_worker_config_and_bad_values_are_named():
    assert _parse().mode == "auto"
    value = _parse("--speculative", "ngram", "--num-speculative-tokens", "3")
    assert (value.mode, value.num_tokens) == ("ngram", 3)
    with pytest.raises(UsageError, match=r"`--speculative eagle` is not a method. Accepted: auto, off, ngram, suffix"):
        _parse("--speculative", "eagle")
    with pytest.raises(UsageError, match=r"`--speculative mtp` needs a checkpoint that ships an MTP head.*"
                                         r"Accepted for it: auto, off, ngram, suffix"):
        _parse("--speculative", "mtp", model_dirs=[DEFAULT_MODEL_DIR])  # the embedded model has none
    with pytest.raises(UsageError, match=r"`--num-speculative-tokens 0` is out of range"):
        _parse("--num-speculative-tokens", "0")
    config = WorkerConfig.from_json(WorkerConfig(socket="s", speculative="ngram", num_speculative_tokens=2).to_json())
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 2)
    assert WorkerConfig(socket="s", speculative="suffix").speculative == "suffix"
    assert WorkerConfig(socket="s", speculative="mtp").speculative == "mtp"  # the worker checks its checkpoint
