"""kernels/host_memory.py: glibc's thresholds fixed once for a CPU engine, the user's malloc settings respected.

Each case runs in a fresh interpreter: the thresholds are process-wide and glibc moves them as blocks are freed.
Whether a block came from mmap is read from ``mallinfo2().hblkhd`` (bytes in mmapped blocks), so the test sees
the allocator's decision itself, not a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepseek_v41.kernels import host_memory

CHECKPOINT = str(Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny")

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")

CHILD = r"""
import ctypes, json, sys
import torch
from deepseek_v41.kernels.host_memory import keep_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
outcome = keep_freed_memory() if sys.argv[1] == "tune" else "untouched"
again = keep_freed_memory() if sys.argv[1] == "tune" else "untouched"
before = libc.mallinfo2().hblkhd
x = torch.empty(6 << 20, dtype=torch.uint8)  # 6 MiB: above glibc's first mmap threshold, below the set one
x.fill_(1)
mapped = libc.mallinfo2().hblkhd - before
del x
free_heap = libc.mallinfo2().fordblks
print(json.dumps({"outcome": outcome, "again": again, "mapped": mapped, "free_heap": free_heap}))
"""


def run_child(mode: str, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    full.pop(host_memory.SWITCH, None)
    full.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt / mallinfo2 are glibc's")
def test_set_thresholds_keep_a_large_block_on_the_heap():
    """Untouched, glibc maps a fresh 6 MiB block (and unmaps it when freed); after keep_freed_memory() the block
    comes from the heap and stays there, free, for the next step."""
    plain = run_child("plain")
    assert plain["mapped"] >= 6 << 20
    tuned = run_child("tune")
    assert tuned["outcome"] == tuned["again"] == "set"
    assert tuned["mapped"] == 0
    assert tuned["free_heap"] >= 6 << 20


@pytest.mark.skipif(not GLIBC, reason="mallopt / mallinfo2 are glibc's")
@pytest.mark.parametrize("env, outcome", [
    ({"DSV41_KEEP_FREED_MEMORY": "0"}, "off"),
    ({"MALLOC_TRIM_THRESHOLD_": "1048576"}, "user"),
    ({"MALLOC_ARENA_MAX": "2"}, "user"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, "user"),
])
def test_the_users_choice_stands(env, outcome):
    """Switched off, or with a malloc tunable in the environment, nothing is set: the block is mapped as glibc
    (or the user's setting) decides."""
    got = run_child("tune", **env)
    assert got["outcome"] == got["again"] == outcome
    assert got["mapped"] >= 6 << 20


@pytest.mark.parametrize("outcome, released", [("set", 1), ("off", 0), ("user", 0), ("not glibc", 0)])
def test_a_cpu_engine_sets_them_once(monkeypatch, outcome, released):
    """Building a CPU engine calls keep_freed_memory() from its model runner, and hands the freed heap back only
    where it set the thresholds (switched off or set by the user, glibc is left alone)."""
    from deepseek_v41.engine import LLM, model_runner

    calls, releases = [], []
    monkeypatch.setattr(model_runner, "keep_freed_memory", lambda: calls.append(1) or outcome)
    monkeypatch.setattr(model_runner, "release_freed_memory", lambda: releases.append(1) or True)
    LLM(CHECKPOINT, dtype="float32", max_model_len=64, enable_prefix_caching=False)
    assert calls == [1] and len(releases) == released


RELEASE_CHILD = r"""
import json
import torch
from deepseek_v41.kernels.host_memory import keep_freed_memory, release_freed_memory

def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

keep_freed_memory()
blocks = [torch.ones(1 << 18) for _ in range(200)]  # 200 x 1 MiB on the heap
keep = blocks[-1]
del blocks[:-1]  # freed, below the last block: glibc keeps them (not at the heap's top)
before = resident_mb()
released = release_freed_memory()
print(json.dumps({"released": released, "dropped_mb": before - resident_mb()}))
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_release_hands_freed_heap_back():
    """After loading, the model runner hands the heap's free pages back (malloc_trim): ~199 MiB freed below a live
    block leave the resident set."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["released"] is True
    assert got["dropped_mb"] > 150
