"""Sampler: masks on hand-built logits, vLLM's penalty formulas by hand, seeds, batch invariance, distributions.

Oracles: hand arithmetic on small vocabularies (probabilities chosen away from every threshold), the softmax
written out with ``math``, and a chi-square test of many seeded draws.
"""

import math

import pytest
import torch

from deepseek_v41 import kernels
from deepseek_v41.engine.sampler import Sampler, SamplingState, argmax, exponential_race
from deepseek_v41.engine.sampling_params import SamplingParams

EOS = 1


def state(prompt=(), output=(), eos=EOS, **kwargs) -> SamplingState:
    return SamplingState(SamplingParams(**kwargs), list(prompt), eos_token_id=eos, output_token_ids=list(output))


def logits_of(probs) -> torch.Tensor:
    """[1, V] logits whose softmax is exactly ``probs`` (up to fp32 rounding)."""
    return torch.tensor([[math.log(p) for p in probs]])


def support(p: torch.Tensor) -> set[int]:
    return set(torch.nonzero(p.flatten() > 0).flatten().tolist())


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def test_greedy_is_argmax():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    rows = [state(temperature=0.0) if i % 2 == 0 else state(temperature=1.0, seed=i) for i in range(6)]
    out = Sampler().sample(logits, rows)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    assert out.token_ids[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()
    one_hot = Sampler().probs(logits[:1], rows[0])
    assert support(one_hot) == {int(logits[0].argmax())} and one_hot.sum() == 1
    every = Sampler().sample(logits, [state(temperature=0.0) for _ in range(6)]).token_ids  # all greedy
    assert every.tolist() == logits.argmax(dim=-1).tolist()


def test_sampling_leaves_the_logits_unchanged():
    """min_tokens masking and penalties work on a copy: the caller's logits keep their values, greedy or not."""
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.0, 2.0], [3.0, 1.0, 4.0, 1.0, 5.0]])
    before = logits.clone()
    rows = [state(min_tokens=2, stop_token_ids=[3], temperature=0.0), state(output=[4], presence_penalty=2.0, seed=0)]
    for pair in (rows, rows[::-1], [rows[0], state(temperature=0.0)]):
        tokens = Sampler().sample(logits, pair).token_ids
        assert torch.equal(logits, before)
    assert tokens.tolist() == [4, 4]


def test_temperature_scales_logits():
    xs = [1.0, 2.0, 0.5, -1.0]
    probs = Sampler().probs(torch.tensor([xs]), state(temperature=0.7))
    torch.testing.assert_close(probs[0], torch.tensor(softmax([x / 0.7 for x in xs])), rtol=1e-6, atol=1e-7)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[5.0, 1.0, 3.0, 4.0, 2.0]])
    p = Sampler().probs(logits, state(top_k=2))
    assert support(p) == {0, 3}
    torch.testing.assert_close(p[0, [0, 3]], torch.tensor(softmax([5.0, 4.0])))
    # A tie with the k-th logit is kept (a threshold on values, as vLLM does), never broken by index order.
    assert support(Sampler().probs(torch.tensor([[3.0, 1.0, 3.0, 0.0]]), state(top_k=1))) == {0, 2}
    assert support(Sampler().probs(logits, state(top_k=5))) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = logits_of([0.5, 0.25, 0.15, 0.1])
    # Mass before each token in order: 0, 0.5, 0.75, 0.9; a token stays while the mass before it is < top_p.
    assert support(Sampler().probs(logits, state(top_p=0.4))) == {0}
    assert support(Sampler().probs(logits, state(top_p=0.6))) == {0, 1}
    assert support(Sampler().probs(logits, state(top_p=0.8))) == {0, 1, 2}
    assert support(Sampler().probs(logits, state(top_p=0.95))) == {0, 1, 2, 3}
    p = Sampler().probs(logits, state(top_p=0.6))
    torch.testing.assert_close(p[0, :2], torch.tensor([2 / 3, 1 / 3]))


def test_top_p_applies_to_the_top_k_distribution():
    logits = logits_of([0.5, 0.25, 0.15, 0.1])
    # After top-3 the renormalised masses before each token are 0, 0.556, 0.833: top_p=0.8 keeps two.
    assert support(Sampler().probs(logits, state(top_k=3, top_p=0.8))) == {0, 1}


def test_min_p_is_relative_to_the_tempered_maximum():
    logits = logits_of([0.5, 0.25, 0.15, 0.1])
    assert support(Sampler().probs(logits, state(min_p=0.4))) == {0, 1}  # threshold 0.2
    assert support(Sampler().probs(logits, state(min_p=0.25))) == {0, 1, 2}  # threshold 0.125
    # Min-p runs after temperature: at T=2 the ratios to the max are sqrt(p/0.5) = 1, 0.71, 0.55, 0.45.
    assert support(Sampler().probs(logits, state(min_p=0.52))) == {0}
    assert support(Sampler().probs(logits, state(min_p=0.52, temperature=2.0))) == {0, 1, 2}


def test_min_p_runs_before_top_p_as_in_vllm_v1():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # min_p=0.3 drops token 3 (0.1 < 0.12); renormalised masses before tokens: 0, 0.444, 0.778 -> top_p=0.75
    # keeps two. Top-p first would have kept three (mass before token 2 is 0.7 < 0.75).
    assert support(Sampler().probs(logits, state(min_p=0.3, top_p=0.75))) == {0, 1}


def test_penalties_match_vllm_formulas_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    st = state(prompt=[0], output=[1, 2, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = [
        2.0 / 2.0,  # prompt token, positive logit: divided by r
        -1.0 * 2.0 - 0.5 * 1 - 0.25,  # once in the output, negative: multiplied by r, then freq * 1 + presence
        0.5 / 2.0 - 0.5 * 2 - 0.25,  # twice in the output
        3.0,  # unseen
        -2.0,
    ]
    p = Sampler().probs(logits, st)
    torch.testing.assert_close(p[0], torch.tensor(softmax(expected)), rtol=1e-6, atol=1e-7)
    # Presence and frequency read the output only: a prompt-only token is untouched by them.
    p = Sampler().probs(logits, state(prompt=[3], output=[1], presence_penalty=1.0))
    torch.testing.assert_close(p[0], torch.tensor(softmax([2.0, -2.0, 0.5, 3.0, -2.0])), rtol=1e-6, atol=1e-7)


def test_penalty_counts_follow_appended_output():
    st = state(output=[2], frequency_penalty=1.0)
    logits = torch.zeros(1, 4)
    torch.testing.assert_close(Sampler().probs(logits, st)[0], torch.tensor(softmax([0, 0, -1, 0])))
    st.output_token_ids += [2, 3]
    torch.testing.assert_close(Sampler().probs(logits, st)[0], torch.tensor(softmax([0, 0, -2, -1])))


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.0, 2.0]])  # EOS=1 and stop id 3 are the favourites
    st = state(min_tokens=2, stop_token_ids=[3], temperature=0.0)
    assert Sampler().sample(logits, [st]).token_ids.tolist() == [4]
    assert support(Sampler().probs(logits, state(min_tokens=2, stop_token_ids=[3]))) == {0, 2, 4}
    st.output_token_ids += [4, 4]  # min_tokens reached
    assert Sampler().sample(logits, [st]).token_ids.tolist() == [1]
    # ignore_eos: EOS is an ordinary token and is not masked; stop ids still are.
    assert support(Sampler().probs(logits, state(min_tokens=2, stop_token_ids=[3], ignore_eos=True))) == {0, 1, 2, 4}


def test_positions_see_the_drafts_before_them():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    kwargs = {"min_tokens": 3, "stop_token_ids": [7], "repetition_penalty": 1.3, "frequency_penalty": 0.4}
    drafts = [5, 7]
    joint = Sampler().probs(logits, state(prompt=[9], output=[5], **kwargs), drafts)
    for k in range(3):
        alone = Sampler().probs(logits[k:k + 1], state(prompt=[9], output=[5] + drafts[:k], **kwargs))
        torch.testing.assert_close(joint[k], alone[0])
    assert joint[0, 1] == 0 and joint[1, 1] == 0 and joint[2, 1] > 0  # EOS masked until 3 tokens exist
    with pytest.raises(ValueError, match="3 positions need at least 2 draft_token_ids"):
        Sampler().probs(logits, state(), [5])


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(2))

    def run(seed):
        st = state(seed=seed, temperature=1.0)
        return [Sampler().sample(logits, [st]).token_ids.item() for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    unseeded = state()
    assert unseeded.seed is not None and state().seed != unseeded.seed


def test_batch_invariance():
    """The same request yields the same tokens alone and at any place in batches of 1..8 of other requests."""
    vocab, steps = 2000, 6
    g = torch.Generator().manual_seed(3)
    target_logits = torch.randn(steps, vocab, generator=g) * 3
    target = {"seed": 1234, "temperature": 0.9, "top_k": 50, "top_p": 0.9, "min_p": 0.01,
              "repetition_penalty": 1.1, "presence_penalty": 0.3, "logprobs": 2}

    def run(batch: int, where: int) -> list[int]:
        rows = [state(prompt=[1, 2, 3], **target)]
        others = [state(prompt=[4], seed=i, temperature=0.5 + 0.1 * i, top_k=i, frequency_penalty=0.2 * (i % 3))
                  if i % 3 else state(temperature=0.0) for i in range(1, batch)]
        rows = others[:where] + rows + others[where:]
        tokens = []
        for step in range(steps):
            logits = torch.randn(batch, vocab, generator=g) * 3
            logits[where] = target_logits[step]
            out = Sampler().sample(logits, rows)
            for r, t in zip(rows, out.token_ids.tolist(), strict=True):
                r.output_token_ids.append(t)
            tokens.append(out.token_ids[where].item())
        return tokens

    alone = run(1, 0)
    for batch in range(2, 9):
        assert run(batch, batch // 2) == alone, batch


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a zero-probability token was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 0.1% critical values of chi-square by degrees of freedom.
CHI2_999 = {3: 16.27, 5: 20.52, 7: 24.32}


def test_exponential_race_matches_softmax_of_logits_over_t():
    xs = [1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, 1.1]
    t, n = 0.7, 20000
    target = torch.tensor(softmax([x / t for x in xs]))
    draws = exponential_race(target.expand(n, -1).contiguous(), torch.Generator().manual_seed(4))
    counts = torch.bincount(draws, minlength=len(xs)).double()
    assert chi_square(counts, target.double()) < CHI2_999[7]


def test_sampler_draws_from_probs():
    """``probs()`` is the distribution the sampler draws from: exactly (same race) and empirically."""
    xs = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, 1.1, -3.0, 0.4]])
    kwargs = {"temperature": 0.8, "top_k": 7, "top_p": 0.9, "repetition_penalty": 1.2}
    logits = xs.expand(5, -1)
    drafts = [0, 6, 0, 3]
    a = state(prompt=[3], seed=11, **kwargs)
    b = state(prompt=[3], seed=11, **kwargs)
    sampled = Sampler().sample_row(logits, a, drafts).token_ids
    assert sampled.tolist() == exponential_race(Sampler().probs(logits, b, drafts), b.generator).tolist()

    st = state(prompt=[3], seed=12, **kwargs)
    st_probs = Sampler().probs(xs, st)[0].double()
    draws = torch.tensor([Sampler().sample(xs, [st]).token_ids.item() for _ in range(4000)])
    counts = torch.bincount(draws, minlength=10).double()
    dof = int((st_probs > 0).sum()) - 1
    assert chi_square(counts, st_probs) < CHI2_999[dof]


def test_logprobs_are_raw_by_default():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0], [0.0, 0.1, 0.2, 0.3, 0.4]])
    rows = [state(output=[3], seed=5, temperature=0.5, top_k=2, presence_penalty=1.0, logprobs=2),
            state(temperature=0.0)]
    out = Sampler().sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == (2, 3) and lp.logprobs.shape == (2, 3)
    token = out.token_ids[0].item()
    assert token in (0, 3)
    torch.testing.assert_close(lp.logprobs[0, 0], raw[0, token])
    assert lp.token_ids[0, 1:].tolist() == [3, 0]
    torch.testing.assert_close(lp.logprobs[0, 1:], raw[0, [3, 0]])
    as_dict = lp.to_dict(0, 2)
    assert set(as_dict) == {3, 0}
    assert as_dict[3].rank == 1 and as_dict[0].rank == 2
    assert as_dict[token].rank == lp.ranks[0].item() == (1 if token == 3 else 2)
    assert lp.to_dict(1, 0) == {4: (pytest.approx(raw[1, 4].item()), 1)}


def test_processed_logprobs_are_the_sampled_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0]])
    st = state(seed=5, temperature=0.5, top_k=2, logprobs=5)
    out = Sampler(logprobs_mode="processed_logprobs").sample(logits, [st])
    expected = torch.log(Sampler().probs(logits, state(temperature=0.5, top_k=2)))
    torch.testing.assert_close(out.logprobs.logprobs[0, 1:3], expected[0, [3, 0]])
    assert torch.isinf(out.logprobs.logprobs[0, 3:]).all()
    with pytest.raises(ValueError, match="logprobs_mode must be"):
        Sampler(logprobs_mode="raw_logits")


def test_input_errors():
    with pytest.raises(ValueError, match="logits must be 2-D"):
        Sampler().sample(torch.zeros(5), [state()])
    with pytest.raises(ValueError, match="logits has 2 rows but 1 sampling states"):
        Sampler().sample(torch.zeros(2, 5), [state()])
    with pytest.raises(ValueError, match=r"output_token_ids holds ids outside \[0, 5\)"):
        Sampler().sample(torch.zeros(1, 5), [state(output=[9], presence_penalty=1.0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_is_torch_argmax_with_ties_nan_and_inf(dtype):
    """The sampler's argmax (``max(dim=-1).indices``) picks what ``torch.argmax`` picks: the first largest value,
    NaN first, on rows full of ties, -inf, +inf and NaN."""
    g = torch.Generator().manual_seed(5)
    for trial in range(200):
        x = torch.randint(0, 3, (4, 300), generator=g).to(dtype)  # many ties at the maximum
        u = torch.rand(4, 300, generator=g)
        if trial % 3 == 0:
            x[u < 0.01] = float("nan")
        if trial % 4 == 1:
            x[u < 0.02] = float("inf")
        if trial % 5 == 2:
            x[1] = float("-inf")
        assert torch.equal(argmax(x), x.argmax(dim=-1)), trial
    assert argmax(torch.tensor([[1.0, 3.0, 3.0]])).tolist() == [1]


@pytest.mark.parametrize("V", [1, 7, 16, 17, 300, 8192])
def test_argmax_kernel_gives_torchs_indices(monkeypatch, V, kernel_library):
    """fp32 rows take the kernel (deepseek_v41.kernels.argmax: a vector pass for the maximum and NaN, then the
    first index), whose picks are torch's: ties, NaN at the start / in the middle / in the last lanes, +-0, all
    -inf, +inf, row lengths below, at and past the vector width."""
    calls = []
    real = kernels.argmax
    monkeypatch.setattr(kernels, "argmax", lambda x: calls.append(x.shape) or real(x))
    g = torch.Generator().manual_seed(V)
    x = torch.randint(-2, 3, (9, V), generator=g).float()
    x[1] = float("-inf")
    x[2, -1] = float("nan")
    x[3, V // 2] = float("nan")
    x[4, 0] = float("nan")
    x[5] = 0.0
    x[5, ::2] = -0.0
    x[6, V // 3] = float("inf")
    x[7] = torch.randn(V, generator=g)
    x[8] = -torch.rand(V, generator=g)
    got = argmax(x)
    assert calls == [x.shape]
    assert torch.equal(got, x.argmax(dim=-1)) and torch.equal(got, x.max(dim=-1).indices)
    assert torch.equal(argmax(x[3]), x[3].argmax())
