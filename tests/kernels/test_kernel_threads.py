"""The kernels' own thread pool (``kernels.set_threads``) and the few-token GEMV rules that lean on it.

The pool splits a projection's weight rows (``kernels.linear``, weights of 32 KB and more) and the MoE's hidden and
output rows (``kernels.moe_bf16``) over its threads; every output is computed by the same operations whichever
thread takes it, so the results must be the same bits at 1, 2 and 3 threads, and a token's projection the same
bits whatever batch it is in. Both are also checked against float64 arithmetic in torch (the independent oracle),
to fp32 rounding. Then the pool's life: counts up and down, a forked child (which inherits no workers), two
Python threads sharing one pool (the second caller runs its items itself). Last, which few-token projections
and LM heads take the kernel (``kernels.fast.dense.gemv`` / ``few_token_gemv``, once the fast backend is installed):
fp32 weights only while the kernels have at least torch's threads.

Each test leaves the pool at one thread and torch at its thread count (the suite runs with OMP_NUM_THREADS=1;
the tests set what they need, so they do not depend on the machine's cores). Without a C compiler these tests
skip, except under CI=true, where a missing library fails.
"""

import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast.dense import FP32_GEMV_WEIGHTS, few_token_gemv, gemv
from deepseek_v41.model.hyper import collapse
from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import upcast
from deepseek_v41.model.transformer import Transformer

THREADS = (1, 2, 3)
# fp32 sums in another order than float64's: measured at most 3.7e-8 of the sum of the terms' magnitudes
# (tests/kernels/test_gemv_kernels.py).
LINEAR_TOL = 1e-6
# bf16 output: the fp32 sum rounded to nearest, at most half a bf16 ulp (2^-9 of the value; 2^-8 leaves room for
# the fp32 error of a sum that lands on a rounding boundary).
BF16_REL = 2.0 ** -8
# MoE against float64: measured at most 3.5e-7 of the largest output (20 seeds of these inputs, the 6 cases below,
# 1 .. 16 tokens).
MOE_TOL = 2e-6


@pytest.fixture(autouse=True)
def one_thread_after():
    """Every test ends with the pool at one thread (its workers stopped), whatever it set or raised."""
    yield
    assert kernels.set_threads(1) == 1


@pytest.fixture
def torch_threads():
    """Torch at two intra-op threads for the test (any machine takes that), then back to its count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


@pytest.fixture
def linear_calls(monkeypatch):
    """Counts the calls of ``kernels.linear`` (its callers look it up on the module at each call)."""
    counts = {"linear": 0}

    def spy(*args, _fn=kernels.linear, **kw):
        counts["linear"] += 1
        return _fn(*args, **kw)

    monkeypatch.setattr(kernels, "linear", spy)
    return counts


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(bits(got), bits(want))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal dtype, shape and bits (-0 differs from +0; the inputs here are finite: no NaN to equate)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if not same_bits(got, want):
        ints = bits(got).dtype
        bad = (got.view(ints) != want.view(ints)).nonzero()
        raise AssertionError(f"{len(bad)} elements differ, first at {bad[0].tolist()}: "
                             f"{got[tuple(bad[0])].item()} vs {want[tuple(bad[0])].item()}")


def exact_linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of ``kernels.linear(x, weight, groups)`` in float64: (outputs, Σ|terms|) [..., groups * O]."""
    K, O = x.shape[-1] // groups, weight.shape[0] // groups
    xs = [x[..., g * K: (g + 1) * K].double() for g in range(groups)]
    ws = [weight[g * O: (g + 1) * O].double() for g in range(groups)]
    return (torch.cat([xg @ wg.t() for xg, wg in zip(xs, ws, strict=True)], -1),
            torch.cat([xg.abs() @ wg.abs().t() for xg, wg in zip(xs, ws, strict=True)], -1))


def assert_rounding_close(got: torch.Tensor, exact: torch.Tensor, magnitudes: torch.Tensor) -> None:
    """fp32 / bf16 ``got`` against float64 ``exact``: the fp32 sum's error (LINEAR_TOL of the terms'
    magnitudes), plus bf16's rounding of the result where ``got`` is bf16."""
    err = (got.double() - exact).abs()
    bound = LINEAR_TOL * magnitudes + (BF16_REL * exact.abs() if got.dtype == torch.bfloat16 else 0)
    assert (err <= bound).all(), f"off by {(err - bound).max().item():.3g} beyond the rounding bound"


def projection(N: int, K: int, O: int, dtypes: tuple[torch.dtype, torch.dtype], seed: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] and weight [O, K] with outputs ~N(0, 1), in dtypes (x, weight)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g).to(dtypes[0])
    return x, (torch.randn(O, K, generator=g) * K ** -0.5).to(dtypes[1])


# ------------------------------------------------------------------------------------------------ set_threads
@pytest.mark.parametrize("bad", [0, -1, -64])
def test_set_threads_below_one_raises_and_changes_nothing(bad):
    assert kernels.set_threads(2) == 2
    with pytest.raises(ValueError, match="threads must be >= 1"):
        kernels.set_threads(bad)
    assert kernels.threads() == 2


def test_set_spin_sets_the_workers_spin_time_and_clamps_below_zero():
    """set_spin takes seconds (kept in ns); a negative time counts as 0; jobs run the same either way."""
    before = kernels.spin()
    try:
        assert kernels.set_threads(2) == 2
        x, w = torch.randn(3, 512), torch.randn(64, 512)
        want = kernels.linear(x, w)
        for seconds, kept in ((0.001, 0.001), (-5.0, 0.0), (0.0, 0.0), (2.5e-4, 2.5e-4)):
            kernels.set_spin(seconds)
            assert kernels.spin() == pytest.approx(kept, abs=1e-9)
            assert same_bits(kernels.linear(x, w), want)
        for bad in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(ValueError, match="finite"):
                kernels.set_spin(bad)
            assert kernels.spin() == pytest.approx(2.5e-4, abs=1e-9)
    finally:
        kernels.set_spin(before)


def test_a_worker_sleeps_once_its_spin_time_is_over():
    """Spin 0: after a job the worker goes to sleep (counted by pool_sleeps), and the next job still runs on the
    pool with the same bits. No timing: the count is polled until it moves (bounded)."""
    before = kernels.spin()
    try:
        assert kernels.set_threads(2) == 2
        x, w = torch.randn(2, 256), torch.randn(256, 256)
        kernels.set_spin(0.0)
        slept = kernels.pool_sleeps()
        want = kernels.linear(x, w)
        deadline = time.monotonic() + 30
        while kernels.pool_sleeps() == slept and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kernels.pool_sleeps() > slept
        assert same_bits(kernels.linear(x, w), want)
    finally:
        kernels.set_spin(before)


DESCHEDULED = """
import sys, time, torch
from deepseek_v41 import kernels
kernels.set_threads(2)
kernels.set_spin(1000.0)  # by its spin time alone the worker would not sleep for 1000 s
x, w = torch.randn(2, 256), torch.randn(256, 256)
slept = kernels.pool_sleeps()
kernels.linear(x, w)  # the worker ran a job (woken if it slept) and now spins
print("spinning", flush=True)
sys.stdin.readline()  # the parent stops this process for a while, lets it go on, then writes a line
deadline = time.monotonic() + 20
while kernels.pool_sleeps() == slept and time.monotonic() < deadline:
    time.sleep(0.01)
print(kernels.pool_sleeps() - slept, flush=True)
"""


def test_a_spinning_worker_that_was_descheduled_sleeps():
    """A worker spinning for the next job (spin time 1000 s) in a process that is stopped (SIGSTOP) for 0.2 s
    finds a gap in its clock reads when it runs again, as when another process took its core: it sleeps rather
    than spin on (issue 22). Run in a child process, which this test stops and continues."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", DESCHEDULED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "spinning"
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        child.send_signal(signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert int(child.stdout.readline()) >= 1
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait()


def test_set_threads_up_and_down_returns_the_count_and_keeps_the_results():
    """Workers started and stopped in any order: the count comes back, ``threads()`` reports it, and a split
    projection and MoE give the same bits as on one thread. A request beyond the pool's limit gets what it
    could start, and says so."""
    x, w = projection(7, 203, 165, (torch.float32, torch.float32), seed=1)
    moe = moe_inputs(7, torch.float32, torch.bfloat16, seed=2)
    assert kernels.set_threads(1) == 1 and kernels.threads() == 1
    want, want_moe = kernels.linear(x, w), kernels.moe_bf16(*moe)
    assert_rounding_close(want, *exact_linear(x, w))
    for n in (2, 3, 1, 4, 2, 3, 3, 1, 2):
        assert kernels.set_threads(n) == n and kernels.threads() == n
        assert_same_bits(kernels.linear(x, w), want)
        assert_same_bits(kernels.moe_bf16(*moe), want_moe)
    many = kernels.set_threads(200)
    assert kernels.threads() == many and 3 < many <= 200
    assert_same_bits(kernels.linear(x, w), want)
    assert_same_bits(kernels.moe_bf16(*moe), want_moe)


# ------------------------------------------------------------------------------------------ the split GEMV
LINEAR_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                 (torch.float32, torch.bfloat16)]  # (x, weight)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtypes", LINEAR_DTYPES, ids=str)
def test_linear_is_the_same_bits_on_any_threads_and_in_any_batch(dtypes, groups):
    """N = 1 .. 20 tokens (blocks of 4, and of 16, plus the rest), K = 203 (not a multiple of the 16 lanes: a
    tail), O = 165 per group (not a multiple of 4 or of the pool's 32-row items), weights of 66 KB (bf16, one
    group) and up: split over the pool. At 1, 2 and 3 threads every token's output is the bits it has when
    computed alone, and close to float64's."""
    K, O, N = 203, 165, 20
    x, w = projection(N, groups * K, groups * O, dtypes, seed=10 + groups)
    w = w[:, :K].contiguous()
    assert w.numel() * w.element_size() >= 32 * 1024
    alone = torch.cat([kernels.linear(x[i: i + 1], w, groups) for i in range(N)])
    assert alone.dtype == x.dtype and alone.shape == (N, groups * O)
    assert_rounding_close(alone, *exact_linear(x, w, groups))
    for n in THREADS:
        assert kernels.set_threads(n) == n
        for rows in range(1, N + 1):
            assert_same_bits(kernels.linear(x[:rows], w, groups), alone[:rows])
    # Leading dimensions [B, T, K] and a token in the middle of its block.
    assert_same_bits(kernels.linear(x[:18].reshape(3, 6, -1), w, groups), alone[:18].reshape(3, 6, -1))
    assert_same_bits(kernels.linear(x[5:11], w, groups), alone[5:11])


# ------------------------------------------------------------------------------------------ the split MoE
def moe_inputs(N: int, x_dtype: torch.dtype, shared_dtype: torch.dtype | None, seed: int):
    """``kernels.moe_bf16`` arguments for N tokens: D = 100 (not a multiple of the pool's 32-row items or of the 16
    lanes), 6 routed experts of width 40 in bf16, k = 3, token 0 picking expert 4 twice; the shared expert (when
    ``shared_dtype``) 72 wide. Inputs at 3 times the unit scale, so some gate / up values pass the limit 7."""
    g = torch.Generator().manual_seed(seed)
    D, E, inter, s_inter, k = 100, 6, 40, 72, 3
    x = (torch.randn(N, D, generator=g) * 3).to(x_dtype)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    indices[0] = torch.tensor([4, 1, 4])
    weights = torch.rand(N, k, generator=g)
    w13 = (torch.randn(E, 2 * inter, D, generator=g) * D ** -0.5).bfloat16()
    w2 = (torch.randn(E, D, inter, generator=g) * inter ** -0.5).bfloat16()
    shared = None
    if shared_dtype is not None:
        shared = tuple((torch.randn(*shape, generator=g) * shape[1] ** -0.5).to(shared_dtype)
                       for shape in ((s_inter, D), (s_inter, D), (D, s_inter)))
    return x, indices, weights, w13, w2, 7.0, shared


def exact_moe(x, indices, weights, w13, w2, limit, shared) -> torch.Tensor:
    """The oracle: Σ_j weights[n, j] · expert_{indices[n, j]}(x_n) + shared(x_n) in float64, an expert being
    ``w2 (silu(min(w1 x, limit)) * clamp(w3 x, ±limit))`` (model/moe.py Expert)."""
    inter = w2.shape[2]

    def expert(xn, w1, w3, w2e):
        gate, up = (w1.double() @ xn).clamp(max=limit), (w3.double() @ xn).clamp(-limit, limit)
        return w2e.double() @ (F.silu(gate) * up)

    out = torch.zeros(x.shape, dtype=torch.float64)
    for n, xn in enumerate(x.double()):
        for e, weight in zip(indices[n].tolist(), weights[n].tolist(), strict=True):
            out[n] += weight * expert(xn, w13[e, :inter], w13[e, inter:], w2[e])
        if shared is not None:
            out[n] += expert(xn, *shared)
    return out


@pytest.mark.parametrize("shared_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_bf16_is_the_same_bits_on_any_threads_and_in_any_batch(x_dtype, shared_dtype):
    """N = 1 .. 16 tokens at 1, 2 and 3 threads: each token's output the bits it has alone (its experts' terms
    are added in ascending id, then the shared expert, whoever computes them), and close to float64's."""
    N = kernels.FEW_ROWS
    x, *rest = moe_inputs(N, x_dtype, shared_dtype, seed=20)
    limit = rest[4]
    alone = torch.cat([kernels.moe_bf16(x[i: i + 1], rest[0][i: i + 1], rest[1][i: i + 1], *rest[2:])
                       for i in range(N)])
    want = exact_moe(x, *rest)
    assert alone.dtype == torch.float32 and alone.shape == want.shape
    err, scale = (alone.double() - want).abs().max().item(), want.abs().max().item()
    assert err <= MOE_TOL * scale, f"off by {err:.3g} on outputs up to {scale:.3g}"
    picked = torch.stack([rest[2][e].double() @ x[n].double() for n in range(N) for e in rest[0][n].tolist()])
    assert (picked.abs() > limit).float().mean() > 0.01  # the clamps are exercised
    for n in THREADS:
        assert kernels.set_threads(n) == n
        for rows in range(1, N + 1):
            assert_same_bits(kernels.moe_bf16(x[:rows], rest[0][:rows], rest[1][:rows], *rest[2:]), alone[:rows])


def test_moe_writes_bf16_as_the_fp32_sums_rounded_once():
    """out_dtype=bf16: the same fp32 sums rounded to nearest even (what casting the fp32 result gave before), on 1
    and 2 threads; another out_dtype raises ValueError."""
    x, *rest = moe_inputs(5, torch.bfloat16, torch.bfloat16, seed=22)
    want = kernels.moe_bf16(x, *rest).bfloat16()
    for n in (1, 2):
        assert kernels.set_threads(n) == n
        got = kernels.moe_bf16(x, *rest, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and same_bits(got, want)
    with pytest.raises(ValueError, match="out_dtype"):
        kernels.moe_bf16(x, *rest, out_dtype=torch.float16)


def test_mhc_kernels_are_the_same_bits_on_any_threads():
    """hc_mix (tokens over the pool, then Sinkhorn 16 tokens per item), hc_collapse and hc_expand at a
    prefill-sized row count (257: a lone token in the last Sinkhorn group) give the same bits at 1, 2 and 3
    threads."""
    g = torch.Generator().manual_seed(21)
    N, hc, D = 257, 4, 64
    streams = torch.randn(1, N, hc, D, generator=g)
    fn, base, scale = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.05, torch.randn(24, generator=g), \
        torch.rand(3, generator=g)
    w, y = torch.rand(1, N, hc, generator=g), torch.randn(1, N, D, generator=g)
    post, comb = torch.rand(1, N, hc, generator=g) * 2, torch.rand(1, N, hc, hc, generator=g)
    norm = torch.rand(D, generator=g) + 0.5

    def run():
        return (*kernels.hc_mix(streams, fn, base, scale, hc, 1e-6, 1e-6, 20),
                kernels.hc_collapse(streams, w, norm, 1e-6), kernels.hc_expand(streams, y, post, comb))

    want = run()
    for n in THREADS:
        assert kernels.set_threads(n) == n
        for got, ref in zip(run(), want, strict=True):
            assert_same_bits(got, ref)


def test_moe_bf16_counts_an_expert_picked_twice_with_both_weights():
    """Token 0 picks expert 4 twice with two router weights: the same as picking it once with their sum (to
    rounding), on a split pool."""
    x, indices, weights, *rest = moe_inputs(3, torch.float32, None, seed=21)
    assert kernels.set_threads(3) == 3
    twice = kernels.moe_bf16(x[:1], indices[:1], weights[:1], *rest)
    once_w = torch.tensor([[weights[0, 0] + weights[0, 2], weights[0, 1]]])
    once = kernels.moe_bf16(x[:1], torch.tensor([[4, 1]]), once_w, *rest)
    err, scale = (twice - once).abs().max().item(), once.abs().max().item()
    assert err <= MOE_TOL * scale and scale > 0.1
    dropped = kernels.moe_bf16(x[:1], torch.tensor([[4, 1]]), weights[:1, :2], *rest)
    assert (twice - dropped).abs().max().item() > 1e-3 * scale  # the second pick really counts


# ------------------------------------------------------------------------------------------- fork, threads
def _child(conn, x, w):
    """In a forked child: the projection on the inherited pool (no workers: only the forking thread survives a
    fork), then on two threads started in the child."""
    conn.send((kernels.threads(), kernels.linear(x, w).numpy().tobytes()))
    conn.send((kernels.set_threads(2), kernels.linear(x, w).numpy().tobytes()))
    conn.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("wait", [0.0, 0.05], ids=["workers-spinning", "workers-asleep"])
def test_a_forked_child_runs_the_kernels_with_the_right_results(wait):
    """fork() after the pool has workers: the child runs a split projection to the end with the parent's bits,
    reports one thread, and can start workers of its own. A hang fails after the timeout instead of hanging."""
    x, w = projection(5, 203, 400, (torch.float32, torch.float32), seed=30)
    assert kernels.set_threads(3) == 3
    want = kernels.linear(x, w)  # the workers have just run a job: spinning, or asleep after `wait`
    time.sleep(wait)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, x, w))
    proc.start()
    try:
        got = []
        for _ in range(2):
            assert parent.poll(60), "the forked child did not answer within 60 s"
            got.append(parent.recv())
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    want_bytes = want.numpy().tobytes()
    assert got[0] == (1, want_bytes)
    assert got[1] == (2, want_bytes)
    assert kernels.threads() == 3  # the parent's pool is its own
    assert_same_bits(kernels.linear(x, w), want)


def test_two_python_threads_share_the_pool_with_the_right_results():
    """Two Python threads call the projection and the MoE 150 times each at once (ctypes lets go of the GIL): a
    caller that finds the pool busy runs its items itself. Every result is the bits of one thread's."""
    lin = [projection(n, 203, 165, dtypes, seed=40 + n) for n, dtypes in ((3, LINEAR_DTYPES[0]),
                                                                          (9, LINEAR_DTYPES[3]))]
    moes = [moe_inputs(n, torch.float32, shared, seed=50 + n) for n, shared in ((4, torch.bfloat16), (16, None))]
    want = [(kernels.linear(*lin[i]), kernels.moe_bf16(*moes[i])) for i in range(2)]
    assert kernels.set_threads(2) == 2
    start = threading.Barrier(2)

    def hammer(i: int) -> list[str]:
        start.wait(60)
        wrong = []
        for rep in range(150):
            if not same_bits(kernels.linear(*lin[i]), want[i][0]):
                wrong.append(f"linear {i} at {rep}")
            if not same_bits(kernels.moe_bf16(*moes[i]), want[i][1]):
                wrong.append(f"moe {i} at {rep}")
        return wrong

    with ThreadPoolExecutor(2) as callers:
        runs = [callers.submit(hammer, i) for i in range(2)]
        assert [run.result(timeout=60) for run in runs] == [[], []]  # result() raises what a caller raised


# ------------------------------------------------------------------------------ which projections take it
def test_fp32_projections_take_the_kernel_only_while_the_kernels_have_torchs_threads(linear_calls, torch_threads):
    """fp32 x and weight: a few tokens of a weight of FP32_GEMV_WEIGHTS values or more take the kernel when the
    kernels have at least torch's threads; fewer kernel threads, a smaller weight, more than FEW_ROWS tokens,
    no inference mode, float64: ``F.linear``, bit for bit."""
    K = 256
    big = Linear(K, FP32_GEMV_WEIGHTS // K + 1, bias=False)
    small = Linear(K, FP32_GEMV_WEIGHTS // K - 1, bias=False)
    for layer in (big, small):
        torch.nn.init.normal_(layer.weight, std=K ** -0.5, generator=torch.Generator().manual_seed(60))
        assert fast.install(layer).modules == {"Linear": 1}
    assert big.weight.numel() >= FP32_GEMV_WEIGHTS > small.weight.numel()
    few = kernels.FEW_ROWS
    x = torch.randn(few + 1, K, generator=torch.Generator().manual_seed(61))
    with torch.no_grad():  # ATen's GEMV of one token and GEMM of many differ in their last bits
        plain, one = F.linear(x, big.weight), F.linear(x[:1], big.weight)
    with torch.inference_mode():
        assert kernels.threads() == 1 < torch.get_num_threads() == torch_threads
        assert not gemv(x[:1], big.weight) and not few_token_gemv(x[:1], big.weight)
        assert_same_bits(big(x[:1]), one)
        assert linear_calls["linear"] == 0
        assert gemv(x[:1], small.weight, fp32=True)  # GroupedLinear's rule does not look at the threads
        for n in (torch_threads, torch_threads + 1):
            assert kernels.set_threads(n) == n
            for rows in (1, 5, few):
                assert gemv(x[:rows], big.weight) and few_token_gemv(x[:rows], big.weight)
                got = big(x[:rows])
                assert_rounding_close(got, *exact_linear(x[:rows], big.weight))
            assert linear_calls["linear"] == 3 * (n - torch_threads + 1)
            assert few_token_gemv(x[:1], small.weight) and not gemv(x[:1], small.weight)
            assert_same_bits(small(x[:1]), F.linear(x[:1], small.weight))
            assert not gemv(x, big.weight) and not few_token_gemv(x, big.weight)  # FEW_ROWS + 1 tokens
            assert_same_bits(big(x), plain)
            assert not gemv(x[:1].double(), big.weight.double())
            assert not few_token_gemv(x[:1].double(), big.weight.double())
            assert not few_token_gemv(x[:1], big.weight.half())
            assert not gemv(x[:1], big.weight.t().contiguous().t())  # not contiguous
        assert linear_calls["linear"] == 6
        assert kernels.set_threads(1) == 1
        assert not gemv(x[:1], big.weight)
    assert torch.get_num_threads() == torch_threads  # the rules only read the counts
    with torch.no_grad():
        assert kernels.set_threads(torch_threads) == torch_threads
        assert not gemv(x[:1], big.weight) and not few_token_gemv(x[:1], big.weight)
        assert_same_bits(big(x[:1]), one)
    assert linear_calls["linear"] == 6


def test_fp32_tokens_with_a_bf16_weight_take_the_kernel_whatever_the_threads(torch_threads):
    """A bf16 weight with fp32 x (the LM head of a bf16 model): up to FEW_ROWS tokens in inference mode, even
    with fewer kernel threads than torch's (ATen would copy the weight to fp32 first); ``gemv`` keeps to one
    dtype (``F.linear`` raises on mixed ones)."""
    x, w = projection(kernels.FEW_ROWS + 1, 64, 33, (torch.float32, torch.bfloat16), seed=62)
    assert kernels.threads() < torch.get_num_threads()
    with torch.inference_mode():
        assert few_token_gemv(x[:1], w) and few_token_gemv(x[:-1], w) and few_token_gemv(x[:6].view(2, 3, 64), w)
        assert not few_token_gemv(x, w)
        assert not gemv(x[:1], w)
    with torch.no_grad():
        assert not few_token_gemv(x[:1], w)


# ------------------------------------------------------------------------------------------- the LM head
@pytest.fixture(scope="module")
def models():
    torch.manual_seed(3)
    models = {torch.float32: Transformer(tiny_config()).eval(),
              torch.bfloat16: Transformer(tiny_config()).eval().bfloat16()}
    for model in models.values():
        assert fast.install(model).modules["Transformer"] == 1  # the LM head's fast version
    return models


def head_inputs(model: Transformer, B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [B, T, hc, D] in the model's dtype, pre [B, T, hc] fp32, and the head's input x [B, T, D] fp32 as
    ``Transformer.logits`` computes it (under the caller's grad mode)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    dtype = model.head.weight.dtype
    streams = torch.randn(B, T, cfg.hc_mult, cfg.hidden_size, generator=g).to(dtype)
    pre = torch.rand(B, T, cfg.hc_mult, generator=g) + 0.1
    return streams, pre, upcast(model.norm(collapse(streams, pre)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logits_take_the_kernel_for_a_few_tokens_and_agree_with_the_torch_expression(models, dtype, linear_calls,
                                                                                     torch_threads):
    """``Transformer.logits``: a bf16 head always for up to FEW_ROWS tokens, an fp32 head only while the kernels
    have torch's threads; the logits fp32 and close to ``x @ head.weight.to(x.dtype).t()``, which is what every
    other case returns, bit for bit."""
    model = models[dtype]
    head = model.head.weight.detach()
    for B, T, threads in ((1, 1, 1), (2, 3, 1), (1, kernels.FEW_ROWS, 1), (2, 3, torch_threads),
                          (1, kernels.FEW_ROWS + 1, torch_threads)):
        assert kernels.set_threads(threads) == threads
        take = B * T <= kernels.FEW_ROWS and (dtype == torch.bfloat16 or threads >= torch_threads)
        with torch.inference_mode():
            streams, pre, x = head_inputs(model, B, T, seed=B * 100 + T)
            before = linear_calls["linear"]
            got = model.logits(streams, pre)
            assert linear_calls["linear"] == before + take, (B, T, threads)
            torch_logits = x @ head.to(x.dtype).t()
        assert got.dtype == torch.float32 and got.shape == (B, T, model.config.vocab_size)
        exact, magnitudes = exact_linear(x, head)
        assert_rounding_close(got, exact, magnitudes)
        if take:
            assert_rounding_close(got, torch_logits.double(), 2 * magnitudes)
        else:
            assert_same_bits(got, torch_logits)
    with torch.no_grad():  # outside inference mode: the torch expression
        streams, pre, x = head_inputs(model, 1, 1, seed=7)
        before = linear_calls["linear"]
        assert_same_bits(model.logits(streams, pre), x @ head.to(x.dtype).t())
    assert linear_calls["linear"] == before
