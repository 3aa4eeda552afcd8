"""The adaptive DSpark scheduler (issue 26, "DSpark must pay or step aside"; engine/spec_schedule.py).

Oracles: hand arithmetic for the step choice and the cost estimates; synthetic timings for the policy's probes;
the non-speculative engine (float64 model) for greedy output; a fresh engine that prefills the whole sequence for
the draft's context after plain steps (its ring holds the exact rows of those positions, and its draft proposes
what the draft should propose there).
"""

import pytest
import torch
from engine_oracles import tiny_model

from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.spec_schedule import (
    PLAIN,
    SPEC,
    SequenceAcceptance,
    SpeculationPolicy,
    StepCosts,
    SurvivalCalibration,
    choose_verify_length,
    expected_tokens,
    expected_tokens_by_length,
)
from deepseek_v41.engine.speculative import DSparkSpeculator

K = 4  # tiny config's dspark_block_size


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tokens_of(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


# ---------------------------------------------------------------------------------------------- the step choice
def test_choice_of_the_verification_length_from_timings_and_survival():
    survival = [0.6, 0.2, 0.1, 0.05]
    # Plain 5 ms for 1 token (200 tok/s); speculative 11 ms for 1.6 tokens at ℓ = 1 (145 tok/s), less after: plain.
    assert choose_verify_length([survival], [4], 0.005, [0.010, 0.011, 0.012, 0.013, 0.014]) == 0
    # A cheap draft and verify: Θ(ℓ) = (1 + Σ ŝ) / t = 1.6/6.2, 1.8/6.4, 1.9/6.6, 1.95/6.8 tokens/ms = 0.258,
    # 0.281, 0.288, 0.287, all above plain's 0.2 -> ℓ = 3.
    assert choose_verify_length([survival], [4], 0.005, [0.006, 0.0062, 0.0064, 0.0066, 0.0068]) == 3
    # Caps: a sequence that may verify no draft adds 1 token whatever ℓ: 2 sequences, τ(1) = 1.6 + 1 = 2.6 tokens in
    # 8 ms (325/s) against 2 in 7 ms (286/s) -> ℓ = 1; τ(2) = 2.8 in 9 ms (311/s) is worse.
    assert expected_tokens([survival] * 2, [4, 0], 1) == pytest.approx(2.6)
    assert choose_verify_length([survival] * 2, [4, 0], 0.007, [0.0075, 0.008, 0.009, 0.010, 0.011]) == 1
    # Per-sequence survival, one flat 7.8 ms step at every ℓ against a plain step of 7 ms (2 tokens: 286/s): two
    # sequences at [0.6, 0.2, ...] give 2 x 1.95 tokens at ℓ = 4 (500/s) -> 4; one of them at [0.1, 0, ...] adds
    # 1.1, not 1.95: 3.05 tokens (391/s) -> 4 still; both at 0.1: 2.2 tokens (282/s) -> plain.
    low = [0.1, 0.0, 0.0, 0.0]
    assert expected_tokens([survival, low], [4, 4], 2) == pytest.approx(1 + 0.8 + 1 + 0.1)
    by_length = expected_tokens_by_length([survival, low], [4, 1], 4)  # one cumulative pass, caps applied
    assert by_length == pytest.approx([expected_tokens([survival, low], [4, 1], n) for n in range(5)])
    assert by_length == pytest.approx([2, 2.7, 2.9, 3.0, 3.05])
    assert choose_verify_length([survival, survival], [4, 4], 0.007, [0.0078] * 5) == 4
    assert choose_verify_length([survival, low], [4, 4], 0.007, [0.0078] * 5) == 4
    assert choose_verify_length([low, low], [4, 4], 0.007, [0.0078] * 5) == 0
    # A tie keeps the smaller length: 1.6 tokens in 8 ms = 1 token in 5 ms.
    assert choose_verify_length([[0.6]], [1], 0.005, [0.007, 0.008]) == 0
    with pytest.raises(ValueError, match="positive"):
        choose_verify_length([survival], [4], 0.0, [0.006] * 5)


def test_step_costs_are_running_medians_and_a_fitted_forward_line():
    costs = StepCosts(window=3, span=0)  # the last 3 observations per key, however recent
    assert costs.plain(1) is None and costs.spec_times(1, K) is None
    costs.observe_plain(1, 9.0)  # the first step at a shape is warm-up: dropped
    assert costs.plain(1) is None and not costs.seen(PLAIN, 1)
    for step in (0.010, 0.012, 0.011, 0.050):  # a window of 3: 0.012, 0.011, 0.050 -> median 0.012
        costs.observe_plain(1, step)
    assert costs.plain(1) == 0.012 and costs.seen(PLAIN, 1)
    for _ in range(3):
        costs.observe_spec(1, 5, 0.014, 0.008)  # fixed part 6 ms, verify forward at T = 5: 8 ms
    assert costs.spec_times(1, 2) == pytest.approx([0.014] * 3)  # one width: a flat line until another is seen
    for _ in range(3):
        costs.observe_spec(1, 1, 0.012, 0.006)  # fixed part 6 ms, verify forward at T = 1: 6 ms
    # forward(1, T) through (T = 1, 6 ms) and (T = 5, 8 ms): 6 + 0.5 (T - 1) ms; a step at ℓ: 6 ms + forward(1, 1 + ℓ).
    assert costs.forward(1, 3) == pytest.approx(0.007)
    assert costs.spec_times(1, K) == pytest.approx([0.012, 0.0125, 0.013, 0.0135, 0.014])
    # A batch observed at one width borrows the per-row slope of the nearest batch with two (0.5 ms / 1 row).
    for _ in range(3):
        costs.observe_spec(4, 2, 0.030, 0.020)
    assert costs.forward(4, 2) == pytest.approx(0.020)
    assert costs.forward(4, 4) == pytest.approx(0.020 + 2 * 4 * 0.0005)
    # An unobserved batch: intercepts and fixed parts interpolated between batch sizes 1 and 4.
    assert costs.fixed(2) == pytest.approx(0.006 + (0.010 - 0.006) / 3)
    assert costs.plain(8) == 0.012  # one batch size observed: its value


def test_step_costs_never_go_negative():
    """A steep per-row slope borrowed by a batch seen at one width, and a noisy fit whose intercept falls below 0,
    once made spec_times negative and the policy raised ValueError in the middle of serving (found in a bench)."""
    costs = StepCosts(window=3)
    for _ in range(3):  # batch 2: 1 ms at T = 1, 21 ms at T = 6 -> 4 ms per token, 2 ms per row and token
        costs.observe_spec(2, 1, 0.003, 0.001)
        costs.observe_spec(2, 6, 0.023, 0.021)
        costs.observe_spec(8, 6, 0.030, 0.028)  # batch 8, one width: the borrowed 16 ms per token would put
        costs.observe_plain(8, 0.009)  # forward(8, 1) at 28 - 5 x 16 = -52 ms
    assert costs.forward(8, 6) == pytest.approx(0.028)  # through its own point, no steeper than through 0
    times = costs.spec_times(8, K + 1)
    assert all(t > 0 for t in times) and times == sorted(times)
    policy = SpeculationPolicy(K + 1)
    policy.costs = costs
    policy.calibration.observe([[0.8] * (K + 1)] * 8, [K + 1] * 8, [3] * 8)
    assert policy.decide([K + 1] * 8) in (PLAIN, SPEC)  # raised ValueError before
    # A weighted fit whose intercept would be negative goes through the origin instead.
    for _ in range(3):
        costs.observe_spec(4, 1, 0.002, 0.0001)
        costs.observe_spec(4, 3, 0.0015, 0.0005)
        costs.observe_spec(4, 6, 0.013, 0.012)  # least squares: 4.2 - 2.49 x 2.33 = -1.6 ms at T = 1
    b = (2 * 0.0005 + 5 * 0.012) / (2 ** 2 + 5 ** 2)  # Σxy / Σx² over x = T - 1 = 0, 2, 5
    assert costs.forward(4, 1) == 0.0 and costs.forward(4, 6) == pytest.approx(5 * b)


def test_step_cost_windows_span_decode_steps():
    """A key keeps its last ``window`` observations and every one of the last ``span`` decode steps: the kind that
    runs most steps keeps a long window, and a short burst of slow steps does not move its median."""
    costs = StepCosts(window=3, span=20)
    costs.observe_plain(8, 1.0)  # warm-up, dropped
    for _ in range(12):
        costs.observe_plain(8, 0.008)
    for _ in range(8):  # a busy neighbour for 8 steps: with only the last 3 kept, the estimate would be 12 ms
        costs.observe_plain(8, 0.012)
    assert costs.plain(8) == 0.008  # 12 x 8 ms and 8 x 12 ms in the 20-step span
    for _ in range(3):
        costs.observe_spec(8, 6, 0.040, 0.030)  # a rare kind keeps its last 3 however old
    for _ in range(40):
        costs.observe_plain(8, 0.009)
    assert costs.fixed(8) == pytest.approx(0.010) and costs.plain(8) == 0.009
    assert len(costs._plain[8]) == 20 and len(costs._fixed[8]) == 2  # the first spec step was warm-up


def test_sequence_acceptance_blends_its_history_with_the_mean():
    mean = [0.8, 0.6, 0.4]
    acc = SequenceAcceptance(3, decay=0.5)
    assert acc.survival(mean) == mean  # never verified: the batch's mean
    acc.observe(0, 0)  # nothing verified: nothing learnt
    assert acc.survival(mean) == mean
    acc.observe(3, 0)  # all three verified, the first rejected
    acc.observe(2, 1)  # two verified, the first accepted; counts were halved first
    # verified 1.5, 1.5, 0.5; accepted through j: 1, 0, 0 -> (1 + 1.6) / 3.5, (0 + 1.2) / 3.5, (0 + 0.8) / 2.5
    assert acc.verified == [1.5, 1.5, 0.5] and acc.accepted == [1.0, 0.0, 0.0]
    assert acc.survival(mean) == pytest.approx([2.6 / 3.5, 1.2 / 3.5, 0.32])
    assert SequenceAcceptance(3).survival([0.5, 0.6, 0.1]) == [0.5, 0.5, 0.1]  # kept non-increasing
    acc.observe(3, 5)  # accepted never exceeds verified
    assert acc.accepted == [1.5, 1.0, 1.0]


def test_survival_calibration_matches_the_acceptance_that_happened():
    calib = SurvivalCalibration(2, decay=1.0, prior=1.0)
    assert calib.mean is None and calib.apply([0.8, 0.2]) == [0.8, 0.2]
    # 20 rows predicting 0.8 / 0.2, all verified at 2: first draft accepted in 10, both in 8. The prior is one
    # row at ratio 1 (predicting the mean, 0.8 / 0.2).
    rows = [[0.8, 0.2]] * 20
    accepted = [2] * 8 + [1] * 2 + [0] * 10
    calib.observe(rows, [2] * 20, accepted)
    assert calib.ratio(0) == pytest.approx((10 + 0.8) / (16 + 0.8))
    assert calib.ratio(1) == pytest.approx((8 + 0.2) / (4 + 0.2))
    assert calib.apply([0.8, 0.2]) == pytest.approx([0.8 * 10.8 / 16.8, 0.2 * 8.2 / 4.2])
    assert calib.apply([0.5, 0.5]) == pytest.approx([0.5 * 10.8 / 16.8] * 2)  # kept non-increasing
    assert calib.mean == pytest.approx(calib.apply([0.8, 0.2]))
    # A head predicting tiny survival for drafts that are all accepted is corrected within a few rows: after 3,
    # ρ = 2.71 accepted + 0.01 prior over 0.0271 predicted + 0.01 = 73.3, so 0.01 plans as 0.733.
    tiny = SurvivalCalibration(1, decay=0.9)
    for _ in range(3):
        tiny.observe([[0.01]], [1], [1])
    assert tiny.mean[0] == pytest.approx(0.01 * 2.72 / 0.0371)


def feed(policy: SpeculationPolicy, batch: int, plain: float, spec: float, acceptance: float, steps: int) -> list[str]:
    """Run ``steps`` decisions, observing each chosen step with these timings (spec: a full-block step whose
    verify forward is 60 % of it) and, after speculative steps, mean survival acceptance^j."""
    kinds = []
    for _ in range(steps):
        kind = policy.decide([K] * batch)
        kinds.append(kind)
        if kind == PLAIN:
            policy.costs.observe_plain(batch, plain)
        else:
            policy.costs.observe_spec(batch, K + 1, spec, spec * 0.6)
            policy.calibration.mean = [acceptance ** (j + 1) for j in range(K)]
    return kinds


def test_policy_steps_aside_probes_and_comes_back():
    policy = SpeculationPolicy(K, probe_budget=0.01, warmup_rows=0)  # warm-up probing: the next test
    # New batch size: a speculative step and a plain one first (two of each: the first is warm-up).
    assert feed(policy, 8, 0.010, 0.030, 0.3, 4) == [SPEC, SPEC, PLAIN, PLAIN]
    # Acceptance 0.3 (ŝ = 0.3, 0.09, 0.027, 0.0081); one verify width seen, so 30 ms at every ℓ: the best, ℓ = 4,
    # gives 8 x 1.4251 tokens (380/s) against plain's 800/s. A probe costs 30 ms plus the 25 % margin (min_gain)
    # less the plain time of its tokens: 37.5 - 11.40 x 10 / 8 = 23.25 ms; 1 % of 10 ms steps is 0.1 ms: one probe
    # every 232 steps.
    kinds = feed(policy, 8, 0.010, 0.030, 0.3, 500)
    probes = [i for i, k in enumerate(kinds) if k == SPEC]
    assert len(probes) == 2 and probes[1] - probes[0] == 232
    # The draft got better (0.95 per position): at the next probe speculation wins (36.19 tokens in 30 ms) and
    # takes over; plain steps are probed every (10 - 8 x 30 / 36.19) / 0.3 = 11 steps.
    kinds = feed(policy, 8, 0.010, 0.030, 0.95, 400)
    assert kinds.index(SPEC) < 233 and kinds[-200:].count(PLAIN) in (18, 19)
    # Nothing left to verify (caps 0): plain.
    assert policy.decide([0, 0]) == PLAIN


def test_speculation_must_win_by_min_gain():
    """Expected 8 x (1 + 0.3 + 0.09 + 0.027 + 0.0081) = 11.40 tokens in 14 ms (814/s) against plain's 8 in 10 ms
    (800/s): 1.8 % better, so plain stays the winner under the default 25 % and speculation wins with no margin;
    in 11 ms (1036/s, 30 % better) it wins under the default too, in 12 ms (950/s, 19 % better) not."""
    for seconds, winner in ((0.011, SPEC), (0.012, PLAIN)):
        policy = SpeculationPolicy(K)
        feed(policy, 8, 0.010, seconds, 0.3, 4)
        assert policy.compare([K] * 8)[0] == winner and policy.min_gain == 0.25
    for gain, winner in ((0.25, PLAIN), (0.0, SPEC)):
        policy = SpeculationPolicy(K, min_gain=gain)
        feed(policy, 8, 0.010, 0.014, 0.3, 4)
        assert policy.compare([K] * 8)[0] == winner
    with pytest.raises(ValueError, match="min_gain"):
        SpeculationPolicy(K, min_gain=1.0)


def test_plain_steps_keep_the_draft_context_only_when_a_probe_can_read_it():
    policy = SpeculationPolicy(K, probe_budget=0.01, context_window=10, warmup_rows=0)
    feed(policy, 8, 0.010, 0.030, 0.3, 4)  # warm-up; plain then wins, a probe every 232 steps
    kinds, kept = [], []
    for _ in range(470):
        kinds.append(policy.decide([K] * 8))
        if kinds[-1] == PLAIN:
            kept.append(policy.keep_context())
            policy.costs.observe_plain(8, 0.010)
        else:
            kept.append(None)
            policy.costs.observe_spec(8, K + 1, 0.030, 0.018)
    probe = kinds.index(SPEC)
    assert kinds.count(SPEC) == 2 and kinds.index(SPEC, probe + 1) - probe == 232  # not delayed
    # the 10 plain steps before each probe keep their rows, the others do not
    assert kept[probe - 10: probe] == [True] * 10 and not any(kept[probe + 1: probe + 222])
    assert kept[probe + 222: probe + 232] == [True] * 10
    # A probe that comes due sooner than planned (here: its rows were dropped up to the step before) waits
    # until the last 10 steps kept theirs.
    policy.kept, policy.since[SPEC] = 0, 230
    kinds = []
    for _ in range(12):
        kinds.append(policy.decide([K] * 8))
        if kinds[-1] == PLAIN:
            policy.keep_context()
    assert kinds == [PLAIN] * 10 + [SPEC, PLAIN]


def test_a_fresh_policy_probes_often_until_enough_drafts_were_verified():
    """Two unlucky first speculative steps must not shut speculation out for hundreds of steps (a fresh engine at
    batch 1 once ran 252 of 256 steps plain where the full block was 1.6x faster): until ``warmup_rows``
    sequence-steps verified drafts, a losing speculation is probed every ``min_interval`` steps."""
    policy = SpeculationPolicy(K, probe_budget=0.01, warmup_rows=3)
    feed(policy, 1, 0.010, 0.030, 0.3, 4)  # warm-up measurements: two speculative steps (one row each)
    policy.calibration.observe([[0.3] * K], [K], [0])  # a first verified row: 1 of 3
    kinds = feed(policy, 1, 0.010, 0.030, 0.3, 40)
    probes = [i for i, k in enumerate(kinds) if k == SPEC]
    gaps = {b - a for a, b in zip(probes, probes[1:], strict=False)}
    assert probes[0] < 8 and gaps == {8}  # min_interval while rows are few
    for _ in range(2):
        policy.calibration.observe([[0.3] * K], [K], [0])
    kinds = feed(policy, 1, 0.010, 0.030, 0.3, 100)
    assert kinds.count(SPEC) <= 1  # then the estimated loss sets the interval (150+ steps here)


def test_plain_steps_ahead_counts_down_to_the_next_probe():
    policy = SpeculationPolicy(K, probe_budget=0.01, warmup_rows=0)
    feed(policy, 8, 0.010, 0.030, 0.3, 4)  # warm-up: spec, spec, plain, plain
    assert policy.plain_steps_ahead() == 0  # no comparison yet
    kinds = feed(policy, 8, 0.010, 0.030, 0.3, 1)  # plain wins, a probe every 232 steps (the test above)
    ahead = policy.plain_steps_ahead()
    assert kinds == [PLAIN] and 0 < ahead < 232
    kinds = feed(policy, 8, 0.010, 0.030, 0.3, ahead + 1)
    assert kinds == [PLAIN] * ahead + [SPEC]  # exactly as planned
    feed(policy, 8, 0.010, 0.030, 0.95, 300)  # speculation wins after the next probe: the next step may speculate
    assert policy.decide([K] * 8) == SPEC and policy.plain_steps_ahead() == 0
    with pytest.raises(ValueError, match="probe_budget"):
        SpeculationPolicy(K, probe_budget=0.0)


# ---------------------------------------------------------------------------------------------- in the engine
def forced(monkeypatch, pattern):
    """Make every adaptive policy choose by ``pattern(step index)`` -> PLAIN / SPEC (the measurements still run)."""
    counter = {"n": 0}

    def decide(self, caps, histories=None):
        counter["n"] += 1
        return pattern(counter["n"] - 1)

    monkeypatch.setattr(SpeculationPolicy, "decide", decide)


@pytest.mark.parametrize("mode", ["ced", "exact"])
def test_greedy_output_is_plain_decodings_with_the_adaptive_scheduler(model64, monkeypatch, mode):
    """Batches of 5 that shrink (different max_tokens), prompts inside and beyond the window: the adaptive
    scheduler as it chooses, and forced runs of plain steps between speculative ones, emit plain decoding's
    tokens (float64)."""
    prompts = [prompt_of(n, seed=500 + n) for n in (3, 15, 17, 40, 70)]
    params = [greedy(12 + 5 * i) for i in range(5)]
    common = dict(prefill_mode=mode, max_model_len=512, replay="exact")
    want = tokens_of(LLM(model64, **common), prompts, params)
    adaptive = LLM(model64, speculative="dspark", **common)
    assert tokens_of(adaptive, prompts, params) == want
    stats = adaptive.stats
    assert stats["spec_decode_num_plain_steps"] > 0 and stats["spec_decode_num_drafts"] > 0  # both kinds ran
    assert stats["spec_decode_step_costs"]  # measured per batch size
    forced(monkeypatch, lambda n: SPEC if n % 7 in (0, 3) else PLAIN)
    assert tokens_of(LLM(model64, speculative="dspark", **common), prompts, params) == want


def test_draft_context_after_plain_steps_is_exact(monkeypatch):
    """After 9 plain steps (past the window of 16 from a prompt of 12) the first speculative step's draft reads
    the rows of every committed position it would have read had every step speculated: equal to those of a
    fresh engine that prefilled the same tokens, and it proposes the same drafts with the same survival."""
    model = tiny_model(torch.float64)
    model.mtp.fake_quant = False  # compare rows, not FP8 rounding of float64 noise
    captured = []
    propose = DSparkSpeculator.propose

    def spy(self, seqs):
        seq = seqs[0]
        slot = torch.tensor([seq.slot])
        ring = self._state(slot)
        out = propose(self, seqs)
        captured.append((seq.num_computed, seq.token_at(0, seq.num_computed + 1), ring.positions[0].clone(),
                         ring.keys[:, 0].clone(), out))
        return out

    monkeypatch.setattr(DSparkSpeculator, "propose", spy)
    common = dict(prefill_mode="exact", max_model_len=256, enable_prefix_caching=False)
    forced(monkeypatch, lambda n: PLAIN if n < 9 else SPEC)
    prompt = prompt_of(12, seed=9)
    LLM(model, speculative="dspark", **common).generate({"prompt_token_ids": prompt}, greedy(12))
    computed, tokens, positions, keys, out = captured[0]
    assert computed == 12 + 9  # prefill, then 9 plain steps: positions 12..20 came from decode forwards
    captured.clear()
    forced(monkeypatch, lambda n: SPEC)
    LLM(model, speculative="dspark", **common).generate({"prompt_token_ids": tokens[:computed]}, greedy(2))
    ref_computed, ref_tokens, ref_positions, ref_keys, ref_out = captured[0]
    assert (ref_computed, ref_tokens) == (computed, tokens)  # the same anchor at the same position
    order, ref_order = positions.argsort(), ref_positions.argsort()
    assert positions[order].tolist() == ref_positions[ref_order].tolist() == list(range(computed - 16, computed))
    torch.testing.assert_close(keys[:, order], ref_keys[:, ref_order])
    assert out[0].tolist() == ref_out[0].tolist()
    torch.testing.assert_close(out[2], ref_out[2])


def test_plain_steps_far_from_a_probe_take_no_taps(model64, monkeypatch):
    """A plain step whose rows cannot reach the draft (W or more plain steps planned before the next speculative
    one) takes no taps; a speculative step that comes sooner drafts over a window with holes: the output is
    still plain decoding's, and its acceptance is kept out of the policy's estimates until the window is whole."""
    prompt = prompt_of(20, seed=77)
    want = tokens_of(LLM(model64, max_model_len=256), [prompt], greedy(40))
    forced(monkeypatch, lambda n: PLAIN if n < 10 else SPEC)  # 10 plain steps, then speculation
    monkeypatch.setattr(SpeculationPolicy, "plain_steps_ahead", lambda self: 1000)  # "the next probe is far"
    llm = LLM(model64, speculative="dspark", max_model_len=256)
    taps = []
    original = DSparkSpeculator.decode_taps
    monkeypatch.setattr(DSparkSpeculator, "decode_taps",
                        lambda self, seqs: taps.append(original(self, seqs)) or taps[-1])
    observed = []
    observe = SurvivalCalibration.observe
    monkeypatch.setattr(SurvivalCalibration, "observe",
                        lambda self, survival, verified, accepted: observed.append(len(survival))
                        or observe(self, survival, verified, accepted))
    assert tokens_of(llm, [prompt], greedy(40)) == want
    W = llm.engine.speculator.window
    assert taps == [None] * 10  # no plain step kept its rows
    # positions 20..29 came from plain steps without taps: the window of a step at num_computed c has holes
    # while c - W < 30, so the first speculative steps are not observed, the later ones are
    assert observed[0] == 0 and observed[-1] == 1 and W < 40


def test_preemption_drops_the_draft_backlog(model64, monkeypatch):
    """A preempted sequence recomputes its positions (and their draft rows) when prefilled again: while it waits
    it must not pin the taps of its plain steps (W steps of the whole batch's target-layer rows)."""
    forced(monkeypatch, lambda n: PLAIN)
    llm = LLM(model64, speculative="dspark", max_model_len=256)
    engine = llm.engine
    engine.add_request("a", prompt_of(20, seed=3), greedy(30))
    for _ in range(6):
        engine.step()
    seq = engine.scheduler.running[0]
    assert len(seq.draft_backlog) == 5  # the prefill step, then 5 plain steps
    engine.scheduler.preempt(seq)
    assert seq.draft_backlog == []
    while engine.has_unfinished_requests():
        engine.step()


def test_stats_count_plain_steps_and_only_verified_drafts(model64, monkeypatch):
    """vLLM's spec_decode counters: a draft counts when the target verified some of it. Plain steps are counted
    apart (and in the step mix at ℓ = 0); a speculative step that verified nothing adds no draft."""
    prompts = [prompt_of(n, seed=600 + n) for n in (5, 20)]
    forced(monkeypatch, lambda n: PLAIN)
    llm = LLM(model64, speculative="dspark", max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10))
    stats = llm.stats
    assert stats["spec_decode_num_plain_steps"] == 2 * 9 == stats["spec_decode_verify_lengths"][0]
    assert stats["spec_decode_num_drafts"] == stats["spec_decode_num_draft_tokens"] == 0
    assert stats["spec_decode_mean_accepted_length"] == 0.0 and stats["spec_decode_mean_verify_length"] == 0.0
    assert [o.spec_verify_steps for o in outs] == [0, 0]
    # A cost table under which verifying is never worth it: every step drafts and verifies nothing.
    none = LLM(model64, speculative="dspark", max_model_len=256, speculative_cost_table=[1.0] + [100.0] * K)
    none.generate([{"prompt_token_ids": p} for p in prompts], greedy(10))
    stats = none.stats
    assert stats["spec_decode_verify_lengths"][0] == 2 * 9 and stats["spec_decode_num_plain_steps"] == 0
    assert stats["spec_decode_num_drafts"] == 0 and stats["spec_decode_mean_accepted_length"] == 0.0


def test_sampling_stays_lossless_with_plain_and_speculative_steps_mixed(monkeypatch):
    """Tokens 2 and 3 of every sample come from plain steps, speculative steps or both (a forced mix): the joint
    of the 3 tokens still matches the exact forward's (test_speculative's chi-square oracle)."""
    from test_speculative import chi_square_p, exact_joint, sample_counts, small_vocab_model

    model = small_vocab_model()
    prompt = [3, 4, 5, 6]
    params = SamplingParams(n=160, temperature=0.9, top_k=2, presence_penalty=0.7, max_tokens=3, ignore_eos=True)
    joint = exact_joint(model, prompt, 0.9, 2, 0.7).flatten()
    forced(monkeypatch, lambda n: SPEC if n % 3 else PLAIN)
    llm = LLM(model, max_model_len=64, speculative="dspark")
    assert chi_square_p(sample_counts(llm, prompt, params).flatten(), joint) > 1e-3
    stats = llm.stats
    assert stats["spec_decode_num_plain_steps"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
