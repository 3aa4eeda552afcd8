"""The inference engine against the exact forward (issue 4; SPEC.md §4.1, §4.2, §4.4).

Two kinds of checks. In float64 the engine and the exact forward compute the same numbers in different orders
and agree to ~1e-12, so any difference is a bug. In fp32 the project's comparison rule applies (greedy tokens
equal up to a reference near-tie; logits within 1e-4 from there).
"""

import pytest
import torch
from engine_oracles import argmax_loop, assert_comparison_rule, engine_logits

from deepseek_v41.engine import LLM, SamplingParams

W = 16  # tiny config's sliding_window
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["exact", "ced"])
@pytest.mark.parametrize("n", [1, 5, W])
def test_prompts_within_the_window_match_the_argmax_loop_fp32(model32, mode, n):
    prompt = prompt_of(n, seed=n)
    ref_tokens, ref_logits = argmax_loop(model32, prompt, 32)
    llm = LLM(model32, prefill_mode=mode, max_model_len=512)
    tokens = generate(llm, [prompt])[0]
    forced = engine_logits(LLM(model32, prefill_mode=mode, max_model_len=512).engine, prompt, ref_tokens)
    assert_comparison_rule(tokens, ref_tokens, ref_logits, lambda step: forced[step])
    # Within the window CED runs every layer over every token: the decoder saw exactly min(N, w) tokens.
    stats = llm.stats["layer_tokens"]
    assert stats[-1] == stats[0] == n + 31


@pytest.mark.parametrize("n", [W + 1, 3 * W + 5, 97])
def test_exact_prefill_equals_the_exact_forward_at_any_length(model64, n):
    prompt = prompt_of(n, seed=n)
    ref_tokens, ref_logits = argmax_loop(model64, prompt, 12)
    llm = LLM(model64, prefill_mode="exact", max_model_len=512)
    assert generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0] == ref_tokens
    forced = engine_logits(llm.engine, prompt, ref_tokens)
    assert max((a - b).abs().max().item() for a, b in zip(forced, ref_logits, strict=True)) < 1e-10


def test_ced_differs_by_a_measured_amount_and_counts_its_tokens(model64):
    n = 5 * W + 3
    prompt = prompt_of(n, seed=1)
    ref_tokens, ref_logits = argmax_loop(model64, prompt, 8)
    llm = LLM(model64, prefill_mode="ced", max_model_len=512)
    forced = engine_logits(llm.engine, prompt, ref_tokens)
    delta = max((a - b).abs().max().item() for a, b in zip(forced, ref_logits, strict=True))
    assert delta > 1e-6  # the decoder's windows before N - w are really missing
    counts = llm.stats["layer_tokens"]
    plan = model64.plan
    assert all(counts[j] == n + 7 for j in plan.encoder_layers)
    assert all(counts[j] == W + 7 for j in plan.decoder_layers)  # min(N, w) prompt tokens, then 7 decodes


@pytest.mark.parametrize("mode", ["exact", "ced"])
@pytest.mark.parametrize("chunk", [1, 7, 64, pytest.param(4097, marks=pytest.mark.slow)])
def test_chunked_prefill_equals_unchunked(model64, mode, chunk):
    # Edges fall inside ratio-2 pairs (odd chunks) and inside candidate blocks of 4 entries.
    n = 4101 if chunk == 4097 else 203
    prompt = prompt_of(n, seed=2)
    whole = engine_logits(LLM(model64, prefill_mode=mode, max_model_len=8192,
                              max_num_batched_tokens=8192).engine, prompt, prompt_of(4, seed=3))
    parts = engine_logits(LLM(model64, prefill_mode=mode, max_model_len=8192,
                              max_num_batched_tokens=chunk).engine, prompt, prompt_of(4, seed=3))
    assert max((a - b).abs().max().item() for a, b in zip(whole, parts, strict=True)) < 1e-10


LENGTHS = [1, 2, 3, 9, W - 1, W, W + 1, 4 * W + 3]


@pytest.mark.parametrize("mode", ["exact", "ced"])
def test_batch_invariance(model64, mode):
    prompts = [prompt_of(n, seed=10 + n) for n in LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [generate(LLM(model64, prefill_mode=mode, max_model_len=512), [p], params)[0] for p in prompts]
    llm = LLM(model64, prefill_mode=mode, max_model_len=512)
    assert generate(llm, prompts, params) == alone
    assert llm.stats["max_decode_batch"] == len(prompts)  # they really decoded together
    # Requests joining mid-decode: start half, step a few times, then add the rest.
    joined = LLM(model64, prefill_mode=mode, max_model_len=512)
    engine = joined.engine
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, params)
    for _ in range(5):
        engine.step()
    for i, p in enumerate(prompts[4:], 4):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert [engine.request_output(str(i)).outputs[0].token_ids for i in range(len(prompts))] == alone
    assert joined.stats["max_decode_batch"] > 4


def test_seeded_sampling_is_batch_invariant(model32):
    prompts = [prompt_of(n, seed=20 + n) for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    alone = [generate(LLM(model32, max_model_len=512), [p], params)[0] for p in prompts]
    assert generate(LLM(model32, max_model_len=512), prompts, params) == alone


def test_preemption_by_recompute_gives_the_same_tokens(model64):
    prompts = [prompt_of(n, seed=30 + n) for n in (40, 50, 60)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for mode in ("exact", "ced"):
        roomy = generate(LLM(model64, prefill_mode=mode, max_model_len=512), prompts, params)
        tight = LLM(model64, prefill_mode=mode, max_model_len=160, num_kv_pages=10)  # 10 pages: 160 tokens
        assert generate(tight, prompts, params) == roomy
        assert tight.stats["num_preemptions"] > 0
        assert tight.stats["kv_pages_used"] == 0


def test_step_outputs_carry_the_prompt_and_a_user_editing_it_changes_nothing(model32):
    """Every step's RequestOutput gives the prompt's token ids: one list per request, made at arrival and shared
    by its outputs (as vLLM's are). A user editing that list changes neither the engine's copy nor the tokens
    generated."""
    prompt = prompt_of(20, seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = LLM(model32, max_model_len=128).engine
    tokens = {}
    for edit in (False, True):
        engine.add_request(f"r{edit}", list(prompt), params)
        outs = []
        while engine.has_unfinished_requests():
            out = engine.step()[0]
            assert edit or out.prompt_token_ids == prompt
            if edit:
                out.prompt_token_ids[:] = [3] * 20
            outs.append(out)
        assert engine.requests[f"r{edit}"][0].prompt_token_ids == prompt
        assert all(o.prompt_token_ids is outs[0].prompt_token_ids for o in outs)
        tokens[edit] = [o.outputs[0].token_ids for o in outs]
    assert tokens[True] == tokens[False]


def test_pages_return_to_the_pool_and_limits_are_enforced(model32):
    llm = LLM(model32, max_model_len=64)
    generate(llm, [prompt_of(30), prompt_of(9)], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert llm.stats["kv_pages_used"] == 0 and len(llm.engine.cache.free_slots) == llm.engine.args.max_num_seqs
    with pytest.raises(ValueError, match="the prompt has 64 tokens, but max_model_len is 64"):
        llm.generate({"prompt_token_ids": prompt_of(64)})
    out = llm.generate({"prompt_token_ids": prompt_of(60)}, SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt token ids must be in"):
        llm.generate({"prompt_token_ids": [600]})


def test_stats_report_cache_bytes(model32):
    stats = LLM(model32, max_model_len=512).stats
    cfg = model32.config
    # tiny: kv sources layer 2 (m=2) and layer 4 (m=1); entries of 32 dims: 16 + 2 main, 16 + 1 index bytes.
    assert stats["kv_allocated_bytes_per_token"] == pytest.approx((18 + 17) / 2 + (18 + 17))
    assert stats["window_bytes_per_sequence_logical"] == cfg.num_hidden_layers * W * (32 + 1)


def test_nan_free_cache_for_short_prompts(model32):
    from deepseek_v41.quant import dequantize_fp4, dequantize_fp8

    llm = LLM(model32, max_model_len=64)
    engine = llm.engine
    for n in range(1, 10):
        engine.add_request(str(n), prompt_of(n, seed=n), SamplingParams(temperature=0, max_tokens=1))
    plan = engine.scheduler.schedule()
    for seq, start, end in plan.prefills:
        engine.runner.prefill(seq, start, end)
    cache = engine.cache
    window = dequantize_fp8(cache.window_codes, cache.window_scales, 32, "ue8m0")
    assert torch.isfinite(window).all()
    for codes, scales, icodes, iscales in cache.pools.values():
        assert torch.isfinite(dequantize_fp4(codes, scales, 16, "e4m3")).all()
        assert torch.isfinite(dequantize_fp4(icodes, iscales, 32, "ue8m0")).all()


def _prefilled(model, prompt):
    """An engine whose only sequence has its prompt prefilled (exact mode), and that sequence."""
    llm = LLM(model, prefill_mode="exact", max_model_len=512)
    engine = llm.engine
    engine.add_request("poke", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seq = engine.requests["poke"][0]
    (s, start, end), = engine.scheduler.schedule().prefills
    engine.runner.prefill(s, start, end)
    seq.num_computed = end
    seq.detokenizer.output_token_ids.append(7)
    engine.scheduler.blocks.grow(seq.block_table, end + 1)
    return engine, seq


@pytest.mark.parametrize("where", ["main entry", "window row"])
def test_one_stored_byte_changes_the_logits(model32, where):
    # 12 tokens: layer 2 (ratio 2) has 6 entries, fewer than index_topk 8, so all of them are attended.
    prompt = prompt_of(12, seed=5)
    clean, seq = _prefilled(model32, prompt)
    poked, seq2 = _prefilled(model32, prompt)
    if where == "main entry":
        codes = poked.cache.pools[2][0]  # layer 2's main-entry codes [pages, entries, bytes]
        codes[seq2.block_table[0], 1, 0] ^= 0x77
    else:
        codes = poked.cache.window_codes  # [slots, layers, rows, bytes]
        codes[seq2.slot, 0, 11 % poked.cache.window_rows, 3] ^= 0x11
    control, seq3 = _prefilled(model32, prompt)
    control.cache.window_codes[seq3.slot + 1, 0, 3, 3] ^= 0x11  # another slot's ring: not read by this sequence
    a = clean.runner.decode([seq])[0]
    b = poked.runner.decode([seq2])[0]
    assert (a - b).abs().max() > 1e-6
    assert torch.equal(control.runner.decode([seq3])[0], a)


def test_few_token_kernels_turn_onednn_off_for_bf16_cpu_only():
    """bf16 decode / verify run ATen's GEMM (oneDNN's costs ~50 µs per small call on CPU); the flag comes back."""
    import torch

    from deepseek_v41.engine.model_runner import few_token_kernels

    before = torch.backends.mkldnn.enabled
    with few_token_kernels(torch.bfloat16, torch.device("cpu")):
        assert torch.backends.mkldnn.enabled is False
    assert torch.backends.mkldnn.enabled == before
    for dtype in (torch.float32, torch.float64):
        with few_token_kernels(dtype, torch.device("cpu")):
            assert torch.backends.mkldnn.enabled == before
    try:
        with few_token_kernels(torch.bfloat16, torch.device("cpu")):
            raise KeyError("boom")
    except KeyError:
        pass
    assert torch.backends.mkldnn.enabled == before
    # Overlapping forwards (two engines on two threads): the flag comes back when the last one leaves.
    cpu = torch.device("cpu")
    first, second = few_token_kernels(torch.bfloat16, cpu), few_token_kernels(torch.bfloat16, cpu)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert torch.backends.mkldnn.enabled is False
    second.__exit__(None, None, None)
    assert torch.backends.mkldnn.enabled == before


@pytest.fixture
def two_torch_threads(monkeypatch):
    """Torch at two intra-op threads (any machine takes that) with the fused kernels built, and engine steps that
    see a quiet machine (their thread count is not lowered for the other processes on this one:
    tests/engine/test_step_threads.py); afterwards torch's count and the kernels' one thread come back. Without the
    kernels the test skips, but fails under CI=true."""
    import os

    from deepseek_v41 import kernels
    from deepseek_v41.kernels import cpu_share

    monkeypatch.setattr(cpu_share.SHARE, "threads", lambda ceiling: ceiling)

    if kernels.library() is None:
        message = "the fused CPU kernels could not be built or were turned off (DSV41_CPU_KERNELS=0)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must build them")
        pytest.skip(message)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)
    kernels.set_threads(1)


def test_few_token_kernels_hand_torchs_threads_to_the_kernels_on_cpu_only(two_torch_threads):
    """Inside, torch runs one thread and the kernels' pool the count torch had; the last one out restores torch's
    count (nested or overlapping forwards, an exception); another device changes nothing."""
    from deepseek_v41 import kernels
    from deepseek_v41.engine.model_runner import POOL_SPIN, few_token_kernels

    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert kernels.set_threads(1) == 1
        with few_token_kernels(dtype, cpu):
            assert torch.get_num_threads() == 1 and kernels.threads() == two_torch_threads
            assert kernels.spin() == POOL_SPIN > 0  # the workers wait for the next kernel spinning
        assert torch.get_num_threads() == two_torch_threads
    torch.set_num_threads(3)
    with few_token_kernels(torch.float32, cpu):
        assert torch.get_num_threads() == 1 and kernels.threads() == 3
        with few_token_kernels(torch.bfloat16, cpu):  # nested: torch's 1 is not taken for its count
            assert torch.get_num_threads() == 1 and kernels.threads() == 3
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3
    first, second = few_token_kernels(torch.float32, cpu), few_token_kernels(torch.float32, cpu)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # overlapping, not nested (two engines on two threads)
    assert torch.get_num_threads() == 1
    second.__exit__(None, None, None)
    assert torch.get_num_threads() == 3
    with pytest.raises(KeyError), few_token_kernels(torch.float32, cpu):
        raise KeyError("boom")
    assert torch.get_num_threads() == 3
    assert kernels.set_threads(1) == 1
    onednn = torch.backends.mkldnn.enabled
    with few_token_kernels(torch.bfloat16, torch.device("meta")):
        assert torch.get_num_threads() == 3 and kernels.threads() == 1 and torch.backends.mkldnn.enabled == onednn
    assert torch.get_num_threads() == 3 and kernels.threads() == 1


def test_a_decode_only_step_runs_on_the_kernels_threads_and_gives_torchs_back(model32, two_torch_threads):
    """An engine step without prefills runs under few_token_kernels as a whole (torch at one thread before the
    runner's decode is entered); a step with a prefill leaves torch's threads alone; after every step torch has
    its count again."""
    from deepseek_v41 import kernels

    engine = LLM(model32, max_model_len=256).engine
    seen = []

    def spy(name, fn):
        def run(*args, **kwargs):
            seen.append((name, torch.get_num_threads(), kernels.threads()))
            return fn(*args, **kwargs)
        return run

    engine.runner.prefill = spy("prefill", engine.runner.prefill)
    engine.runner.decode = spy("decode", engine.runner.decode)
    engine.add_request("a", prompt_of(5, seed=9), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert kernels.set_threads(1) == 1
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert torch.get_num_threads() == two_torch_threads
    assert steps == 3 and len(engine.request_output("a").outputs[0].token_ids) == 3
    assert seen[0] == ("prefill", two_torch_threads, 1)
    assert seen[1:] == [("decode", 1, two_torch_threads)] * 2


def test_pool_workers_spin_after_a_decode_step_and_sleep_during_a_prefill(model32, two_torch_threads):
    """A decode step leaves the kernels' pool workers spinning for the next step's kernels (POOL_SPIN); a prefill
    chunk sets their spin to 0 first, so that they do not spin on the cores torch's own threads run its matmuls
    on (a prefill right after decode steps took ~1.3x as long before)."""
    from deepseek_v41 import kernels
    from deepseek_v41.engine.model_runner import POOL_SPIN

    engine = LLM(model32, max_model_len=256).engine
    spins = []
    prefill = engine.runner.prefill

    def spy(*args, **kwargs):
        out = prefill(*args, **kwargs)
        spins.append(("prefill", kernels.spin()))
        return out

    engine.runner.prefill = spy
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", prompt_of(5, seed=9), params)
    for _ in range(3):
        engine.step()
        spins.append(("step", kernels.spin()))
    engine.add_request("b", prompt_of(7, seed=10), params)
    engine.step()
    spins.append(("step", kernels.spin()))
    assert spins == [("prefill", 0.0), ("step", 0.0), ("step", POOL_SPIN), ("step", POOL_SPIN), ("prefill", 0.0),
                     ("step", 0.0)]


def test_few_token_kernels_restore_each_threads_own_torch_count(two_torch_threads):
    """torch's thread count belongs to the calling thread: two threads whose few-token forwards overlap (A in, B
    in, A out, B out) each get their own count back."""
    import threading

    from deepseek_v41.engine.model_runner import few_token_kernels

    cpu = torch.device("cpu")
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    after, errors = {}, []

    def run(name, counts, enter_after, signal_in, exit_after, signal_out):
        try:
            # A thread's first query sets its count from the last one any thread set (ATen's lazy per-thread
            # OpenMP init): make it before setting this thread's own, which it would otherwise overwrite.
            torch.get_num_threads()
            torch.set_num_threads(counts)
            if enter_after is not None:
                assert enter_after.wait(10)
            with few_token_kernels(torch.float32, cpu):
                assert torch.get_num_threads() == 1
                signal_in.set()
                if exit_after is not None:
                    assert exit_after.wait(10)
            if signal_out is not None:
                signal_out.set()
            after[name] = torch.get_num_threads()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            for event in (a_in, b_in, a_out):
                event.set()

    a = threading.Thread(target=run, args=("A", 2, None, a_in, b_in, a_out))
    b = threading.Thread(target=run, args=("B", 3, a_in, b_in, a_out, None))
    a.start(), b.start()
    a.join(30), b.join(30)
    assert not errors and after == {"A": 2, "B": 3}
