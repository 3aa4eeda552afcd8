"""The decode plan (issue 25, deepseek_v41/kernels/fast/decode.py + csrc/decode.c) through the engine's public
surface, on the bundled checkpoint (an Engram layer, a DSpark draft): with the scheduler's features a user turns on
(a KV pool small enough to preempt and recompute, prefix caching, n > 1 with a seed at temperature 1, aborts
mid-decode, speculative decoding's plain steps with taps) an LLM whose decode steps run the plan gives the same
tokens, texts and log-probabilities, bit for bit, as the same LLM forced onto the module path
(``model.__dict__[decode._PLAN] = False``); and a batch above 16 rows (the plan's calls of 16) gives every prompt
the greedy tokens it gets decoded alone. Slow: two LLMs on one model object generating on two threads at once
give each its sequential tokens (the plan keeps its binding per KV cache). All slow (make test's budget); the fast
lockstep checks are tests/kernels/test_decode_plan.py's.

Oracles: the module path of the same checkpoint (equality), the prompt decoded alone (tokens only: above 16 rows
the LM head is a torch matmul whose rounding depends on the batch, so log-probabilities may differ there by ~1e-6).
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest

from deepseek_v41 import load_model
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.kernels.fast import decode

BUNDLED = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
# Slow tests (`make test`'s 5-minute budget): tests/kernels/test_decode_plan.py holds the fast lockstep checks.
pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1 2 3 4 5 6 7 8 9 10 11 12", "Hello", "A" * 50]


@pytest.fixture(scope="module", autouse=True)
def throwaway():
    """A first LLM of the process per dtype, run and dropped: the first fp32 one can give prefill logits 1 ulp apart
    from later ones (unrelated to the plan), so the compared engines are never the first."""
    for dtype in ("float32", "bfloat16"):
        LLM(BUNDLED, dtype=dtype).generate(["warm up"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    gc.collect()


@pytest.fixture
def plan_rows(monkeypatch, kernel_library):
    """The row counts of the decode steps the plan computed (``run_decode`` returned a result), in call order."""
    rows: list[int] = []
    real = decode.run_decode

    def spy(plan, bound, layers, streams, *args, **kwargs):
        out = real(plan, bound, layers, streams, *args, **kwargs)
        if out is not None:
            rows.append(streams.shape[0])
        return out

    monkeypatch.setattr(decode, "run_decode", spy)
    return rows


def llm(dtype: str, plan: bool, **kwargs) -> LLM:
    engine = LLM(BUNDLED, dtype=dtype, **kwargs)
    if not plan:
        engine.engine.runner.model.__dict__[decode._PLAN] = False
    return engine


def results(outputs) -> list:
    """Every completion's ids, text, finish reason and per-token log-probabilities (exact floats)."""
    out = []
    for o in outputs:
        for c in o.outputs:
            lps = [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs] if c.logprobs else None
            out.append((o.request_id, list(c.token_ids), c.text, c.finish_reason, lps))
    return out


def workload(engine: LLM) -> tuple[list, int]:
    """Preemption on a 40-page pool, n=2 seeded sampling, three aborts and a late request, stepped by hand."""
    eng = engine.engine
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=1.0, seed=1234, n=2, max_tokens=60, logprobs=2)
    stories = [f"story {i}: " + "once upon a time " * (3 + i) for i in range(6)]
    for i, prompt in enumerate(stories):
        eng.add_request(f"s{i}", engine.get_tokenizer().encode(prompt).ids, greedy)
    eng.add_request("n2", engine.get_tokenizer().encode(PROMPTS[0]).ids, seeded)
    done, step = [], 0
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
        step += 1
        if step == 10:
            eng.abort_request("s2")
        if step == 25:
            eng.abort_request("s0")
            eng.add_request("late", engine.get_tokenizer().encode(stories[0]).ids, greedy)
    return sorted(results(done)), eng.stats["num_preemptions"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_preemption_aborts_and_seeded_n2_with_the_plan_give_the_module_paths_outputs(plan_rows, dtype):
    kwargs = dict(num_kv_pages=40, block_size=16, max_model_len=512)
    got, preempted = workload(llm(dtype, True, **kwargs))
    assert plan_rows and preempted > 0
    ran = len(plan_rows)
    want, _ = workload(llm(dtype, False, **kwargs))
    assert len(plan_rows) == ran  # the module path's engine never ran the plan
    assert got == want


def test_speculative_plain_steps_with_the_plan_give_the_module_paths_outputs(plan_rows):
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=2)
    got = results(llm("float32", True, speculative="dspark").generate(PROMPTS, params, use_tqdm=False))
    assert plan_rows  # the adaptive scheduler's plain steps (with taps for the draft)
    want = results(llm("float32", False, speculative="dspark").generate(PROMPTS, params, use_tqdm=False))
    assert got == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_above_16_rows_gives_each_prompt_its_greedy_tokens_alone(plan_rows, dtype):
    engine = llm(dtype, True)
    prompts = [f"Prompt number {i}: " + "word " * (i % 7) for i in range(18)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    together = [list(o.outputs[0].token_ids) for o in engine.generate(prompts, params, use_tqdm=False)]
    assert max(plan_rows) == 18  # the plan ran the 18-row steps (calls of 16 and 2)
    alone = [list(engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    assert together == alone
    assert min(plan_rows) == 1  # and each prompt's steps alone


@pytest.mark.parametrize("plan", [True, False], ids=["plan", "module"])
def test_two_engines_on_one_model_on_two_threads_give_their_sequential_tokens(kernel_library, plan):
    model = load_model(BUNDLED).float()
    a, b = (LLM(model, tokenizer=BUNDLED, enable_prefix_caching=False) for _ in range(2))
    if not plan:
        model.__dict__[decode._PLAN] = False
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    work = {"a": (a, ["The quick brown fox " * 3, "Hello"]), "b": (b, ["Once upon a time " * 4, "1 2 3", "zzz"])}

    def tokens(name: str) -> list[list[int]]:
        engine, prompts = work[name]
        return [list(o.outputs[0].token_ids) for o in engine.generate(prompts, params, use_tqdm=False)]

    alone = {name: tokens(name) for name in work}
    together: dict[str, list] = {}
    threads = [threading.Thread(target=lambda n=name: together.__setitem__(n, tokens(n))) for name in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone

