"""Suffix-tree drafts: the tree's counts against a brute-force count, its memory given back, the
drafts' rules, acceptance on an agent loop's repeated outputs, and greedy outputs through the real
engine identical with and without `--speculative suffix`."""

from __future__ import annotations

import random

import pytest

from tests.test_spec_engine import OTHERS, echoes, lm, make, metric, run  # noqa: F401 (fixtures)
from workers.engine.speculate import Speculator, speculator_for
from workers.sampling.params import SamplingParams
from workers.spec.ngram import NgramProposer
from workers.spec.policy import SpecPolicy
from workers.spec.suffix import SuffixProposer, SuffixTree


def _counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


def test_the_tree_counts_every_substring_up_to_its_depth_and_forgets_a_sequence_entirely():
    rng = random.Random(0)
    seqs = {i: [rng.randrange(3) for _ in range(40)] for i in range(3)}
    tree = SuffixTree(4)
    for i, s in seqs.items():  # fed in pieces, as the output grows
        tree.extend(i, s[:7])
        tree.extend(i, s[7:])
    expected: dict[tuple[int, ...], int] = {}
    for s in seqs.values():
        for start in range(len(s)):
            for n in range(1, 5):
                if start + n <= len(s):
                    expected[tuple(s[start:start + n])] = expected.get(tuple(s[start:start + n]), 0) + 1
    assert _counts(tree) == expected and tree.nodes == len(expected)
    tree.remove(1)
    for key in list(expected):
        expected[key] -= sum(tuple(seqs[1][i:i + len(key)]) == key for i in range(len(seqs[1])))
    assert _counts(tree) == {k: v for k, v in expected.items() if v}
    tree.remove(0)
    tree.remove(2)
    assert tree.nodes == 0 and tree.root.count == 0 and not tree.root.children


def test_a_draft_follows_the_most_frequent_continuation_within_its_limits():
    tree = SuffixTree(8)
    tree.extend("a", [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 5])
    # `2 3` continues with 4 three times of three: then 5 (two of three) and 1 (once of two)
    draft = tree.speculate([9, 2, 3], 4)
    assert draft.token_ids == (4, 5) and draft.match_len == 2  # a match of 2 drafts at most 2
    assert tree.speculate([9, 1, 2, 3], 3).token_ids == (4, 5, 1)
    assert tree.speculate([9, 1, 2, 3], 3).probs == pytest.approx((1.0, 2 / 3, 1 / 3))
    assert tree.speculate([9, 1, 2, 3], 3, min_token_prob=0.5).token_ids == (4, 5)  # 1/3 is below 0.5
    assert tree.speculate([7, 7], 4).token_ids == ()  # nothing matches


def _tied(tree: SuffixTree, context: list[int], k: int) -> bool:
    """Whether any path a draft of `context` may follow meets two children of equal count."""
    for m in range(1, len(context)):
        node = tree.root
        for token in context[len(context) - m:]:
            node = node.children.get(token)
            if node is None:
                return False
        for _ in range(k + 1):
            counts = sorted((c.count for c in node.children.values()), reverse=True)
            if len(counts) > 1 and counts[0] == counts[1]:
                return True
            if not counts:
                break
            node = max(node.children.values(), key=lambda c: c.count)
    return False


def test_drafts_match_arctic_inferences_tree_where_no_counts_tie():
    """The reference: SuffixDecoding's own compiled tree, where it is installed (it is not a dependency)."""
    native = pytest.importorskip("arctic_inference.suffix_decoding._C")
    rng = random.Random(0)
    compared = 0
    for _ in range(200):
        depth, vocab = rng.choice([4, 8, 24]), rng.choice([3, 5, 20])
        theirs, ours = native.SuffixTree(depth), SuffixTree(depth)
        for i in range(rng.randrange(1, 4)):
            seq = [rng.randrange(vocab) for _ in range(rng.randrange(5, 80))]
            for tree in (theirs, ours):
                tree.extend(i, seq)
        for _ in range(10):
            context, k = [rng.randrange(vocab) for _ in range(rng.randrange(2, 30))], rng.randrange(1, 8)
            if _tied(ours, context[-depth:], k):
                continue
            expected = theirs.speculate(context, k, 1.0, 0.0, 0.1, False)
            got = ours.speculate(context, k)
            assert list(got.token_ids) == list(expected.token_ids)
            assert got.score == pytest.approx(expected.score, abs=1e-5)
            compared += 1
    assert compared > 100


def _serve_loop(draft, truth: list[int], k: int) -> tuple[float, float]:
    """Greedy verification of `truth` as the model's output: (acceptance rate, tokens per step)."""
    pos = drafted = accepted = steps = 0
    while pos < len(truth):
        d = draft(truth[:pos], k)
        n = 0
        while n < len(d) and pos + n < len(truth) and d[n] == truth[pos + n]:
            n += 1
        drafted, accepted, steps, pos = drafted + len(d), accepted + n, steps + 1, pos + n + 1
    return accepted / max(drafted, 1), len(truth) / steps


def test_an_agent_loops_repeated_outputs_are_drafted_across_requests():
    """Each request of an agent loop answers with the same tool-call template, a few fields
    differing: after the first, the global tree drafts most of it; n-gram lookup in the request's
    own tokens cannot (the template is not in the prompt)."""
    rng = random.Random(1)
    template = [rng.randrange(100, 1000) for _ in range(60)]
    slots = (5, 23, 41)
    proposer, ngram = SuffixProposer(), NgramProposer()
    rates = []
    for request in range(6):
        prompt = [rng.randrange(1000, 2000) for _ in range(30)]
        output = [rng.randrange(2000, 3000) if i in slots else t for i, t in enumerate(template)]
        rate, per_step = _serve_loop(lambda out, k, r=request, p=prompt: proposer.propose(r, p, out, k), output, 4)
        plain_rate, plain_per_step = _serve_loop(lambda out, k, p=prompt: ngram.propose(p + out, k), output, 4)
        proposer.retire(set())
        rates.append(rate)
    assert rates[0] < 0.5 and min(rates[1:]) > 0.7
    assert per_step > 2.5 and plain_per_step < 1.5


def test_the_global_tree_keeps_the_latest_outputs_within_its_bounds():
    proposer = SuffixProposer(max_depth=4, max_cached_requests=2, max_cached_tokens=25)
    for request in range(4):
        proposer.propose(request, [1, 2], list(range(request * 10, request * 10 + 10)), 2)
    assert list(proposer._cached) == [2, 3] and proposer.global_tree.tokens(1) == 0
    proposer.propose(4, [1], list(range(100, 120)), 2)  # 30 tokens would be held: the oldest goes
    assert list(proposer._cached) == [4]
    proposer.retire({4})
    assert list(proposer._local) == [4]
    # a new request's indexing is counted apart (the step cost leaves it out), a next token's is not
    spent = proposer.indexing_seconds
    assert spent > 0
    proposer.propose(4, [1], list(range(100, 121)), 2)
    assert proposer.indexing_seconds == spent
    assert proposer.propose(5, [1, 2, 3], [], 0) == [] and 5 not in proposer._local  # k 0: nothing indexed


def test_greedy_outputs_unchanged_with_suffix_drafts(lm, echoes):  # noqa: F811
    params = SamplingParams.create(max_new_tokens=32)
    plain, _, _ = run(make(lm, False), lm, echoes + OTHERS, params)
    engine = make(lm, True)
    engine.speculator = Speculator("suffix", SpecPolicy(4, 8))
    assert run(engine, lm, echoes + OTHERS, params)[0] == plain
    # the same prompts again: the global tree now holds their outputs
    assert run(engine, lm, OTHERS, params)[0] == plain[len(echoes):]
    assert metric(engine, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert engine.speculation()["method"] == "suffix"
    assert speculator_for("suffix", 4, engine.scheduler).suffix is not None


def test_the_measured_choice_keeps_greedy_outputs_and_shows_its_costs(lm, echoes):  # noqa: F811
    """`auto`'s policy (no fixed row limit): it measures both paths, speculates where its measured
    costs say so, and the greedy outputs stay plain decoding's."""
    params = SamplingParams.create(max_new_tokens=48)
    plain, _, _ = run(make(lm, False), lm, echoes[:2], params)
    engine = make(lm, True)
    engine.speculator = Speculator("suffix", SpecPolicy(4))
    out = [run(engine, lm, [p], params)[0][0] for p in echoes[:2]]  # one at a time
    assert out == plain
    described = engine.speculation()
    assert described["step_ms"]["plain"] and described["step_ms"]["spec"]  # both paths measured
    assert described["drafts"] > 0 and described["reason"]
    rendered = engine.metrics.render().decode()
    assert "hetserve_worker_spec_decode_k " in rendered
    assert 'hetserve_worker_spec_decode_decisions_total{cause="measuring"}' in rendered
