"""Sampling: parameter validation, warpers, seeded determinism independent of batch mates."""

from __future__ import annotations

import math

import pytest
import torch

from workers.sampling.params import ParameterError, SamplingParams
from workers.sampling.sampler import make_generator, sample_tokens


def sample(logits: torch.Tensor, rows) -> tuple[list[int], list[float]]:
    """One token and its logprob per row of `logits` [N, V] (float32): `sample_tokens` without
    the alternatives."""
    out = sample_tokens(logits, rows)
    return out.token_ids, out.logprobs


class Row:
    def __init__(self, params: SamplingParams, prompt=(5,), output=()):
        self.params = params
        self.generator = make_generator(params.seed) if params.do_sample else None
        self.prompt_ids = list(prompt)
        self.output_ids = list(output)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": 0.0, "do_sample": True}, "`temperature` must be > 0 when `do_sample`"),
        ({"temperature": -1.0}, "`temperature`"),
        ({"top_p": 0.0}, "`top_p` must be in (0, 1]"),
        ({"top_p": 1.5}, "`top_p`"),
        ({"top_k": -1}, "`top_k` must be an integer >= 0"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be an integer >= 1"),
        ({"repetition_penalty": 0.0}, "`repetition_penalty` must be > 0"),
        ({"seed": -3}, "`seed`"),
        ({"stop": [""]}, "`stop`"),
        ({"stop": ["a"] * 17}, "at most 16"),
    ],
)
def test_invalid_parameters_name_the_field(kwargs, needle):
    with pytest.raises(ParameterError) as e:
        SamplingParams.create(**kwargs)
    assert needle in str(e.value)


def test_tgi_semantics_warpers_turn_sampling_on():
    assert SamplingParams.create().greedy
    assert SamplingParams.create(temperature=0.0).greedy  # 0 without do_sample = greedy
    assert SamplingParams.create(temperature=1.0).greedy
    assert SamplingParams.create(temperature=0.7).do_sample
    assert SamplingParams.create(top_k=5).do_sample
    assert SamplingParams.create(top_p=0.9).do_sample
    assert SamplingParams.create(top_p=1.0).greedy
    assert SamplingParams.create().max_new_tokens == 100


def test_greedy_picks_argmax_with_its_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    ids, lps = sample(logits, [Row(SamplingParams()), Row(SamplingParams())])
    assert ids == [1, 0]
    expected = torch.log_softmax(logits, -1)
    assert lps == pytest.approx([expected[0, 1].item(), expected[1, 0].item()], abs=1e-6)


def test_top_k_one_is_greedy_even_when_sampling():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    rows = [Row(SamplingParams.create(do_sample=True, top_k=1, seed=i)) for i in range(4)]
    ids, lps = sample(logits, rows)
    assert ids == logits.argmax(-1).tolist()
    assert lps == pytest.approx([0.0] * 4, abs=1e-6)  # the only token left has probability 1


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        ids, _ = sample(logits, [Row(SamplingParams.create(top_p=0.7, seed=seed))])
        seen.add(ids[0])
    assert seen == {0, 1}  # 0.5 + 0.3 >= 0.7: tokens 2 and 3 are cut


def test_top_p_below_fp32_resolution_keeps_the_best_token():
    """Guards `remove[:, 0] = False` in `_apply_top_k_top_p`: a `top_p` such as 1e-300 rounds to
    0 in fp32, so `mass_before >= p` removed every token, the row became all -inf and the worker
    answered 500 (a -inf logprob is not JSON)."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    rows = [Row(SamplingParams.create(top_p=1e-300, seed=i)) for i in range(3)]
    ids, lps = sample(logits, rows)
    assert ids == logits.argmax(-1).tolist()
    assert all(math.isfinite(lp) for lp in lps)


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None].repeat(4000, 1)
    rows = [Row(SamplingParams.create(do_sample=True, seed=i)) for i in range(4000)]
    ids, _ = sample(logits, rows)
    freq = torch.bincount(torch.tensor(ids), minlength=3).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    ids, _ = sample(logits, [Row(SamplingParams.create(repetition_penalty=1.5), prompt=[0])])
    assert ids == [1]  # 2.0 / 1.5 < 1.9
    ids, _ = sample(logits, [Row(SamplingParams.create(repetition_penalty=1.0), prompt=[0])])
    assert ids == [0]


def test_seed_gives_same_tokens_whatever_the_batch_mates():
    """Guards the per-row `torch.rand(1, generator=rows[i].generator)` draw in `sample`."""
    gen = torch.Generator().manual_seed(0)
    mine = torch.randn(1, 100, generator=gen)
    params = SamplingParams.create(temperature=0.9, seed=1234)

    def run(batch_mates: int) -> list[int]:
        row = Row(params)
        mates = [Row(SamplingParams.create(do_sample=True, seed=i)) for i in range(batch_mates)]
        out = []
        for _ in range(20):
            logits = torch.cat([torch.randn(batch_mates, 100, generator=gen), mine])
            ids, _ = sample(logits, mates + [row])
            out.append(ids[-1])
        return out

    assert run(0) == run(3) == run(17)
    other = Row(SamplingParams.create(temperature=0.9, seed=99))
    assert [sample(mine, [other])[0][0] for _ in range(20)] != run(0)


def test_logprob_is_finite_and_from_the_warped_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    _, lps = sample(logits, [Row(SamplingParams.create(top_k=2, seed=3))])
    kept = torch.log_softmax(torch.tensor([3.0, 4.0]), -1)
    assert math.isfinite(lps[0]) and any(abs(lps[0] - k) < 1e-5 for k in kept.tolist())


# -- bias, penalties, alternatives -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"presence_penalty": 2.5}, "`presence_penalty` must be in [-2.0, 2.0]"),
        ({"frequency_penalty": float("nan")}, "`frequency_penalty`"),
        ({"logit_bias": {5: 101.0}}, "`logit_bias` values must be in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "`logit_bias` keys must be token ids"),
        ({"top_n_tokens": 21}, "`top_n_tokens` must be an integer in [0, 20]"),
    ],
)
def test_new_parameters_are_validated_and_named(kwargs, needle):
    with pytest.raises(ParameterError) as e:
        SamplingParams.create(**kwargs)
    assert needle in str(e.value)


def test_logit_bias_moves_the_argmax_of_its_row_only():
    logits = torch.tensor([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0]])
    rows = [Row(SamplingParams.create(logit_bias={2: 5.0})), Row(SamplingParams())]
    ids, lps = sample(logits, rows)
    assert ids == [2, 0]
    assert lps[0] == pytest.approx(torch.log_softmax(torch.tensor([3.0, 1.0, 5.0]), -1)[2].item(), abs=1e-6)
    assert logits[0, 2] == 0.0  # the caller's logits are not modified


def test_presence_and_frequency_penalties_count_output_tokens_only():
    """OpenAI semantics: `logit -= frequency * count + presence * (count > 0)` over the output;
    the prompt's tokens are not penalized (guards `apply_penalties`' output-only bincount)."""
    logits = torch.tensor([[4.0, 3.0, 2.5, 0.0]])
    out = sample_tokens(logits, [Row(SamplingParams.create(frequency_penalty=0.6), prompt=[1, 1, 1], output=[0, 0])])
    # token 0: 4.0 - 2 * 0.6 = 2.8 < 3.0 (token 1 appears only in the prompt: untouched)
    assert out.token_ids == [1]
    out = sample_tokens(logits, [Row(SamplingParams.create(presence_penalty=1.6), output=[0, 0, 0, 1])])
    assert out.token_ids == [2]  # once per distinct token: 4.0 - 1.6 = 2.4 and 3.0 - 1.6 = 1.4 fall below 2.5
    lp = torch.log_softmax(torch.tensor([2.4, 1.4, 2.5, 0.0]), -1)[2].item()
    assert out.logprobs[0] == pytest.approx(lp, abs=1e-6)


def test_top_alternatives_are_the_best_of_the_sampled_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0], [1.0, 0.0, 0.0, 0.0]])
    rows = [Row(SamplingParams.create(top_n_tokens=2, temperature=0.5, seed=1)), Row(SamplingParams())]
    out = sample_tokens(logits, rows)
    expected = torch.log_softmax(logits[0] / 0.5, -1)
    assert [i for i, _ in out.top[0]] == [3, 1]
    assert [lp for _, lp in out.top[0]] == pytest.approx([expected[3].item(), expected[1].item()], abs=1e-5)
    assert out.top[1] is None  # not asked
    zero = sample_tokens(logits[:1], [Row(SamplingParams.create(top_n_tokens=0))])
    assert zero.top == [()]  # asked for logprobs without alternatives


def test_top_k_top_p_from_candidates_masks_what_the_full_sort_masks():
    """Guards the candidate path of `apply_top_k_top_p` (one `topk`, no sort of the vocabulary):
    for top_k rows, top_p-only rows, both, untouched rows, ties at the k-th value and nuclei wider
    than the candidates (the sort's fallback), the masked logits equal the full sort's."""
    from workers.sampling.logits_processors import TOP_P_CANDIDATES, _sorted_top_k_top_p, apply_top_k_top_p

    g = torch.Generator().manual_seed(0)
    vocab = 4 * TOP_P_CANDIDATES
    peaked = torch.randn(6, vocab, generator=g) * 4  # narrow nuclei: decided by the candidates
    flat = torch.randn(2, vocab, generator=g) * 0.01  # a nucleus wider than the candidates
    tied = torch.randn(2, vocab, generator=g)
    tied[:, :50] = 7.0  # 50 tokens tie at the top: a tie with the k-th value reaches past k
    cases = [
        (peaked, [40, 0, 40, 0, 1, vocab], [0.9, 0.9, 1.0, 1.0, 0.5, 0.95]),
        (flat, [0, 40], [0.9, 0.9]),
        (tied, [10, 0], [1.0, 0.9]),
        (tied[:1], [10], [0.9]),  # 50 ties with the 10th value: the sort decides
        (torch.cat([peaked[:2], tied[:1]]), [5, 3, 60], [0.8, 1.0, 1.0]),
    ]
    for logits, top_k, top_p in cases:
        got = apply_top_k_top_p(logits.clone(), top_k, top_p)
        want = _sorted_top_k_top_p(logits.clone(), top_k, top_p)
        untouched = [k == 0 and p == 1.0 for k, p in zip(top_k, top_p, strict=True)]
        for i, same in enumerate(untouched):
            if same:
                want[i] = logits[i]
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (top_k, top_p)
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_top_k_candidates_cost_less_than_the_full_sort():
    """The default sampling of the embedded model (top_k 40, top_p 0.9) over 8 rows of a
    4096-token vocabulary takes one `topk`, not a sort: guards the candidate path's speed."""
    import time

    from workers.sampling.logits_processors import _sorted_top_k_top_p, apply_top_k_top_p

    logits = torch.randn(8, 4096, generator=torch.Generator().manual_seed(1))
    top_k, top_p = [40] * 8, [0.9] * 8

    def best(fn) -> float:
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            fn(logits, top_k, top_p)
            times.append(time.perf_counter() - t0)
        return min(times)

    best(apply_top_k_top_p)  # warm
    assert best(apply_top_k_top_p) < best(_sorted_top_k_top_p)


def test_logit_bias_of_many_rows_in_one_op_adds_each_rows_own_bias():
    """Guards the batched `apply_logit_bias` (one `index_put_` for all biased rows): each row gets
    exactly its own (token, bias) pairs, unbiased rows nothing."""
    from workers.sampling.logits_processors import apply_logit_bias

    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    biases = [{1: 5.0, 7: -2.5}, {}, {1: -1.0}, {15: 100.0, 0: 0.5}]
    rows = [Row(SamplingParams.create(logit_bias=b)) for b in biases]
    want = logits.clone()
    for i, b in enumerate(biases):
        for token, value in b.items():
            want[i, token] += value
    got = apply_logit_bias(logits.clone(), rows, [i for i, b in enumerate(biases) if b])
    assert torch.equal(got, want)


def test_a_row_with_top_p_one_keeps_its_tail_however_fp32_rounds():
    """Guards the `p < 1.0` of both top_p masks (`_sorted_top_k_top_p`, and the candidates'):
    peaked fp32 logits whose sorted cumulative mass rounds to exactly 1.0 before the tail (on an
    AVX2 CPU, 942 of 1024 tokens) would lose that tail in a row that asked for no top_p."""
    from workers.sampling.logits_processors import _sorted_top_k_top_p, apply_top_k_top_p

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1024, generator=g) * 4
    logits[:, 0] = 60.0  # one token holds all but ~e-20 of the mass: the sum is 1.0 from the start
    for fn in (_sorted_top_k_top_p, apply_top_k_top_p):
        out = fn(logits.clone(), [0, 0, 0, 1024], [0.5, 1.0, 1.0, 1.0])
        assert int((~torch.isinf(out[0])).sum()) == 1  # top_p 0.5: the best token only
        assert not torch.isinf(out[1:]).any(), fn.__name__  # p = 1: every token stays
    top_k = apply_top_k_top_p(logits[:2].clone(), [40, 40], [1.0, 1.0])  # top_k rows: k kept, no more cut
    assert ((~torch.isinf(top_k)).sum(dim=-1) == 40).all()


def _torch_greedy(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """The torch form the C++ greedy rows replace: log_softmax, argmax, gather."""
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = logprobs.argmax(dim=-1)
    return ids.tolist(), logprobs.gather(1, ids[:, None])[:, 0].tolist()


@pytest.mark.parametrize("shape", [(32, 4096), (1, 4096), (7, 100), (3, 5), (2, 1), (4, 151936)])
def test_greedy_rows_on_the_cpu_are_the_torch_forms_ids_and_logprobs_bit_for_bit(shape):
    """kernels_local/sampling/cpu.py: each row's argmax under log_softmax (the first of equal
    maxima, as ATen's argmax) and its logprob, as log_softmax computes it; a vocabulary narrower
    than a vector and one with a tail."""
    from kernels_local.sampling import cpu as cpu_greedy

    if not cpu_greedy.KERNEL.load().available:
        pytest.skip(cpu_greedy.KERNEL.load().reason)
    g = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(*shape, generator=g) * 5
    logits[0, shape[1] // 2] = logits[0, -1] = logits[0].max() + 1  # a tie: the first index wins
    ids, lps = cpu_greedy.greedy(logits)
    want_ids, want_lps = _torch_greedy(logits)
    assert ids.tolist() == want_ids and lps.tolist() == want_lps
    assert ids[0] == shape[1] // 2 or shape[1] == 1
    strided = torch.randn(shape[0], shape[1] + 3, generator=g)[:, 1:-2]  # rows of a wider tensor
    assert cpu_greedy.greedy(strided)[0].tolist() == _torch_greedy(strided)[0]


def test_a_row_with_a_nan_logit_gives_what_torch_gives():
    """A NaN logit makes the row's max NaN, so every logprob of it is NaN and ATen's argmax takes the
    first: index 0, logprob NaN (the other row is unaffected)."""
    from kernels_local.sampling import cpu as cpu_greedy

    if not cpu_greedy.KERNEL.load().available:
        pytest.skip(cpu_greedy.KERNEL.load().reason)
    logits = torch.randn(2, 50)
    logits[1, 17] = logits[1, 30] = float("nan")
    ids, lps = cpu_greedy.greedy(logits)
    assert ids.tolist() == torch.log_softmax(logits, -1).argmax(-1).tolist() == [ids[0].item(), 0]
    assert math.isnan(lps[1]) and not math.isnan(lps[0])


def test_the_sampler_takes_the_cpu_greedy_rows_only_for_an_all_greedy_step_without_alternatives(monkeypatch):
    """Guards the fast path's condition in `sample_tokens`: an all-greedy step takes the C++ kernel
    (same tokens and logprobs as the torch form); a step with a sampled row or a row asking for
    alternatives takes log_softmax, which they read whole."""
    from kernels_local.sampling import cpu as cpu_greedy

    if not cpu_greedy.KERNEL.load().available:
        pytest.skip(cpu_greedy.KERNEL.load().reason)
    calls = []
    monkeypatch.setattr(cpu_greedy, "greedy", lambda x, f=cpu_greedy.greedy: calls.append(1) or f(x))
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    greedy = [Row(SamplingParams.create()) for _ in range(3)]
    out = sample_tokens(logits, greedy)
    assert calls == [1] and (out.token_ids, out.logprobs) == _torch_greedy(logits) and out.top == [None] * 3
    sample_tokens(logits, [*greedy[:2], Row(SamplingParams.create(do_sample=True, seed=3))])
    with_top = sample_tokens(logits, [*greedy[:2], Row(SamplingParams.create(top_n_tokens=2))])
    assert calls == [1] and len(with_top.top[2]) == 2
