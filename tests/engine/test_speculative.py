"""DSpark speculative decoding in the engine (issue 7; DSPARK.md §5–§7, SPEC.md §4.4).

Oracles: the non-speculative engine (float64 models, so greedy tokens must be identical), the target's own
greedy continuation as a perfect draft, hand arithmetic for the scheduler (DSPARK.md §5.1 and Appendix A), the
exact forward's next-token distributions (softmax + top-k + presence penalty written out here) for the sampling
tests, and hand-built scripts for the stop checks.
"""

import math

import pytest
import torch
from engine_oracles import tiny_model

from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.sampler import Sampler, SamplingState
from deepseek_v41.engine.speculative import DSparkSpeculator, schedule_verify_lengths, verify_sequence

W, K = 16, 4  # tiny config's sliding_window and dspark_block_size
COST = [1.0, 1.15, 1.3, 1.45, 1.6]  # a made-up cost curve under which the scheduler picks varied lengths


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm, prompts, params):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value of ``counts`` against ``probs`` (cells with probability 0 must be empty)."""
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep].double() * n
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# ---------------------------------------------------------------------------------------------- the scheduler
def test_scheduler_stops_before_reading_later_confidences():
    # DSPARK.md §5.1 / Appendix A: SPS(1)=1, SPS(2)=0.5, SPS(3)=0.45 -> costs 1, 2, 1/0.45; a_1 = 0.8.
    cost = [1.0, 2.0, 1 / 0.45]
    for a2 in (0.72, 0.0):  # x_1 = A gives c_2 = 0.9 (a global argmax would pick 2), x_1 = B gives c_2 = 0
        assert schedule_verify_lengths([[0.8, a2]], [2], cost) == [0]
    # Cheap verification: both levels improve Θ (1.8/1.1 > 1, 2.52/1.2 > 1.8/1.1).
    assert schedule_verify_lengths([[0.8, 0.72]], [2], [1.0, 1.1, 1.2]) == [2]


def test_scheduler_levels_of_a_padded_batch():
    # DSPARK.md §5.1's vector, with the padded forward's width R (1 + ℓ): SPS {2: 10, 4: 8, 6: 6}.
    # Θ(0) = 2 * 10 = 20, Θ(1) = (2 + 0.9 + 0.7) * 8 = 28.8, Θ(2) = (3.6 + 0.72 + 0.42) * 6 = 28.44 -> ℓ = 1.
    survival = [[0.9, 0.72], [0.7, 0.42]]
    assert schedule_verify_lengths(survival, [2, 2], [1 / 10, 1 / 8, 1 / 6]) == [1, 1]
    # A tie ends the scan (strict >): Θ(1) = Θ(0).
    assert schedule_verify_lengths([[0.5]], [1], [1.0, 1.5]) == [0]
    # Caps: a sequence that may verify fewer drafts contributes only those; its length is cut to its cap.
    assert schedule_verify_lengths([[0.9, 0.9], [0.9, 0.9]], [2, 1], [1.0, 1.0, 1.0]) == [2, 1]
    # No cost table: verify what the caps allow (the whole block).
    assert schedule_verify_lengths([[0.0, 0.0], [0.1, 0.0]], [2, 1], None) == [2, 1]


# ---------------------------------------------------------------------------------------------- verification
def test_speculative_sampling_is_lossless_for_fixed_distributions():
    """DSPARK.md §6.2 on fixed target logits (3 positions) and a draft q far from them: the first emitted token
    follows the target's processed distribution P_0, the second (when the first draft was accepted) P_1."""
    V, N = 6, 6000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=gen) * 2, -1)
    params = SamplingParams(temperature=0.9, top_k=4, seed=5, max_tokens=10)
    state = SamplingState(params, [1])
    sampler = Sampler()

    def processed(row):  # temperature, then top-k, then softmax (written out, not the sampler's code)
        x = row / 0.9
        x = x.masked_fill(x < x.topk(4).values[-1], float("-inf"))
        return torch.softmax(x, -1)

    first, second = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for _ in range(N):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        verdict = verify_sequence(sampler, logits, state, drafts, q)
        first[verdict.tokens[0]] += 1
        if len(verdict.tokens) > 1:
            second[verdict.tokens[1]] += 1
        accepted += verdict.accepted
    assert 0.1 * N < accepted < 1.5 * N  # both branches (accept, residual) really ran
    assert chi_square_p(first, processed(logits[0])) > 1e-3
    assert chi_square_p(second, processed(logits[1])) > 1e-3


# ---------------------------------------------------------------------------------------------- greedy equality
def oracle_proposer(reference: dict[tuple[int, ...], list[int]]):
    """A proposer that drafts the target's own greedy tokens (from a non-speculative run), fully confident."""

    def propose(self, seqs):
        tokens = []
        for seq in seqs:
            full = reference[tuple(seq.prompt_token_ids)]
            ahead = full[seq.num_computed + 1: seq.num_computed + 1 + K]
            tokens.append(ahead + [0] * (K - len(ahead)))
        return torch.tensor(tokens), None, torch.ones(len(seqs), K)

    return propose


def random_proposer(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def propose(self, seqs):
        B = len(seqs)
        survival = torch.rand(B, K, generator=gen).sort(-1, descending=True).values
        return torch.randint(0, 512, (B, K), generator=gen), None, survival

    return propose


def staged_prompts() -> tuple[list[list[int]], list[SamplingParams]]:
    """8 prompts (inside and beyond the window) with different max_tokens: the batch shrinks from 8 to 1."""
    lengths = [1, 3, W - 1, W, W + 1, 2 * W + 3, 3 * W + 2, 70]
    prompts = [prompt_of(n, seed=100 + n) for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=10 + 2 * i, ignore_eos=True) for i in range(8)]
    return prompts, params


@pytest.mark.parametrize("mode", ["ced", "exact"])
def test_greedy_speculation_equals_plain_decoding(model64, mode):
    """Batch sizes 8 down to 1, chunked prefill next to decodes, then prompts extending earlier ones (prefix-cache
    hits): the speculative engine emits exactly the plain engine's tokens."""
    prompts, params = staged_prompts()
    extended = [p + prompt_of(5, seed=i) for i, p in enumerate(prompts[3:])]
    common = dict(prefill_mode=mode, max_model_len=512, max_num_batched_tokens=64, replay="exact")
    plain, spec = LLM(model64, **common), LLM(model64, speculative="dspark", speculative_cost_table=COST, **common)
    outs = []
    for batch, batch_params in ((prompts, params), (extended, params[3:])):
        want = [o.outputs[0].token_ids for o in generate(plain, batch, batch_params)]
        outs += generate(spec, batch, batch_params)
        assert [o.outputs[0].token_ids for o in outs[-len(batch):]] == want
    assert any(o.num_cached_tokens > 0 for o in outs[len(prompts):])  # the second round hit the prefix cache
    stats = spec.stats
    assert stats["max_decode_batch"] == 8 and stats["kv_pages_used"] == 0
    assert len(spec.engine.cache.free_slots) == spec.engine.args.max_num_seqs
    lengths = stats["spec_decode_verify_lengths"]
    assert sum(1 for n in lengths if n) >= 3  # the scheduler chose several different lengths
    assert stats["spec_decode_num_drafts"] == sum(o.spec_verify_steps for o in outs)
    assert stats["spec_decode_num_accepted_tokens"] == sum(o.spec_accepted_tokens for o in outs)


def test_oracle_draft_is_always_accepted_at_the_full_block(model64, monkeypatch):
    prompts = [prompt_of(n, seed=200 + n) for n in (2, 9, W + 3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # 1 from the prefill, then 3 x 5
    plain = generate(LLM(model64, max_model_len=512), prompts, params)
    reference = {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)}
    monkeypatch.setattr(DSparkSpeculator, "propose", oracle_proposer(reference))
    llm = LLM(model64, max_model_len=512, speculative="dspark", speculative_cost_table=COST)
    outs = generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = llm.stats
    assert stats["spec_decode_verify_lengths"] == [0, 0, 0, 0, 3 * len(prompts)]  # the full block, every step
    assert stats["spec_decode_acceptance_per_pos"] == [1.0] * K
    assert stats["spec_decode_mean_accepted_length"] == K + 1
    assert [(o.spec_accepted_tokens, o.spec_verify_steps) for o in outs] == [(3 * K, 3)] * len(prompts)


def test_random_draft_gives_the_same_output(model64, monkeypatch):
    prompts = [prompt_of(n, seed=300 + n) for n in (4, W + 5, 40)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = generate(LLM(model64, max_model_len=512), prompts, params)
    monkeypatch.setattr(DSparkSpeculator, "propose", random_proposer(0))
    llm = LLM(model64, max_model_len=512, speculative="dspark", speculative_cost_table=COST)
    assert [o.outputs[0].token_ids for o in generate(llm, prompts, params)] == \
        [o.outputs[0].token_ids for o in plain]
    assert llm.stats["spec_decode_num_draft_tokens"] > 0


def test_settings_are_checked(model32):
    with pytest.raises(ValueError, match=r"speculative_max_len \(5\) must be in \[1, dspark_block_size \(4\)\]"):
        LLM(model32, speculative="dspark", speculative_max_len=5)
    with pytest.raises(ValueError, match="window_slack_rows >= 4"):
        LLM(model32, speculative="dspark", window_slack_rows=3, swa_pool_bytes=0)
    with pytest.raises(ValueError, match="speculative must be one of"):
        LLM(model32, speculative="eagle")
    with pytest.raises(ValueError, match=r"missing \[2\]"):
        LLM(model32, speculative="dspark", speculative_max_len=2, speculative_cost_table={0: 1.0, 1: 1.1})
    with pytest.raises(ValueError, match="has none"):
        LLM(tiny_model(torch.float32, num_nextn_predict_layers=0, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1]),
            speculative="dspark")
    adaptive = LLM(model32, max_model_len=256, speculative="dspark", speculative_max_len=3)
    assert adaptive.stats["spec_decode_cost_table"] is None and adaptive.stats["spec_decode_step_costs"] == {}
    adaptive.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    costs = adaptive.stats["spec_decode_step_costs"][1]  # measured at batch 1: a plain step, a step at ℓ = 0..3
    assert costs["plain_ms"] > 0 and len(costs["spec_ms"]) == 4 and costs["spec_ms"] == sorted(costs["spec_ms"])
    fixed = LLM(model32, max_model_len=256, speculative="dspark", speculative_cost_table="fixed")
    assert fixed.stats["spec_decode_cost_table"] is None and fixed.stats["spec_decode_step_costs"] is None


def test_lookahead_never_outruns_max_tokens(model64):
    # Near max_tokens a step verifies at most (tokens left - 1) drafts, so every step emits within the limit.
    prompts = [prompt_of(n, seed=400 + n) for n in (5, 30)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (2, 7)]
    plain = generate(LLM(model64, max_model_len=40), prompts, params)
    llm = LLM(model64, max_model_len=40, speculative="dspark", speculative_cost_table="fixed")
    outs = generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 7]


def seeded_tokens(llm, prompt, params, others=(), preempt_after=None) -> list[int]:
    """The tokens of a seeded request run with ``others`` (prompt, params) in its batch, optionally preempted
    once it has ``preempt_after`` tokens."""
    engine = llm.engine
    engine.add_request("seeded", prompt, params)
    for i, (p, other) in enumerate(others):
        engine.add_request(f"other{i}", p, other)
    seq = engine.requests["seeded"][0]
    while engine.has_unfinished_requests():
        if preempt_after is not None and len(seq.output_token_ids) >= preempt_after and not seq.finished:
            engine.scheduler.preempt(seq)
            preempt_after = None
        engine.step()
    assert preempt_after is None or params.max_tokens < preempt_after
    return list(seq.output_token_ids)


def test_seeded_sampling_with_speculation_repeats_in_any_engine_batch_or_preemption(model64):
    """Item 15 of issue 22: a seeded request gives the same tokens in fresh engines whose cost tables differ (the
    adaptive scheduler, which runs plain steps for the others, one verifying every draft, one verifying few), next
    to other requests (greedy and unseeded
    sampling ones, which change the verification lengths the batch is scheduled at) and when it is preempted
    half-way (before the fix: a different sequence in every one of these)."""
    prompt = prompt_of(20, seed=7)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    others = [(prompt_of(9, seed=8), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
              (prompt_of(33, seed=9), SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True))]

    def engine(table):
        return LLM(model64, max_model_len=128, speculative="dspark", speculative_cost_table=table)

    runs = {
        "fixed": seeded_tokens(engine("fixed"), prompt, params),
        "adaptive": seeded_tokens(engine(None), prompt, params),
        "adaptive, batch": seeded_tokens(engine(None), prompt, params, others),
        "few drafts": seeded_tokens(engine([1.0, 1.9, 2.9, 3.9, 4.9]), prompt, params),
        "batch": seeded_tokens(engine(COST), prompt, params, others),
        "preempted": seeded_tokens(engine(COST), prompt, params, others, preempt_after=11),
    }
    assert len(set(map(tuple, runs.values()))) == 1, runs
    assert len(set(runs["fixed"])) > 5  # sampled, not a repeated token


# ---------------------------------------------------------------------------------------------- sampling
def small_vocab_model():
    return tiny_model(torch.float32, vocab_size=16, dspark_noise_token_id=15, engram_compressed_vocab_size=16)


def exact_joint(model, prompt: list[int], temperature: float, top_k: int, presence: float) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] from the exact forward with the sampler's processing written out: presence
    penalty on generated tokens, temperature, top-k, softmax."""
    V = model.config.vocab_size

    def next_probs(generated: list[int]) -> torch.Tensor:
        with torch.no_grad():
            row = model(torch.tensor([prompt + generated]))[0, -1].double()
        seen = torch.zeros(V, dtype=torch.bool)
        seen[generated] = True
        x = (row - presence * seen) / temperature
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
        return torch.softmax(x, -1)

    joint = torch.zeros(V, V, V, dtype=torch.float64)
    p1 = next_probs([])
    for a in p1.nonzero()[:, 0].tolist():
        p2 = next_probs([a])
        for b in p2.nonzero()[:, 0].tolist():
            joint[a, b] = p1[a] * p2[b] * next_probs([a, b])
    return joint


def sample_counts(llm, prompt, params) -> torch.Tensor:
    V = 16
    counts = torch.zeros(V, V, V)
    for out in llm.generate({"prompt_token_ids": prompt}, params)[0].outputs:
        a, b, c = out.token_ids
        counts[a, b, c] += 1
    return counts


@pytest.mark.parametrize("samples", [pytest.param(160, id="fast"),
                                     pytest.param(2400, id="many", marks=pytest.mark.slow)])
def test_sampling_with_speculation_keeps_the_distribution(samples):
    """Tokens 2 and 3 of every sample pass through speculative verification (token 1 comes from the prefill):
    the joint of the 3 tokens matches the exact forward, with speculation on and off."""
    model = small_vocab_model()
    prompt = [3, 4, 5, 6]
    params = SamplingParams(n=samples, temperature=0.9, top_k=2, presence_penalty=0.7, max_tokens=3,
                            ignore_eos=True, seed=11)
    joint = exact_joint(model, prompt, 0.9, 2, 0.7).flatten()
    spec = LLM(model, max_model_len=64, speculative="dspark", speculative_cost_table="fixed")
    on = sample_counts(spec, prompt, params)
    assert chi_square_p(on.flatten(), joint) > 1e-3
    stats = spec.stats
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    if samples > 1000:
        off = sample_counts(LLM(model, max_model_len=64), prompt, params)
        assert chi_square_p(off.flatten(), joint) > 1e-3
        # Two-sample check: on and off agree with each other too.
        both = on + off
        stat = ((on - off) ** 2 / both.clamp(min=1)).sum()
        assert float(torch.special.gammaincc(torch.tensor((int((both > 0).sum()) - 1) / 2), stat / 2)) > 1e-3


# ---------------------------------------------------------------------------------------------- stops
def scripted_engine(model, tokenizer, script: list[int], monkeypatch) -> LLM:
    """A speculative engine whose target's greedy continuation is ``script`` and whose draft proposes it:
    after the prefill's token, each step accepts K drafts + the bonus token."""
    llm = LLM(model, tokenizer=tokenizer, max_model_len=256, speculative="dspark", speculative_cost_table="fixed")
    engine = llm.engine
    V = model.config.vocab_size

    def target(seq, position: int) -> torch.Tensor:  # logits at ``position`` favour the scripted next token
        row = torch.zeros(V, dtype=torch.float64)
        k = position + 1 - len(seq.prompt_token_ids)
        row[script[k] if k < len(script) else 1] = 10.0
        return row

    prefill, verify = engine.runner.prefill, engine.runner.verify

    def scripted_prefill(seq, start, end, taps=None):
        logits = prefill(seq, start, end, taps)
        return None if logits is None else target(seq, end - 1)

    def scripted_verify(seqs, ids, taps=None):
        logits, state = verify(seqs, ids, taps)
        rows = [[target(s, s.num_computed + t) for t in range(ids.shape[1])] for s in seqs]
        return torch.stack([torch.stack(r) for r in rows]), state

    monkeypatch.setattr(engine.runner, "prefill", scripted_prefill)
    monkeypatch.setattr(engine.runner, "verify", scripted_verify)

    def propose(self, seqs):
        out = []
        for seq in seqs:
            k = seq.num_computed + 1 - len(seq.prompt_token_ids)
            out.append([script[i] if i < len(script) else 1 for i in range(k, k + K)])
        return torch.tensor(out), None, torch.ones(len(seqs), K)

    monkeypatch.setattr(DSparkSpeculator, "propose", propose)
    return llm


@pytest.fixture(scope="module")
def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: token i is the word ``w{i}`` followed by a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}·": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0·"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Replace("·", " ")
    return tok


@pytest.mark.parametrize("case", ["split", "first"])
def test_stop_string_inside_an_accepted_block(model64, word_tokenizer, monkeypatch, case):
    """The prefill emits script[0]; the next step accepts script[1..5]. ``split``: the stop string spans
    script[2] and script[3]; ``first``: it lies inside script[1], the first of the step's accepted tokens. Text,
    token ids, logprobs and the token count (usage) all end at the stop, streamed and final."""
    script = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    stop, last = ("2 w13", 3) if case == "split" else ("11", 1)
    llm = scripted_engine(model64, word_tokenizer, script, monkeypatch)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, stop=[stop], logprobs=2)
    engine.add_request("r", [5, 6, 7], params)
    streamed_text, streamed_ids, steps = "", [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed_text += out.outputs[0].new_text
            streamed_ids += out.outputs[0].new_token_ids
            steps.append(list(out.outputs[0].new_token_ids))
    final = engine.request_output("r")
    sample = final.outputs[0]
    full_text = "".join(f"w{t} " for t in script[: last + 1])
    assert sample.text == streamed_text == full_text[: full_text.index(stop)]
    assert sample.token_ids == streamed_ids == script[: last + 1]
    assert steps[:2] == [[10], script[1: last + 1]]  # the stop came inside the first speculative step
    assert len(sample.logprobs) == len(sample.token_ids)
    assert all(tok in entry for tok, entry in zip(sample.token_ids, sample.logprobs, strict=True))
    assert math.isclose(sample.cumulative_logprob, sum(e[t].logprob for t, e in
                                                       zip(sample.token_ids, sample.logprobs, strict=True)))
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert final.spec_accepted_tokens == K and final.spec_verify_steps == 1
    assert engine.stats["kv_pages_used"] == 0
