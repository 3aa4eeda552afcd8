"""Fused CPU kernels: the decode step's chains of small tensor ops as single C calls (bench/README.md).

At decode size (a few tokens) nearly all of a step's time is dispatch: ~3,800 tensor ops of a few µs each.
``cpu_kernels.c`` does the worst chains in one call each: the FP8 window ring (read, quantize, write), FP4
entries written to and read from pages through the block tables, FP4 / FP8 quantization, RoPE, RMSNorm, the mHC
mixing (coefficients with Sinkhorn, collapse, expand), the few-query attention, the MoE router and experts (routed
experts read in the checkpoint's FP4 format, or bf16), the indexer's queries, scores and top-k, the candidate
pool's blocks and a Reindex layer's picks inside them, the attention's projections, its compressed entries and
index keys, and a GEMV for the projections of a few tokens. It is
plain C (with the GCC / Clang vector extension for its accumulators) compiled with the system C compiler on first
use (about a second) into a cache folder and called through :mod:`ctypes`; no torch headers, nothing to install.

The memory-bound kernels (projections, the MoE, the window step, gathers, mHC mixing, attention, index scores,
top-k) split their work over the library's own thread pool (:func:`set_threads`; one thread until it is called):
items of rows or tokens, each computed by the same operations whichever thread takes it, so results do not depend
on the thread count. A few-token engine step hands torch's threads to the pool and runs torch on one thread
meanwhile (engine/model_runner.py): two pools spinning on the same cores would stall each other.

Callers use a kernel only where :func:`usable` says so (CPU, contiguous, no autograd) and keep their torch code
as the fallback, which runs everywhere else (CUDA, ``meta``, training, float64) and wherever the library cannot
be built: no compiler, or ``DSV41_CPU_KERNELS=0``. The quantization kernels, RoPE, the top-k, the candidate
pool's blocks and the argmax give the torch code's results exactly; the others add in another order (and, for
bf16 tensors, compute in fp32 without the bf16 roundings between the steps they fuse), so they agree to rounding
and run only under ``torch.inference_mode`` (``tests/kernels`` checks both); a Reindex layer's picks are the
torch code's up to its scores' rounding.

Environment: ``DSV41_CPU_KERNELS=0`` turns the kernels off; ``DSV41_KERNEL_CACHE`` is the folder for the built
library (default: ``deepseek_v41_kernels_<user>`` in the system temp folder, as torch inductor keeps its builds;
it must belong to the user and be writable by no one else); ``CC`` the compiler (``cc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import hashlib
import math
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c11", "-pthread"]
FP4_FORMATS = {"e4m3": 0, "ue8m0": 1}
# Input dtypes the codec kernels take after widening to fp32 (exact), as the torch codecs widen them too.
WIDENS_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)
SMALL_ROWS = 256  # up to this many tokens the router kernel runs (beyond, ATen's threaded matmuls win)
MAX_HC = 16  # hc_mix keeps one token's (2 + hc) * hc mixing logits on the stack
ROW_ON_STACK = 8192  # rows of up to this many floats the kernels widen / build on their stack (cpu_kernels.c)
INDEX_LUT_ROWS = 1024  # from this many keys per row, index scores the even / odd path cannot take use a lookup table
MAX_ATTEND_HEADS = 256  # attend_few keeps one query's per-head softmax state on the stack
FEW_ROWS = 16  # up to this many tokens take the few-token kernels (decode, speculative verify)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "dsv41_init": ([], ctypes.c_int),
    "dsv41_fp8_quantize": ([_P, _I, _I, _P, _P, _P], None),
    "dsv41_fp8_dequantize": ([_P, _P, _I, _I, _P], None),
    "dsv41_fp4_quantize": ([_P, _I, _I, _I, ctypes.c_int, _P, _P, _P], None),
    "dsv41_fp4_dequantize": ([_P, _P, _I, _I, _I, ctypes.c_int, _P], None),
    "dsv41_fp4_gather": ([_P, _P, _I, _I, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, _I, _I, _P], ctypes.c_int),
    "dsv41_fp4_scatter": ([_P, _P, _I, _I, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, _P, _I, _I, _P], _I),
    "dsv41_window_step": ([_P, _P, _P, _I, _I, _I, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P], None),
    "dsv41_rope": ([_P, _P, _P, _I, _I, _I, _I, ctypes.c_int, _P], None),
    "dsv41_rope_bf16": ([_P, _P, _P, _I, _I, _I, _I, ctypes.c_int, _P], None),
    "dsv41_rms_norm": ([_P, _I, _I, _P, ctypes.c_float, _P], None),
    "dsv41_rms_norm_bf16": ([_P, _I, _I, _P, ctypes.c_float, _P, _P], None),
    "dsv41_hc_mix": ([_P, ctypes.c_int, _I, _I, _I, _P, _P, _P, ctypes.c_float, ctypes.c_float, _I, _P, _P, _P, _P],
                     None),
    "dsv41_hc_collapse": ([_P, ctypes.c_int, _P, _I, _I, _I, _P, ctypes.c_float, _P], None),
    "dsv41_hc_expand": ([_P, ctypes.c_int, _P, _P, _P, _I, _I, _I, _P], None),
    "dsv41_attend_few": ([_P, ctypes.c_int, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P, ctypes.c_float, _P, _P],
                         None),
    "dsv41_gate": ([_P, ctypes.c_int, _I, _I, _P, ctypes.c_int, _I, _P, _I, ctypes.c_int, ctypes.c_float, _P, _P, _P],
                   ctypes.c_int),
    "dsv41_swiglu": ([_P, _P, _I, _I, _I, ctypes.c_float, _P], None),
    "dsv41_index_scores": ([_P, _P, _I, _I, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, _P, _I, _I, _I, _I,
                            ctypes.c_int, _P, _P], ctypes.c_int),
    "dsv41_pool_select": ([_P, _P, _I, _I, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I, _I,
                           _I, _P, _I, _P], ctypes.c_int),
    "dsv41_candidate_blocks": ([_P, _P, _I, _I, _I, _I, _P], ctypes.c_int),
    "dsv41_moe": ([_P, ctypes.c_int, _I, _I, _P, _P, _I, ctypes.c_int, _P, _P, _P, _P, _I, _I, ctypes.c_float, _P,
                   _P, _P, ctypes.c_int, _I, _P, ctypes.c_int], ctypes.c_int),
    "dsv41_topk_set": ([_P, _I, _I, _I, ctypes.c_int, _P, _P], ctypes.c_int),
    "dsv41_argmax": ([_P, _I, _I, _P], None),
    "dsv41_linear": ([_P, ctypes.c_int, _I, _I, _I, _P, ctypes.c_int, _I, _P], ctypes.c_int),
    "dsv41_set_threads": ([ctypes.c_int], ctypes.c_int),
    "dsv41_set_spin": ([ctypes.c_int64], None),
    "dsv41_get_spin": ([], ctypes.c_int64),
    "dsv41_pool_sleeps": ([], ctypes.c_long),
    "dsv41_prefetch": ([_P, _I], None),
    "dsv41_attn_prologue": ([_P, ctypes.c_int, _I, _I, _P, _I, _P, ctypes.c_float, _P, _I, _I, _P, _P,
                             ctypes.c_float, _P, _P, _I, _P, _P, _P], ctypes.c_int),
    "dsv41_attn_epilogue": ([_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _I, _I, _P, _I, _P], ctypes.c_int),
    "dsv41_compress": ([_P, ctypes.c_int, _I, _I, _I, _P, _I, _P, _P, _I, _P, ctypes.c_float, _P, _P, _I, _P, _P, _I,
                        _P, _I, _P, ctypes.c_float, _P, _P, _P, _P, _P], ctypes.c_int),
    "dsv41_indexer_queries": ([_P, _P, ctypes.c_int, _I, _I, _I, _P, _I, _I, _P, _P, _P, _I, ctypes.c_int,
                               ctypes.c_float, _P, _P], ctypes.c_int),
}

_state: dict[str, object] = {"lib": None, "tried": False, "off": False, "threads": 1}


def cache_dir() -> Path:
    """Where the built library is kept (see the module docstring). Raises RuntimeError when the folder exists but
    belongs to another user or others may write to it (a library there could have been planted)."""
    if os.environ.get("DSV41_KERNEL_CACHE"):
        folder = Path(os.environ["DSV41_KERNEL_CACHE"]).expanduser()
    else:
        folder = Path(tempfile.gettempdir()) / f"deepseek_v41_kernels_{_user()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"kernel cache {folder} belongs to another user or is writable by others")
    return folder


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's bare uid)
        return str(os.getuid())


def _build() -> Path:
    """Compile ``cpu_kernels.c`` once per source, flags, compiler and machine; returns the shared library.

    Raises RuntimeError (with the compiler's message) when no compiler is found or the build fails."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *CFLAGS, version, platform.machine(),
                                                         platform.node()]).encode()).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # build aside, then rename: parallel builds are safe
        built = Path(tmp) / target.name
        done = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {SOURCE.name}:\n{done.stderr[-2000:]}")
        os.replace(built, target)
    return target


def library() -> ctypes.CDLL | None:
    """The kernel library, built and loaded on first call; None when off (``DSV41_CPU_KERNELS=0``, or inside
    :func:`disabled`) or when it cannot be built (then a warning says why, once)."""
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get("DSV41_CPU_KERNELS", "1") != "0":
            _state["lib"] = _load()
    return None if _state["off"] else _state["lib"]  # type: ignore[return-value]


def _load() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
        for name, (args, result) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
        if lib.dsv41_init() != 256:
            raise RuntimeError("dsv41_init did not run")
        return lib
    except (OSError, RuntimeError) as exc:
        warnings.warn(f"deepseek_v41: fused CPU kernels unavailable, using the torch code ({exc})", stacklevel=3)
        return None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every caller takes its torch code (tests compare the two paths)."""
    before = _state["off"]
    _state["off"] = True
    try:
        yield
    finally:
        _state["off"] = before


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may take these tensors: the library is loaded, every tensor is on the CPU and
    contiguous, and no gradient is wanted through them."""
    if _state["off"] or (_state["lib"] is None and library() is None):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # noqa: SIM110 (a plain loop, not all(generator): this runs ~200 times a decode step)
        if not (t.is_cpu and t.is_contiguous()) or (grad and t.requires_grad):
            return False
    return True


def set_threads(threads: int) -> int:
    """Let the kernels' jobs (projections, experts, attention, mHC mixing, index scores, ...) run on up to
    ``threads`` threads: the caller plus
    ``threads - 1`` worker threads of the library's own pool, started (or stopped) here; 1 keeps every job on the
    caller. Results do not depend on it (each output is computed the same way by whichever thread). Returns the
    threads now used (1 when the library is off). Raises ValueError for ``threads`` < 1."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    lib = library()
    _state["threads"] = 1 if lib is None else lib.dsv41_set_threads(threads)
    return _state["threads"]


def set_spin(seconds: float) -> None:
    """How long the pool's workers spin for the next job after one before they sleep (a sleeping worker is woken
    by the next job, ~10-50 µs later, while the caller already takes its items). A few-token forward calls the
    pool every ~100 µs and wants them spinning (engine/model_runner.py sets 2 ms there); outside one, torch's own
    threads need those cores, so it sets 0. Negative counts as 0; nothing happens when the library is off. The
    setting is process-wide: a prefill in one thread sets 0 while another thread's decode may be running (its
    workers then sleep between its kernels until its next step sets the spin again). Raises ValueError for a
    time that is not finite."""
    if not math.isfinite(seconds):
        raise ValueError(f"spin time must be a finite number of seconds, got {seconds}")
    lib = library()
    if lib is not None:
        lib.dsv41_set_spin(int(max(seconds, 0.0) * 1e9))


def spin() -> float:
    """The pool's spin time in seconds (:func:`set_spin`; 0.002 until it is set, 0.0 when the library is off)."""
    lib = library()
    return 0.0 if lib is None else lib.dsv41_get_spin() / 1e9


def pool_sleeps() -> int:
    """How many times the pool's workers went to sleep (their spin time over, or descheduled while spinning) since
    the library loaded; 0 when it is off. For tests and diagnostics."""
    lib = library()
    return 0 if lib is None else lib.dsv41_pool_sleeps()


def prefetch(addresses: torch.Tensor) -> None:
    """Prefetch hints for the memory at int64 ``addresses`` [n] (two 64-byte lines each; model/warm.py). A
    prefetch reads nothing and never faults, so stale addresses are harmless, and no addresses (n = 0) are no
    hints: the one wrapper that takes an empty tensor. Nothing happens when the library is off."""
    lib = library()
    if lib is not None:
        lib.dsv41_prefetch(addresses.data_ptr(), addresses.numel())


def threads() -> int:
    """The threads the kernels' jobs run on (:func:`set_threads`; 1 until it is called, and in a forked child)."""
    return _state["threads"]


def _forked_child() -> None:
    _state["threads"] = 1  # the library's pool has no workers in a forked child (only the forking thread survives)


os.register_at_fork(after_in_child=_forked_child)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_FP32_BF16 = (torch.float32, torch.bfloat16)


def _empty(kernel: str, **inputs: torch.Tensor | None) -> None:
    """Raises the ValueError for an empty input (a dimension of size 0) handed to a kernel, where its wrapper's
    one-line check failed: the C code would read through the tensor's NULL or dangling data pointer, or index the
    other inputs with counts derived from it (a zero-length prefill chunk reached ``window_step`` and crashed)."""
    empty = ", ".join(f"{name} {tuple(t.shape)}" for name, t in inputs.items() if t is not None and not t.numel())
    raise ValueError(f"{kernel} kernel: empty input {empty}; every tensor it takes needs at least one element")


def _refuse(kernel: str, wide: tuple[torch.Tensor, ...], fp32: tuple[torch.Tensor | None, ...] = (),
            same: torch.Tensor | None = None, row: int = 0) -> None:
    """Raises the ValueError for inputs a kernel would misread (or overrun a buffer of their size with), where its
    wrapper's one-line check failed: one of ``wide`` not fp32 or bf16, one of ``fp32`` (None skipped) not fp32,
    ``same`` not of ``wide[0]``'s dtype, or bf16 rows of ``row`` values wider than ROW_ON_STACK."""
    for t in wide:
        if t.dtype not in _FP32_BF16:
            raise ValueError(f"{kernel} kernel takes fp32 or bf16 tensors here, got {t.dtype}")
    for t in fp32:
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"{kernel} kernel takes fp32 tensors here, got {t.dtype}")
    if same is not None and same.dtype != wide[0].dtype:
        raise ValueError(f"{kernel} kernel: {same.dtype} beside {wide[0].dtype} (both fp32 or both bf16)")
    raise ValueError(f"{kernel} kernel: bf16 rows of up to {ROW_ON_STACK} values, got {row}")


# ---------------------------------------------------------------------------------------------- quantization
def fp8_quantize_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 E4M3FN blocks of 32 with UE8M0 scales of fp32 ``x`` [..., n]: ``(codes uint8 [..., n], scales uint8
    [..., n / 32], values fp32 [..., n])``, the bits of :func:`deepseek_v41.quant.quantize_fp8_values`."""
    if not x.numel():
        _empty("fp8_quantize", x=x)
    n = x.shape[-1]
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty((*x.shape[:-1], n // 32), dtype=torch.uint8)
    values = torch.empty(x.shape, dtype=torch.float32)
    library().dsv41_fp8_quantize(x.data_ptr(), x.numel() // max(n, 1), n, codes.data_ptr(), scales.data_ptr(),
                                 values.data_ptr())
    return codes, scales, values


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., n] of FP8 ``codes`` uint8 [..., n] and UE8M0 ``scales`` [..., n / 32]."""
    if not (codes.numel() and scales.numel()):
        _empty("fp8_dequantize", codes=codes, scales=scales)
    n = codes.shape[-1]
    out = torch.empty(codes.shape, dtype=torch.float32)
    library().dsv41_fp8_dequantize(codes.data_ptr(), scales.data_ptr(), codes.numel() // max(n, 1), n, out.data_ptr())
    return out


def fp4_quantize(x: torch.Tensor, block: int, fmt: str, codes: bool = True, values: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """FP4 E2M1 blocks of fp32 ``x`` [..., n]: ``(codes uint8 [..., n / 2], scales uint8 [..., n / block],
    values fp32 [..., n])``, each None unless asked for (scales come with codes); the bits of
    :func:`deepseek_v41.quant.quantize_fp4` / ``fake_quant_fp4``."""
    if not x.numel():
        _empty("fp4_quantize", x=x)
    n = x.shape[-1]
    c = torch.empty((*x.shape[:-1], n // 2), dtype=torch.uint8) if codes else None
    s = torch.empty((*x.shape[:-1], n // block), dtype=torch.uint8) if codes else None
    v = torch.empty(x.shape, dtype=torch.float32) if values else None
    library().dsv41_fp4_quantize(x.data_ptr(), x.numel() // max(n, 1), n, block, FP4_FORMATS[fmt], _ptr(c),
                                 _ptr(s), _ptr(v))
    return c, s, v


def fp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """fp32 [..., n] of packed FP4 ``codes`` uint8 [..., n / 2] and ``scales`` uint8 [..., n / block]."""
    if not (codes.numel() and scales.numel()):
        _empty("fp4_dequantize", codes=codes, scales=scales)
    n = codes.shape[-1] * 2
    out = torch.empty((*codes.shape[:-1], n), dtype=torch.float32)
    library().dsv41_fp4_dequantize(codes.data_ptr(), scales.data_ptr(), codes.numel() // max(n // 2, 1), n, block,
                                   FP4_FORMATS[fmt], out.data_ptr())
    return out


# ------------------------------------------------------------------------------------------- paged KV cache
def fp4_gather(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str, tables: torch.Tensor, ratio: int,
               block_size: int, idx: torch.Tensor) -> torch.Tensor:
    """Entries ``idx`` int64 [B, ...] (-1 = none: zeros) of an FP4 pool (codes uint8 [pages, per_page, w / 2],
    scales [pages, per_page, w / block]) through block tables int64 [B, width], decoded: fp32 [B, ..., w].
    Raises IndexError when an entry lies past its block table."""
    if not (tables.numel() and idx.numel()):
        _empty("fp4_gather", tables=tables, idx=idx)
    pages, per_page, half = codes.shape
    width = 2 * half
    out = torch.empty((*idx.shape, width), dtype=torch.float32)
    B = idx.shape[0]
    status = library().dsv41_fp4_gather(codes.data_ptr(), scales.data_ptr(), pages, per_page, width, block,
                                        FP4_FORMATS[fmt], tables.data_ptr(), tables.shape[1], ratio, block_size,
                                        idx.data_ptr(), B, idx.numel() // max(B, 1), out.data_ptr())
    if status != 0:
        raise IndexError("an entry index lies past its block table")
    return out


def fp4_scatter(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str, tables: torch.Tensor, ratio: int,
                block_size: int, group: torch.Tensor, write_from: torch.Tensor, x: torch.Tensor) -> int:
    """Quantize entries ``x`` fp32 [B, G, w] of groups ``group`` int64 [B, G] into an FP4 pool (as
    :func:`fp4_gather` reads it), skipping groups below 0 or whose position ``g * ratio`` is below
    ``write_from`` int64 [B]. Returns the number of entries written. Raises IndexError as :func:`fp4_gather`."""
    if not (tables.numel() and group.numel() and write_from.numel() and x.numel()):
        _empty("fp4_scatter", tables=tables, group=group, write_from=write_from, x=x)
    pages, per_page, half = codes.shape
    B, G = group.shape
    written = library().dsv41_fp4_scatter(codes.data_ptr(), scales.data_ptr(), pages, per_page, 2 * half, block,
                                          FP4_FORMATS[fmt], tables.data_ptr(), tables.shape[1], ratio, block_size,
                                          group.data_ptr(), write_from.data_ptr(), B, G, x.data_ptr())
    if written < 0:
        raise IndexError("an entry group lies past its block table")
    return written


def window_step(ring_codes: torch.Tensor, ring_scales: torch.Tensor, ring_pos: torch.Tensor, layer: int,
                slots: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's SWA window step over the FP8 rings (codes uint8 [S, L, R, d], scales [S, L, R, d / 32], pos
    int32 [S, L, R]) for rows ``slots`` int64 [B] with new rows ``kv`` fp32 [B, T, d] at ``positions`` int64
    [B, T]: returns ``(keys fp32 [B, R + T, d], key_pos int64 [B, R + T])`` as
    :meth:`~deepseek_v41.cache.paged_context.PagedContext.window` does, and stores the new rows in the rings."""
    if not (slots.numel() and positions.numel() and kv.numel()):
        _empty("window_step", slots=slots, positions=positions, kv=kv)
    S, L, R, d = ring_codes.shape
    B, T, _ = kv.shape
    keys = torch.empty((B, R + T, d), dtype=torch.float32)
    key_pos = torch.empty((B, R + T), dtype=torch.int64)
    new_codes = torch.empty((B, T, d), dtype=torch.uint8)
    new_scales = torch.empty((B, T, d // 32), dtype=torch.uint8)
    library().dsv41_window_step(ring_codes.data_ptr(), ring_scales.data_ptr(), ring_pos.data_ptr(), L, layer, R, d,
                                slots.data_ptr(), B, positions.data_ptr(), T, kv.data_ptr(), new_codes.data_ptr(),
                                new_scales.data_ptr(), keys.data_ptr(), key_pos.data_ptr())
    return keys, key_pos


def index_scores(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str, tables: torch.Tensor, ratio: int,
                 block_size: int, q: torch.Tensor, w: torch.Tensor, n: int,
                 visible: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer scores ``Σ_h w_h relu(q_h · k_s)`` fp32 [B, c, n] of queries q fp32 [B, c, H, di] with head weights
    w fp32 [B, c, H] against entries 0 .. n-1 of each row's FP4 index keys (a pool as in :func:`fp4_gather`),
    decoded on the fly; with ``visible`` int64 [B, c], -inf from each query's visible count on
    (:func:`~deepseek_v41.model.indexer.mask_invisible`). Raises IndexError when an entry lies past its block
    table."""
    if not (tables.numel() and q.numel() and w.numel() and (visible is None or visible.numel())):
        _empty("index_scores", tables=tables, q=q, w=w, visible=visible)
    pages, per_page, half = codes.shape
    B, c, H, di = q.shape
    out = torch.empty((B, c, n), dtype=torch.float32)
    # A lookup table per query pays for itself over long rows (its size: see cpu_kernels.c dsv41_index_scores).
    lut = n >= INDEX_LUT_ROWS and H <= 64 and di // 2 * 256 * -(-H // 4) * 4 <= 1 << 16
    status = library().dsv41_index_scores(codes.data_ptr(), scales.data_ptr(), pages, per_page, 2 * half, block,
                                          FP4_FORMATS[fmt], tables.data_ptr(), tables.shape[1], ratio, block_size,
                                          q.data_ptr(), w.data_ptr(), B, c, H, n, int(lut), _ptr(visible),
                                          out.data_ptr())
    if status == -2:
        raise MemoryError("index_scores kernel: no memory for its scratch")
    if status != 0:
        raise IndexError("an entry index lies past its block table")
    return out


# ------------------------------------------------------------------------------------------ RoPE, norms, mHC
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """RoPE on the last ``r`` dims of fp32 or bf16 ``x`` [B, T, d] or [B, T, H, d] with phases ``cos`` / ``sin``
    fp32 [B, T, r] (:meth:`~deepseek_v41.model.rope.RotaryEmbedding.phases`), in x's dtype (bf16: rotated in fp32
    and rounded, as the torch code does); the bits of the torch code."""
    if not (x.numel() and cos.numel() and sin.numel()):
        _empty("rope", x=x, cos=cos, sin=sin)
    B, T = x.shape[:2]
    H = x.shape[2] if x.dim() == 4 else 1
    out = torch.empty_like(x)
    fn = library().dsv41_rope_bf16 if x.dtype == torch.bfloat16 else library().dsv41_rope
    fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), B * T, H, x.shape[-1], cos.shape[-1], -1 if inverse else 1,
       out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) (* weight)`` over the last dim of ``x`` [..., D] with weight [D] (or None), both
    fp32 or both bf16: in x's dtype (bf16: normalised in fp32 and rounded once)."""
    if not x.numel():
        _empty("rms_norm", x=x)
    D = x.shape[-1]
    out = torch.empty_like(x)
    if x.dtype == torch.bfloat16:
        scratch = torch.empty(D, dtype=torch.float32)
        library().dsv41_rms_norm_bf16(x.data_ptr(), x.numel() // max(D, 1), D, _ptr(weight), eps, scratch.data_ptr(),
                                      out.data_ptr())
    else:
        library().dsv41_rms_norm(x.data_ptr(), x.numel() // max(D, 1), D, _ptr(weight), eps, out.data_ptr())
    return out


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`deepseek_v41.model.hyper.hc_mix` for fp32 or bf16 streams [B, T, hc, D] (bf16 widened exactly, as
    ``upcast`` would) with fp32 ``fn`` / ``base`` / ``scale``: pre [B, T, hc], post [B, T, hc], comb [B, T, hc,
    hc] fp32. Raises ValueError for hc > MAX_HC."""
    if not streams.numel():
        _empty("hc_mix", streams=streams)
    if hc > MAX_HC:
        raise ValueError(f"hc_mix kernel takes hc <= {MAX_HC}, got {hc}")
    if streams.dtype not in _FP32_BF16 or not fn.dtype == base.dtype == scale.dtype == torch.float32:
        _refuse("hc_mix", (streams,), (fn, base, scale))
    B, T, _, D = streams.shape
    pre = torch.empty((B, T, hc), dtype=torch.float32)
    post = torch.empty((B, T, hc), dtype=torch.float32)
    comb = torch.empty((B, T, hc, hc), dtype=torch.float32)
    # Each token's normalized row: on the kernel's stack up to ROW_ON_STACK floats, else here.
    scratch = torch.empty((B * T, hc * D), dtype=torch.float32) if hc * D > ROW_ON_STACK else None
    library().dsv41_hc_mix(streams.data_ptr(), streams.dtype == torch.bfloat16, B * T, hc, D, fn.data_ptr(),
                           base.data_ptr(), scale.data_ptr(), norm_eps, hc_eps, iters, _ptr(scratch),
                           pre.data_ptr(), post.data_ptr(), comb.data_ptr())
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor | None = None,
                eps: float = 0.0) -> torch.Tensor:
    """``Σ_i w_i R_i`` of streams [B, T, hc, D] with fp32 weights [B, T, hc], RMS-normalised with
    ``norm_weight`` [D] when given: [B, T, D] in the streams' dtype. streams and norm_weight are both fp32 or
    both bf16; the sums are fp32 either way, bf16 rounded once at the end (as casting the fp32 result would).
    Raises ValueError for bf16 rows wider than ROW_ON_STACK or a norm weight of another dtype."""
    if not (streams.numel() and weights.numel()):
        _empty("hc_collapse", streams=streams, weights=weights)
    B, T, hc, D = streams.shape
    if (streams.dtype not in _FP32_BF16 or weights.dtype != torch.float32
            or (norm_weight is not None and norm_weight.dtype != streams.dtype)
            or (streams.dtype == torch.bfloat16 and D > ROW_ON_STACK)):
        _refuse("hc_collapse", (streams,), (weights,), norm_weight, D)
    out = torch.empty((B, T, D), dtype=streams.dtype)
    library().dsv41_hc_collapse(streams.data_ptr(), streams.dtype == torch.bfloat16, weights.data_ptr(), B * T, hc,
                                D, _ptr(norm_weight), eps, out.data_ptr())
    return out


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``R'_j = post_j y + Σ_i comb[i, j] R_i``: streams [B, T, hc, D] and y [B, T, D] both fp32 or both bf16,
    fp32 post [B, T, hc] and comb [B, T, hc, hc] -> [B, T, hc, D] in the streams' dtype (fp32 sums, bf16 rounded
    once at the end). Raises ValueError as :func:`hc_collapse` does."""
    if not (streams.numel() and y.numel() and post.numel() and comb.numel()):
        _empty("hc_expand", streams=streams, y=y, post=post, comb=comb)
    B, T, hc, D = streams.shape
    if (streams.dtype not in _FP32_BF16 or not post.dtype == comb.dtype == torch.float32 or y.dtype != streams.dtype
            or (streams.dtype == torch.bfloat16 and D > ROW_ON_STACK)):
        _refuse("hc_expand", (streams,), (post, comb), y, D)
    out = torch.empty_like(streams)
    library().dsv41_hc_expand(streams.data_ptr(), streams.dtype == torch.bfloat16, y.data_ptr(), post.data_ptr(),
                              comb.data_ptr(), B * T, hc, D, out.data_ptr())
    return out


# --------------------------------------------------------------------------- attention, MoE router, SwiGLU
def attend_few(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, window: int,
               selected: torch.Tensor | None, topk: torch.Tensor | None, sink: torch.Tensor,
               scale: float) -> torch.Tensor:
    """:func:`deepseek_v41.model.attention._attend_few` computed in fp32: q [B, T, H, d] fp32 or bf16 (widened
    exactly inside), q_pos int64 [B, T], fp32 keys [B, L, d], key_pos int64 [B, L], fp32 selected [B, T, k, d]
    with topk int64 [B, T, k] (or both None), fp32 sink [H] -> [B, T, H, d] in q's dtype (bf16 rounded once at
    the end, as casting the fp32 result would). Raises ValueError for more than MAX_ATTEND_HEADS heads, a sink
    that is not fp32, or bf16 queries wider than ROW_ON_STACK (H * d)."""
    if not (q.numel() and q_pos.numel() and keys.numel()
            and key_pos.numel() and (selected is None or selected.numel()) and (topk is None or topk.numel())):
        _empty("attend_few", q=q, q_pos=q_pos, keys=keys, key_pos=key_pos, selected=selected, topk=topk)
    B, T, H, d = q.shape
    L = keys.shape[1]
    k = 0 if topk is None else topk.shape[-1]
    out = torch.empty_like(q)
    if H > MAX_ATTEND_HEADS:
        raise ValueError(f"attend_few kernel takes at most {MAX_ATTEND_HEADS} heads, got {H}")
    if q.dtype not in _FP32_BF16 or keys.dtype != torch.float32 or (selected is not None
                                                                     and selected.dtype != torch.float32):
        _refuse("attend_few", (q,), (keys, selected))
    if sink.dtype != torch.float32 or (q.dtype == torch.bfloat16 and H * d > ROW_ON_STACK):
        raise ValueError(f"attend_few kernel: a {sink.dtype} sink beside {q.dtype} queries of {H} x {d} (an fp32 "
                         f"sink; bf16 queries up to H * d = {ROW_ON_STACK})")
    scratch = torch.empty((B * T, H * (L + k)), dtype=torch.float32)
    library().dsv41_attend_few(q.data_ptr(), q.dtype == torch.bfloat16, q_pos.data_ptr(), keys.data_ptr(),
                               key_pos.data_ptr(), B, T, H, d, L, window, _ptr(selected), _ptr(topk), k,
                               sink.data_ptr(), scale, scratch.data_ptr(), out.data_ptr())
    return out


def gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, norm_topk: bool,
         route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router of :class:`deepseek_v41.model.moe.Gate` for text tokens x [N, D] with weight [E, D] (each
    fp32, or bf16 widened exactly inside, as ``upcast`` would: bf16 x up to D = ROW_ON_STACK) and fp32 bias [E]:
    ``(indices int64 [N, k], weights fp32 [N, k])``. Raises ValueError for other dtypes or wider bf16 tokens,
    MemoryError when the bf16 weight cannot be widened."""
    if not x.numel():
        _empty("gate", x=x)
    N, D = x.shape
    E = weight.shape[0]
    if (x.dtype not in _FP32_BF16 or weight.dtype not in _FP32_BF16 or bias.dtype != torch.float32
            or (x.dtype == torch.bfloat16 and D > ROW_ON_STACK)):
        _refuse("gate", (x, weight), (bias,), row=D)
    indices = torch.empty((N, k), dtype=torch.int64)
    weights = torch.empty((N, k), dtype=torch.float32)
    scratch = torch.empty(E, dtype=torch.float32)
    if library().dsv41_gate(x.data_ptr(), x.dtype == torch.bfloat16, N, D, weight.data_ptr(),
                            weight.dtype == torch.bfloat16, E, bias.data_ptr(), k, int(norm_topk), route_scale,
                            scratch.data_ptr(), indices.data_ptr(), weights.data_ptr()) != 0:
        raise MemoryError("gate kernel: no memory to widen the bf16 weight")
    return indices, weights


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """:func:`deepseek_v41.model.moe.clamped_swiglu` of contiguous fp32 gate / up [N, inter] -> fp32 [N, inter]."""
    if not (gate.numel() and up.numel()):
        _empty("swiglu", gate=gate, up=up)
    N, inter = gate.shape
    out = torch.empty((N, inter), dtype=torch.float32)
    library().dsv41_swiglu(gate.data_ptr(), up.data_ptr(), N, inter, inter, limit, out.data_ptr())
    return out


def moe_bf16(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             limit: float, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Routed experts of fp32 or bf16 tokens x [N, D] routed by ``indices`` int64 / ``weights`` fp32 [N, k] with
    bf16 weights ``w13`` [E, 2 * inter, D] and ``w2`` [E, D, inter] (:meth:`deepseek_v41.model.moe.MoE.dispatch`),
    plus the shared expert when ``shared`` = its ``(w1 [s, D], w3 [s, D], w2 [D, s])`` weights (fp32 or bf16) are
    given: [N, D] summed in fp32, returned in ``out_dtype`` (fp32, or bf16 rounded once from the fp32 sums).
    Raises IndexError for an expert index outside [0, E)."""
    return _moe(x, indices, weights, 1, (w13, None, w2, None), w2.shape[0], w2.shape[2], limit, shared, out_dtype)


def moe_fp4(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, codes13: torch.Tensor,
            scales13: torch.Tensor, codes2: torch.Tensor, scales2: torch.Tensor, limit: float,
            shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`moe_bf16` with the routed experts in the checkpoint's FP4 format (MODEL_REFERENCE.md §4): E2M1 codes
    uint8 ``codes13`` [E, 2 * inter, D / 2] / ``codes2`` [E, D, inter / 2] with UE8M0 scales per 32 weights
    ``scales13`` [E, 2 * inter, D / 32] / ``scales2`` [E, D, inter / 32] (D and inter multiples of 32): a quarter of
    the bytes bf16 weights take, and the same result when they hold the same values. Raises ValueError when D or
    inter is not a multiple of 32 (the scales would be misread)."""
    D, inter = x.shape[1], 2 * codes2.shape[2]
    if D % 32 or inter % 32:
        raise ValueError(f"moe_fp4 takes widths D and inter that are multiples of 32, got D={D}, inter={inter}")
    return _moe(x, indices, weights, 2, (codes13, scales13, codes2, scales2), codes2.shape[0], inter, limit, shared,
                out_dtype)


def _moe(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, kind: int, routed: tuple, E: int,
         inter: int, limit: float, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
         out_dtype: torch.dtype) -> torch.Tensor:
    if not (x.numel() and indices.numel() and weights.numel()):
        _empty("moe", x=x, indices=indices, weights=weights)
    N, D = x.shape
    k = indices.shape[1]
    s_inter = shared[0].shape[0] if shared is not None else 0
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moe kernel: out_dtype fp32 or bf16, got {out_dtype}")
    out = torch.empty((N, D), dtype=out_dtype)
    s1, s3, s2 = (None, None, None) if shared is None else (t.data_ptr() for t in shared)
    s_bf16 = shared is not None and shared[0].dtype == torch.bfloat16
    w13, sc13, w2, sc2 = (_ptr(t) for t in routed)
    status = library().dsv41_moe(x.data_ptr(), x.dtype == torch.bfloat16, N, D, indices.data_ptr(),
                                 weights.data_ptr(), k, kind, w13, sc13, w2, sc2, E, inter, limit, s1, s3, s2, s_bf16,
                                 s_inter, out.data_ptr(), out_dtype == torch.bfloat16)
    if status == -2:
        raise MemoryError("moe kernel: no memory for its scratch")
    if status != 0:
        raise IndexError(f"an expert index lies outside [0, {E})")
    return out


# ---------------------------------------------------------------------------------------- dense projections
GEMV_MACS = 1 << 19  # up to this many multiply-adds (tokens x weights) a bf16 projection takes the kernel


def linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight)`` (no bias) for a few tokens: x [..., K] and weight [O, K], each
    fp32 or bf16, summed in fp32 and returned in x's dtype (bf16 rounded to nearest even, as ATen's bf16 GEMM
    rounds its fp32 sums): [..., O]. ``groups`` G > 1: x [..., G * K_g] and weight [G * O_g, K_g], group g's
    outputs from group g's inputs (``GroupedLinear``). ATen's bf16 GEMV costs ~20 µs at decode size here against
    a few µs for this (bench/README.md)."""
    if not (x.numel() and weight.numel()):
        _empty("linear", x=x, weight=weight)
    K = x.shape[-1] // groups
    O = weight.shape[0] // groups
    N = x.shape[:-1].numel()  # not x.numel() // K: that is 0 for K = 0, leaving the output unwritten
    out = torch.empty((*x.shape[:-1], groups * O), dtype=x.dtype)
    if library().dsv41_linear(x.data_ptr(), x.dtype == torch.bfloat16, N, groups, K, weight.data_ptr(),
                              weight.dtype == torch.bfloat16, O, out.data_ptr()) != 0:
        raise MemoryError("linear kernel: no memory for its scratch")
    return out


def attn_prologue(x: torch.Tensor, wq_a: torch.Tensor, q_norm: torch.Tensor, q_eps: float, wq_b: torch.Tensor,
                  heads: int, wkv: torch.Tensor, kv_norm: torch.Tensor, kv_eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query and window-KV side of :meth:`deepseek_v41.model.attention.Attention.forward` in one call: x [B, T,
    D] and the weights (``wq_a`` [qr, D], ``q_norm`` [qr], ``wq_b`` [H * d, qr], ``wkv`` [d, D], ``kv_norm`` [d])
    all fp32 or all bf16, RoPE phases ``cos`` / ``sin`` fp32 [B, T, r] -> ``(q_lat [B, T, qr], q [B, T, H, d], kv
    [B, T, d])`` in x's dtype (bf16: rounded where the torch code rounds)."""
    if not (x.numel() and cos.numel() and sin.numel()):
        _empty("attn_prologue", x=x, cos=cos, sin=sin)
    B, T, D = x.shape
    qr, d = wq_a.shape[0], wkv.shape[0]
    q_lat = torch.empty((B, T, qr), dtype=x.dtype)
    q = torch.empty((B, T, heads, d), dtype=x.dtype)
    kv = torch.empty((B, T, d), dtype=x.dtype)
    if library().dsv41_attn_prologue(x.data_ptr(), x.dtype == torch.bfloat16, B * T, D, wq_a.data_ptr(), qr,
                                     q_norm.data_ptr(), q_eps, wq_b.data_ptr(), heads, d, wkv.data_ptr(),
                                     kv_norm.data_ptr(), kv_eps, cos.data_ptr(), sin.data_ptr(), cos.shape[-1],
                                     q_lat.data_ptr(), q.data_ptr(), kv.data_ptr()) != 0:
        raise MemoryError("attn_prologue kernel: no memory for its scratch")
    return q_lat, q, kv


def attn_epilogue(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, groups: int,
                  wo_b: torch.Tensor) -> torch.Tensor:
    """``wo_b(wo_a(inverse RoPE of o))`` of :meth:`deepseek_v41.model.attention.Attention.forward` in one call: o
    [B, T, H, d], ``wo_a`` [G * rank, H * d / G] (grouped), ``wo_b`` [D, G * rank], all fp32 or all bf16, phases
    as in :func:`attn_prologue` -> [B, T, D] in o's dtype."""
    if not (o.numel() and cos.numel() and sin.numel()):
        _empty("attn_epilogue", o=o, cos=cos, sin=sin)
    B, T, H, d = o.shape
    D, rank = wo_b.shape[0], wo_a.shape[0] // groups
    y = torch.empty((B, T, D), dtype=o.dtype)
    if library().dsv41_attn_epilogue(o.data_ptr(), o.dtype == torch.bfloat16, B * T, H, d, cos.data_ptr(),
                                     sin.data_ptr(), cos.shape[-1], wo_a.data_ptr(), groups, rank, wo_b.data_ptr(),
                                     D, y.data_ptr()) != 0:
        raise MemoryError("attn_epilogue kernel: no memory for its scratch")
    return y


def compress(x: torch.Tensor, positions: torch.Tensor, ratio: int, pending: tuple[torch.Tensor, torch.Tensor] | None,
             phases: tuple[torch.Tensor, torch.Tensor] | None, wkv: torch.Tensor, wgate: torch.Tensor | None,
             norm: torch.Tensor, eps: float, wk: torch.Tensor, k_norm: torch.Tensor, k_eps: float
             ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None,
                        torch.Tensor | None]:
    """:meth:`deepseek_v41.model.attention.Attention.compress` for a few tokens in one call (the compressor of
    MODEL_REFERENCE.md §3.8, the entry RoPE and the index keys of §3.9): x [B, T, D] (T >= 1) at positions int64
    [B, T] (each row consecutive); ``wkv`` / ``wgate`` (ratio 2; None for ratio 1) [d, D], ``norm`` [d], ``wk``
    [di, d], ``k_norm`` [di], all of x's dtype (fp32 or bf16); ``pending``: the open pairs' ``(kv, score)`` fp32
    [B, d] each (rows may lie apart, elements adjacent), or None (zeros). ``phases``: RoPE ``(cos, sin)`` fp32 [B,
    T, r] at the positions (ratio 1) or [B, T + 1, r] at positions ``start - 1 .. start + T - 1`` of each row
    (ratio 2), r <= min(d, di) even; None skips the entries and keys (no row completes one).

    Returns ``(latent [B, G, d], group int64 [B, G], new_pending, entries [B, G, d], index_keys [B, G, di])``: the
    :class:`~deepseek_v41.model.compressor.Compressor`'s three outputs (ratio 1: G = T, group = ``positions``,
    new_pending None; ratio 2: G = (T + 1) // 2 and new_pending fp32 [B, d] each), then ``rope(latent)`` and
    ``rope(k_norm(wk(latent)))`` at the entry positions ``group.clamp(min=0) * ratio`` (None without
    ``phases``), in x's dtype. bf16: the same bits as the module calls wherever those run their projections in
    this library's GEMV (ratio 1's ``wkv``, ``wk``), else to rounding. Raises MemoryError when the scratch
    cannot be had."""
    if not (x.numel() and positions.numel()):
        _empty("compress", x=x, positions=positions)
    B, T, D = x.shape
    d, di = wkv.shape[0], wk.shape[0]
    G = (T + 1) // 2 if ratio == 2 else T
    latent = torch.empty((B, G, d), dtype=x.dtype)
    group = torch.empty((B, G), dtype=torch.int64) if ratio == 2 else None  # ratio 1: the positions
    new_pending = torch.empty((B, 2, d), dtype=torch.float32) if ratio == 2 else None
    entries = keys = None
    if phases is not None:
        entries, keys = torch.empty((B, G, d), dtype=x.dtype), torch.empty((B, G, di), dtype=x.dtype)
    pk, ps = (None, None) if pending is None else pending
    cos, sin = (None, None) if phases is None else phases
    if library().dsv41_compress(x.data_ptr(), x.dtype == torch.bfloat16, B, T, D, positions.data_ptr(), ratio,
                                wkv.data_ptr(), _ptr(wgate), d, norm.data_ptr(), eps, _ptr(pk), _ptr(ps),
                                0 if pk is None else pk.stride(0), _ptr(cos), _ptr(sin), 0 if cos is None else
                                cos.shape[-1], wk.data_ptr(), di, k_norm.data_ptr(), k_eps, latent.data_ptr(),
                                _ptr(group), _ptr(new_pending), _ptr(entries), _ptr(keys)) != 0:
        raise MemoryError("compress kernel: no memory for its scratch")
    if ratio == 1:
        return latent, positions, None, entries, keys
    return latent, group, (new_pending[:, 0], new_pending[:, 1]), entries, keys


def indexer_queries(q_lat: torch.Tensor, x: torch.Tensor, wq_b: torch.Tensor, heads: int, weights_proj: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, fake_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`deepseek_v41.model.indexer.Indexer.queries` in one call: q_lat [B, T, qr], x [B, T, D] and the
    weights (``wq_b`` [heads * di, qr], ``weights_proj`` [heads, D]) all fp32 or all bf16, RoPE phases ``cos`` /
    ``sin`` fp32 [B, T, r] (r even, <= di; ``fake_quant``: di a multiple of 32) -> ``(q [B, T, heads, di], w [B, T,
    heads])`` fp32. RoPE and the FP4 (UE8M0 / 32) fake quant give the torch code's bits; the projections are rounded
    as in :func:`attn_prologue`, and w is scaled by ``di ** -0.5 * heads ** -0.5`` after them (MODEL_REFERENCE.md
    §3.9). Raises MemoryError when the kernel's scratch cannot be allocated."""
    if not (q_lat.numel() and x.numel() and cos.numel() and sin.numel()):
        _empty("indexer_queries", q_lat=q_lat, x=x, cos=cos, sin=sin)
    B, T, qr = q_lat.shape
    di = wq_b.shape[0] // heads
    q = torch.empty((B, T, heads, di), dtype=torch.float32)
    w = torch.empty((B, T, heads), dtype=torch.float32)
    if library().dsv41_indexer_queries(q_lat.data_ptr(), x.data_ptr(), x.dtype == torch.bfloat16, B * T, qr,
                                       x.shape[-1], wq_b.data_ptr(), heads, di, weights_proj.data_ptr(),
                                       cos.data_ptr(), sin.data_ptr(), cos.shape[-1], int(fake_quant),
                                       di ** -0.5 * heads ** -0.5, q.data_ptr(), w.data_ptr()) != 0:
        raise MemoryError("indexer_queries kernel: no memory for its scratch")
    return q, w


# ------------------------------------------------------------------------------------------------ indexer top-k
def topk_set(scores: torch.Tensor, k: int, drop_neg_inf: bool = False) -> torch.Tensor | None:
    """:func:`deepseek_v41.model.indexer.topk_set` of fp32 ``scores`` [..., N]: indices int64 [..., k] of the k
    largest, ascending, ties at the k-th value to the lowest indices (exactly the torch code's result);
    ``drop_neg_inf``: -1 where the picked score is -inf (``topk_entries``). None when a row holds a NaN or
    k > N (the caller takes the torch code, which ranks NaN first / raises)."""
    if not scores.numel():
        _empty("topk_set", scores=scores)
    N = scores.shape[-1]
    out = torch.empty((*scores.shape[:-1], k), dtype=torch.int64)
    rows = scores.numel() // max(N, 1)
    heap = torch.empty((rows, max(k, 1)), dtype=torch.float32)
    status = library().dsv41_topk_set(scores.data_ptr(), rows, N, k, int(drop_neg_inf),
                                      heap.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.max(dim=-1).indices`` of contiguous fp32 rows x [..., V] (V >= 1): int64 [...], the first index of each
    row's largest value, NaN counting as the largest; exactly torch's indices. ATen's takes ~40-90 µs for 8 x 8192
    on one thread (its max-with-index reduction is not vectorized), this ~15 with its Python."""
    if not x.numel():
        _empty("argmax", x=x)
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    library().dsv41_argmax(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr())
    return out


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, block: int, keep: int) -> torch.Tensor | None:
    """:func:`deepseek_v41.model.indexer.candidate_blocks` of fp32 ``scores`` [B, c, N] (-inf where not visible)
    with visible counts int64 [B, c]: the candidate pool's block mask bool [B, c, nblocks], exactly the torch
    code's. None when a row holds a NaN (the caller takes the torch code)."""
    if not (scores.numel() and visible.numel()):
        _empty("candidate_blocks", scores=scores, visible=visible)
    B, c, N = scores.shape
    mask = torch.empty((B, c, -(-N // block)), dtype=torch.bool)
    status = library().dsv41_candidate_blocks(scores.data_ptr(), visible.data_ptr(), B * c, N, block, keep,
                                              mask.data_ptr())
    if status == -2:
        raise MemoryError("candidate_blocks kernel: no memory for its scratch")
    return mask if status == 0 else None


def pool_select(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str, tables: torch.Tensor, ratio: int,
                block_size: int, q: torch.Tensor, w: torch.Tensor, n: int, blocks: torch.Tensor, pool_block: int,
                keep: int, visible: torch.Tensor, k: int) -> torch.Tensor | None:
    """A Reindex layer's picks inside its candidate pool (:meth:`deepseek_v41.model.attention.Attention.select`):
    for queries q fp32 [B, c, H, di] with head weights w fp32 [B, c, H], the entries of the pool given by the
    block mask ``blocks`` bool [B, c, nblocks] (blocks of ``pool_block`` entries, at most ``keep`` of them:
    :func:`~deepseek_v41.model.indexer.pool_entries`) that lie below ``n`` and below the query's visible count
    int64 [B, c], scored straight from the FP4 index keys (as :func:`index_scores` scores one query), and their
    top ``k`` (<= min(keep, nblocks) * pool_block) by the top-k rule: global entry ids int64 [B, c, k], ascending
    among the pool's positions, -1 where fewer are valid. None when a score is NaN (the caller takes the torch
    code). Raises IndexError as :func:`fp4_gather`."""
    if not (tables.numel() and q.numel() and w.numel() and blocks.numel() and visible.numel()):
        _empty("pool_select", tables=tables, q=q, w=w, blocks=blocks, visible=visible)
    pages, per_page, half = codes.shape
    B, c, H, _ = q.shape
    out = torch.empty((B, c, k), dtype=torch.int64)
    status = library().dsv41_pool_select(codes.data_ptr(), scales.data_ptr(), pages, per_page, 2 * half, block,
                                         FP4_FORMATS[fmt], tables.data_ptr(), tables.shape[1], ratio, block_size,
                                         q.data_ptr(), w.data_ptr(), B, c, H, n, blocks.data_ptr(), blocks.shape[-1],
                                         pool_block, keep, visible.data_ptr(), k, out.data_ptr())
    if status == -1:
        raise IndexError("an entry index lies past its block table")
    if status == -2:
        raise MemoryError("pool_select kernel: no memory for its scratch")
    if status == -4:
        raise ValueError(f"k = {k} exceeds the pool's {min(keep, blocks.shape[-1]) * pool_block} entries")
    return out if status == 0 else None
