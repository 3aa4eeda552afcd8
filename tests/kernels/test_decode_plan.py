"""The decode plan (issue 25, deepseek_v41/kernels/fast/decode.py + csrc/decode.c): a one-token-per-row decode step's
layers in one C call must give the module path's results bit for bit (logits, log-probabilities, tokens) and write
the same KV cache state, Engram layers included (their modules run in Python between the C calls); hooks,
plan-incompatible experts and the kernels turned off run the module path;
a kernel that declines inside the call leaves the pending pairs as they were and the module path reruns the step;
the ctypes mirrors of the C structs have the C layout.

The oracle is the module path of the same model (``model.__dict__[decode._PLAN] = False``), built from the same
seed, stepped in lockstep with the plan's engine; the reference torch code (``kernels.disabled()``) to rounding.
"""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import subprocess

import pytest
import torch
from kernel_cases import fp4_exact

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.kernels.fast import decode
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.plan import LayerRole

STATE = ("window_codes", "window_scales", "window_pos", "pending")  # PagedKVCache tensors a decode step writes
LENGTHS = {"one": (29,), "batch": (29, 17, 8, 22)}  # prompt lengths (tiny: window 16, index_topk 8, pool 3 x 4)


def tiny(dtype: torch.dtype, experts: str = "fp4", engram: bool = False, seed: int = 0, cfg=None) -> Transformer:
    """The tiny config (every layer role; no Engram unless ``engram``) from ``seed``; routed experts ``"fp4"``
    (FP4-exact: the FP4 kernel), ``"plain"`` (random: bf16 copies in a bf16 model, none in fp32) or ``"mixed"``
    (FP4-exact but one expert of layer 3: copies of some experts only). ``cfg`` replaces the tiny config."""
    cfg = cfg or tiny_config().replace(max_position_embeddings=8192)
    if not engram and cfg.engram_layer_ids:
        cfg = cfg.replace(engram_layer_ids=[], engram_num_embeddings=[])
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            odd_one = experts == "mixed" and name.startswith("layers.3.ffn.experts.5.")
            if ".ffn.experts." in name and experts != "plain" and not odd_one:
                p.copy_(fp4_exact(p))
    return model.to(dtype)


class Run:
    """An engine (prefix caching off) over ``model``, stepped by hand, recording each forward's logits; ``plan``
    False forces the module path on this model."""

    def __init__(self, model: Transformer, plan: bool = True, max_model_len: int = 256):
        self.model, self.logits, self.last, self.open_pairs = model, [], {}, 0
        self.llm = LLM(model, max_model_len=max_model_len, enable_prefix_caching=False)
        self.engine, self.cache = self.llm.engine, self.llm.engine.cache
        if not plan:
            model.__dict__[decode._PLAN] = False
        reference = model.logits

        def spy(streams, pre):
            out = reference(streams, pre)
            self.logits.append(out.clone())
            return out

        model.logits = spy

    def add(self, prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
        for i, ids in enumerate(prompts):
            self.engine.add_request(str(i), ids, params)

    def step(self) -> None:
        for out in self.engine.step():
            self.last[out.request_id] = out

    def results(self) -> tuple[list[list[int]], list[list[dict]]]:
        outs = [self.last[k].outputs[0] for k in sorted(self.last, key=int)]
        return [o.token_ids for o in outs], [[{t: lp.logprob for t, lp in s.items()} for s in o.logprobs]
                                             for o in outs]


def prompts(lengths: tuple[int, ...], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def assert_same_state(a: Run, b: Run) -> None:
    for name in STATE:
        assert torch.equal(getattr(a.cache, name), getattr(b.cache, name)), name
    for layer, pools in a.cache.pools.items():
        for i, (x, y) in enumerate(zip(pools, b.cache.pools[layer], strict=True)):
            assert torch.equal(x, y), (layer, i)


@pytest.fixture(scope="module", autouse=True)
def throwaway():
    """A first LLM of the process, run and dropped: the first fp32 one can give prefill logits 1 ulp apart from
    later ones (unrelated to the plan), so the compared engines are never the first."""
    LLM(tiny(torch.float32), max_model_len=64, enable_prefix_caching=False).generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))


@pytest.fixture
def plan_runs(monkeypatch):
    """Counts of :func:`decode.run_decode`'s results: ``ran`` (the plan computed the step), ``declined`` (None)."""
    counts = {"ran": 0, "declined": 0}
    real = decode.run_decode

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        counts["ran" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(decode, "run_decode", spy)
    return counts


def lockstep(a: Run, b: Run, steps: int | None = None) -> int:
    """Step both engines together (``steps`` steps, or until done), checking after each step that they hold the
    same cache state and produced the same logits so far; returns the steps run."""
    n = 0
    while a.engine.has_unfinished_requests() and (steps is None or n < steps):
        a.step()
        b.step()
        n += 1
        assert b.engine.has_unfinished_requests() == a.engine.has_unfinished_requests()
        assert len(a.logits) == len(b.logits)
        for x, y in zip(a.logits, b.logits, strict=True):
            assert torch.equal(x, y)
        assert_same_state(a, b)
        a.open_pairs += bool(a.cache.pending.abs().sum() > 0)
    return n


# ------------------------------------------------------------------------------------- the plan = the module path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", ["one", "batch"])
def test_decode_plan_gives_the_module_paths_tokens_logprobs_and_cache_state(plan_runs, dtype, batch):
    """Greedy decode with the plan and with the module path on two copies of one model, in lockstep: every
    forward's logits, the tokens and log-probabilities, and after every step the window rings, pending pairs and
    FP4 pools, equal bit for bit. The contexts pass index_topk (8) and the candidate pool (3 blocks of 4), so the
    Full, Reindex (pool_select) and Reuse layers all run, and the rows' positions open and complete ratio-2 pairs
    (rows of a batch at different parities)."""
    experts = "fp4" if dtype == torch.float32 else "plain"
    a, b = Run(tiny(dtype, experts)), Run(tiny(dtype, experts), plan=False)
    lengths, max_tokens = LENGTHS[batch], 10
    for run in (a, b):
        run.add(prompts(lengths), max_tokens)
    lockstep(a, b)
    tokens, logprobs = a.results()
    assert (tokens, logprobs) == b.results()
    assert all(len(t) == max_tokens for t in tokens)
    plan = decode.decode_plan(a.model)
    assert plan is not None and decode.decode_plan(b.model) is None
    assert {L.moe_kind for L in plan.layers} == {2 if experts == "fp4" else 1}
    assert plan_runs["declined"] == 0 and plan_runs["ran"] >= max_tokens - 1
    cfg = a.model.config
    longest = max(lengths) + max_tokens - 1
    assert longest > cfg.index_topk and longest > cfg.candidate_topk_blocks * cfg.candidate_block_size
    assert 0 < a.open_pairs < len(a.logits)  # steps that ended with a ratio-2 pair open, and steps without
    if batch == "batch":  # a row below the candidate pool's size at first: the Full branch for it, then Reindex
        assert min(lengths) < cfg.candidate_topk_blocks * cfg.candidate_block_size


@pytest.mark.slow
def test_decode_plan_equals_the_module_path_on_the_bench_model_past_its_candidate_pool(plan_runs):
    """bench-8m (bench/engine.py: index_topk 64, candidate pool 32 blocks of 8, window 128), FP4 experts, two rows
    whose contexts pass 256 entries during the decode (the Reindex layer's pool_select), in lockstep with the
    module path: the same logits and cache state after every step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from engine import bench_config

    cfg = bench_config().replace(quantization_config=None)
    a = Run(tiny(torch.float32, cfg=cfg), max_model_len=512)
    b = Run(tiny(torch.float32, cfg=cfg), plan=False, max_model_len=512)
    for run in (a, b):
        run.add(prompts((253, 190)), 6)
    lockstep(a, b)
    assert a.results() == b.results() and plan_runs["ran"] >= 5 and plan_runs["declined"] == 0
    assert 253 + 5 > cfg.candidate_topk_blocks * cfg.candidate_block_size > 253


def with_taps(run: Run) -> list[dict[int, torch.Tensor]]:
    """Make ``run``'s decode steps ask for taps (as a speculative engine's plain steps do); returns the list that
    receives each step's taps (copies)."""
    tapped = []
    decode_step = run.engine.runner.decode

    def decode_with_taps(seqs, taps=None):
        got = {}
        out = decode_step(seqs, got)
        tapped.append({j: t.clone() for j, t in got.items()})
        return out

    run.engine.runner.decode = decode_with_taps
    return tapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_plan_taps_equal_the_module_paths_layer_inputs(plan_runs, dtype):
    """A decode step asked for taps (a speculative engine's plain step: DSpark's target features) runs the plan and
    hands each layer's input streams [B, 1, hc, D], equal bit for bit to the module path's (four rows). With
    twenty rows (two calls of at most FEW_ROWS rows; the module path would run the torch code there) the taps
    change nothing: the logits equal those of the plan without taps, and every layer's tap has every row."""
    experts = "fp4" if dtype == torch.float32 else "plain"
    a, b = Run(tiny(dtype, experts)), Run(tiny(dtype, experts), plan=False)
    taps = {id(a): with_taps(a), id(b): with_taps(b)}
    for run in (a, b):
        run.add(prompts(LENGTHS["batch"]), 6)
    lockstep(a, b)
    assert a.results() == b.results() and plan_runs["ran"] >= 5 and plan_runs["declined"] == 0
    assert len(taps[id(a)]) == len(taps[id(b)]) == 5
    for x, y in zip(taps[id(a)], taps[id(b)], strict=True):
        assert sorted(x) == sorted(y) == list(range(len(a.model.layers)))
        assert all(torch.equal(x[j], y[j]) for j in x)
    a, c = Run(tiny(dtype, experts), max_model_len=64), Run(tiny(dtype, experts), max_model_len=64)
    tapped = with_taps(a)
    lengths = tuple(5 + 2 * i for i in range(20))
    for run in (a, c):
        run.add(prompts(lengths), 4)
    ran = plan_runs["ran"]
    lockstep(a, c)
    assert a.results() == c.results() and plan_runs["ran"] == ran + 2 * 3
    assert len(tapped) == 3 and all(t.shape[0] == 20 for step in tapped for t in step.values())


# ------------------------------------------------------------------------------------------------- the fallbacks
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "after_clearing"])
def test_a_hook_on_a_watched_module_runs_the_module_path_until_removed(plan_runs, kind):
    """A forward (pre-)hook on one block's attention or router (registered after the plan is built; also after
    the hooks were cleared by assigning a new dict, which a break-it pass found the plan missing) makes every step
    take the module path (the hook sees every step); removed, the plan runs again. Results equal the module
    path's."""
    a, b = Run(tiny(torch.float32)), Run(tiny(torch.float32), plan=False)
    for run in (a, b):
        run.add(prompts((21, 14)), 12)
    lockstep(a, b, 3)  # prefill + decode steps: the plan is built and ran
    ran = plan_runs["ran"]
    assert ran > 0
    seen = []
    if kind == "after_clearing":
        a.model.layers[3].attn._forward_hooks = collections.OrderedDict()
    if kind in ("forward", "after_clearing"):
        handle = a.model.layers[3].attn.register_forward_hook(lambda m, i, o: seen.append(1))
    else:
        handle = a.model.layers[1].ffn.gate.register_forward_pre_hook(lambda m, i: seen.append(1))
    lockstep(a, b, 4)
    assert plan_runs["ran"] == ran and len(seen) == 4
    handle.remove()
    lockstep(a, b)
    assert plan_runs["ran"] > ran and len(seen) == 4 and plan_runs["declined"] == 0
    assert a.results() == b.results()


@pytest.mark.parametrize("where", ["attn_norm", "ffn_norm"])
def test_a_hooked_norm_runs_the_module_path_at_build_and_agrees_with_it_after(plan_runs, where):
    """A forward hook on a block's norm before the engine installs the fast paths: no plan (the block forward
    keeps its norms as modules) and the hook sees every step. Registered after (not detected: see
    ``fast.still_valid``), the plan does what the module path does: the same hook calls, the same results."""
    seen = {"before": 0, "a": 0, "b": 0}

    def hook(name):
        def fn(module, inputs, output):
            seen[name] += 1
            return output * 1.5
        return fn

    model = tiny(torch.float32)
    getattr(model.layers[5], where).register_forward_hook(hook("before"))
    hooked_run = Run(model)
    hooked_run.add(prompts((21,)), 5)
    while hooked_run.engine.has_unfinished_requests():
        hooked_run.step()
    assert decode.decode_plan(model) is None and plan_runs["ran"] == 0 and seen["before"] == 5
    a, b = Run(tiny(torch.float32)), Run(tiny(torch.float32), plan=False)
    for run in (a, b):
        run.add(prompts((21,)), 8)
    lockstep(a, b, 3)
    getattr(a.model.layers[5], where).register_forward_hook(hook("a"))
    getattr(b.model.layers[5], where).register_forward_hook(hook("b"))
    lockstep(a, b)
    assert seen["a"] == seen["b"] and plan_runs["ran"] >= 7 and a.results() == b.results()


def test_a_global_module_hook_suspends_the_plan_with_the_fast_paths(plan_runs):
    """A global forward hook (the engine uninstalls the fast backend before the step) stops the plan; removed,
    the fast paths and the plan come back."""
    a, b = Run(tiny(torch.float32)), Run(tiny(torch.float32), plan=False)
    for run in (a, b):
        run.add(prompts((19,)), 10)
    lockstep(a, b, 3)
    ran = plan_runs["ran"]
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        lockstep(a, b, 3)
        assert plan_runs["ran"] == ran
    finally:
        handle.remove()
    lockstep(a, b)
    assert plan_runs["ran"] > ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_plan_with_engram_layers_equals_the_module_path(plan_runs, dtype):
    """Engram layers (the tiny config's): the plan runs the layers between them in C and each Engram module in
    Python on the call's rows; logits, tokens, log-probabilities and cache state equal the module path's in
    lockstep (four rows: one call per run of layers)."""
    experts = "fp4" if dtype == torch.float32 else "plain"
    a = Run(tiny(dtype, experts, engram=True))
    b = Run(tiny(dtype, experts, engram=True), plan=False)
    assert any(block.engram is not None for block in a.model.layers)
    for run in (a, b):
        run.add(prompts(LENGTHS["batch"]), 8)
    lockstep(a, b)
    assert a.results() == b.results()
    assert plan_runs["ran"] >= 7 and plan_runs["declined"] == 0


@pytest.mark.parametrize("case", ["mixed experts", "plain fp32 experts"])
def test_decode_plan_is_none_for_a_model_it_cannot_serve(plan_runs, case):
    """Routed experts only some of which have exact copies, or fp32 experts with no exact copy: no plan (the
    module path runs every step, and the engine still decodes)."""
    model = {"mixed experts": lambda: tiny(torch.float32, "mixed"),
             "plain fp32 experts": lambda: tiny(torch.float32, "plain")}[case]()
    run = Run(model)
    run.add(prompts((15,)), 4)
    while run.engine.has_unfinished_requests():
        run.step()
    assert decode.decode_plan(model) is None
    assert plan_runs == {"ran": 0, "declined": 0}
    assert len(run.results()[0][0]) == 4


def test_with_the_kernels_disabled_no_plan_runs_and_results_match_to_rounding(plan_runs):
    """``kernels.disabled()`` (as DSV41_CPU_KERNELS=0): nothing is installed, the plan never runs, and the
    reference torch code gives the plan's greedy tokens and log-probabilities to rounding (fp32)."""
    a = Run(tiny(torch.float32))
    a.add(prompts((29, 11)), 8)
    while a.engine.has_unfinished_requests():
        a.step()
    ran = plan_runs["ran"]
    assert ran > 0
    with kernels.disabled():
        b = Run(tiny(torch.float32))
        b.add(prompts((29, 11)), 8)
        while b.engine.has_unfinished_requests():
            b.step()
    assert plan_runs["ran"] == ran
    (tokens, logprobs), (want_tokens, want_logprobs) = a.results(), b.results()
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys()
            torch.testing.assert_close(torch.tensor(list(g.values())), torch.tensor([w[t] for t in g]),
                                       rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------- a declined step
def test_a_kernel_declining_inside_the_call_restores_the_pending_pairs_and_the_module_path_reruns(plan_runs,
                                                                                                  monkeypatch):
    """NaN index keys (every index-key scale of the candidate source's pool set to 0xFF, the UE8M0 NaN) make the
    indexer's kernels decline inside ``dsv41_decode_layers``: it returns 1 with the ratio-2 pending pairs exactly
    as before the call, run_decode returns None, and the module path reruns the step: its results and cache
    state equal a module-path engine's given the same NaN keys."""
    a, b = Run(tiny(torch.float32)), Run(tiny(torch.float32), plan=False)
    for run in (a, b):
        run.add(prompts((25, 16)), 10)
    lockstep(a, b, 3)
    assert plan_runs["ran"] > 0 and plan_runs["declined"] == 0
    source = a.model.config.candidate_source_layer_id
    for run in (a, b):
        run.cache.pools[source][3].fill_(0xFF)
    lib = kernels.library()
    real = lib.dsv41_decode_layers
    calls = []

    def spy(layers, first, last, step):
        before = a.cache.pending.clone()
        status = real(layers, first, last, step)
        calls.append((status, torch.equal(a.cache.pending, before)))
        return status

    monkeypatch.setattr(lib, "dsv41_decode_layers", spy)
    changed = []
    while a.engine.has_unfinished_requests():
        before = a.cache.pending.clone()
        lockstep(a, b, 1)
        changed.append(not torch.equal(a.cache.pending, before))
    assert calls and all(status == 1 and same for status, same in calls), calls
    assert plan_runs["declined"] == len(calls)
    assert any(changed)  # the module path's rerun moved the pairs the declined call had restored
    assert a.results() == b.results()


# ----------------------------------------------------------------------------------------------- the ctypes mirror
def test_the_ctypes_structs_have_the_c_structs_layout(tmp_path):
    """``decode._Layer`` / ``decode._Step`` mirror ``dsv41_decode_layer`` / ``dsv41_decode_step`` of csrc/dsv41.h
    field by field: a C program built here prints each struct's size and every field's offset and size."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no C compiler: CI must check the struct layouts")
        pytest.skip("no C compiler")
    csrc = os.path.join(os.path.dirname(kernels.__file__), "csrc")
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "dsv41.h"', "int main(void) {"]
    for struct, c_name in ((decode._Layer, "dsv41_decode_layer"), (decode._Step, "dsv41_decode_step")):
        lines.append(f'printf("{struct.__name__} . %zu\\n", sizeof({c_name}));')
        for name, _ in struct._fields_:
            lines.append(f'printf("{struct.__name__} {name} %zu %zu\\n", offsetof({c_name}, {name}), '
                         f"sizeof((({c_name} *)0)->{name}));")
    lines.append("return 0; }")
    (tmp_path / "layout.c").write_text("\n".join(lines))
    exe = tmp_path / "layout"
    built = subprocess.run([cc, "-O0", "-mavx2", "-mfma", "-I", csrc, str(tmp_path / "layout.c"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr[-2000:]
    printed = subprocess.run([str(exe)], capture_output=True, text=True, timeout=10, check=True).stdout.split("\n")
    want = {}
    for line in filter(None, printed):
        struct, field, *numbers = line.split()
        want[struct, field] = tuple(int(n) for n in numbers)
    for struct in (decode._Layer, decode._Step):
        assert want[struct.__name__, "."] == (ctypes.sizeof(struct),), struct.__name__
        for name, kind in struct._fields_:
            field = getattr(struct, name)
            assert want[struct.__name__, name] == (field.offset, ctypes.sizeof(kind)), (struct.__name__, name)


def test_the_phase_tables_hold_rope_phases_bit_for_bit():
    """The decode plan's RoPE phases by position (``decode._phases``: rows of a table ``rope.phases`` computed once)
    equal ``rope.phases`` of the step's positions bit for bit, for any batch, position -1 (a ratio-2 pair's), a
    table grown past its first size; past PHASE_TABLE_BYTES they are ``rope.phases`` itself."""
    model = tiny(torch.float32)
    from deepseek_v41.kernels import fast

    fast.install(model)
    plan = decode.decode_plan(model)
    assert plan is not None and plan.ropes
    gen = torch.Generator().manual_seed(0)
    for i, rope in enumerate(plan.ropes):
        for high in (5, 900, 3000, 8192):  # the table grows on the way
            for batch in (1, 3, 8, 16):
                pos = torch.randint(-1, high, (batch, 1), generator=gen)
                pos[0, 0] = high - 1
                for p in (pos, torch.cat((pos - 1, pos), 1).clamp_min(-1)):
                    got, want = decode._phases(plan, i, rope, p, high), rope.phases(p)
                    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (i, high, batch)
        assert plan.phase_tables[i][0].shape[0] > 8192
    rows = decode.PHASE_TABLE_BYTES // (plan.ropes[0].rope_dim * 8) + 10
    pos = torch.tensor([[rows]])
    plan.phase_tables.clear()
    got = decode._phases(plan, 0, plan.ropes[0], pos, rows + 1)
    assert 0 not in plan.phase_tables and all(torch.equal(g, w) for g, w in zip(got, plan.ropes[0].phases(pos),
                                                                                  strict=True))


def test_a_dropped_llms_kv_cache_is_freed_while_the_model_and_its_plan_live(plan_runs):
    """The plan binds to each KV cache it serves weakly (``DecodePlan.bound``): two LLMs built on one model object
    get a binding each, and deleting one frees its KV cache though the model, and the plan on it, stay."""
    import gc
    import weakref

    model = tiny(torch.float32)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first, second = (LLM(model, max_model_len=64, enable_prefix_caching=False) for _ in range(2))
    for llm in (first, second):
        llm.generate([{"prompt_token_ids": prompts((9,))[0]}], params, use_tqdm=False)
    plan = decode.decode_plan(model)
    assert plan is not None and plan_runs["ran"] == 4 and len(plan.bound) == 2
    cache = weakref.ref(first.engine.cache)
    del first
    gc.collect()
    assert cache() is None and len(plan.bound) == 1


def test_a_range_of_layers_runs_alone_only_when_it_holds_every_source_its_layers_read(plan_runs):
    """``DecodePlan.closed``: the C call keeps the picks and candidate pools of the layers it runs, so a range of
    layers (CED's encoder or decoder half, run by two ``run_layers`` calls of one step) takes the plan only when no
    layer in it reads an index or candidate source outside it and none outside reads one inside; checked against
    the layer specs for every split of the tiny config."""
    model = tiny(torch.float32)
    run = Run(model)
    run.add(prompts((9,)), 2)
    while run.engine.has_unfinished_requests():
        run.step()
    plan = decode.decode_plan(model)
    specs = [block.attn.spec for block in model.layers]
    n = len(specs)
    reads = [(s.layer_id, src) for s in specs if s.role is not LayerRole.WINDOW
             for src in (s.index_source, s.candidate_source) if src is not None]
    assert any(src != j for j, src in reads)  # some layer reads another's picks: some splits are not closed
    verdicts = []
    for cut in range(n + 1):
        for layers in (range(0, cut), range(cut, n)):
            want = all((j in layers) == (src in layers) for j, src in reads)
            assert plan.closed(layers) == want, (layers, reads)
            verdicts.append(want)
    assert plan.closed(range(n)) and not all(verdicts)
