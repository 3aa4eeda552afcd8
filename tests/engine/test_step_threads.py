"""Engine steps run on the cores other processes leave free (issue 22; model_runner.step_threads over
kernels/cpu_share.py): with torch at two threads, a mocked one-CPU affinity or a reading of one busy core of two
makes every forward of a step (prefill and decode) run torch and the kernels' pool on one thread, and torch's count
comes back after the step; on a quiet reading the steps keep torch's count. No timing: the counts are read inside
the forwards."""

from __future__ import annotations

import pytest
import torch

from deepseek_v41 import kernels
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.model_runner import step_threads
from deepseek_v41.kernels import cpu_share

PROMPT = [5, 17, 33, 2, 9, 41, 7, 100, 3, 12]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)
    kernels.set_threads(1)


def threads_in_forwards(model, steps: int = 4) -> list[tuple[int, int, int]]:
    """(tokens, torch threads, pool threads) seen by the first layer of each forward of a short generation."""
    seen = []
    hook = model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append((args[0].shape[1], torch.get_num_threads(), kernels.threads())))
    try:
        llm = LLM(model, max_model_len=256, enable_prefix_caching=False)
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    finally:
        hook.remove()
    return seen


class Busy:
    """A /proc/stat of 2 CPUs, this process's CPU time and a clock, all moved by hand."""

    def __init__(self):
        self.now, self.own, self.busy = 0.0, 0.0, [0.0, 0.0]

    def share(self) -> cpu_share.CpuShare:
        tick = cpu_share._TICK
        return cpu_share.CpuShare(
            stat=lambda: "".join(f"cpu{c} {round(b * tick)} 0 0 0 0 0 0 0 0 0\n" for c, b in enumerate(self.busy)),
            own=lambda: self.own, clock=lambda: self.now, cpus=lambda: frozenset({0, 1}), quota=lambda: None)

    def second(self, others: float) -> None:
        """One second in which this process used one core and others ``others`` cores."""
        self.now += 1.0
        self.own += 1.0
        self.busy[0] += 1.0
        self.busy[1] += others


def test_a_one_cpu_affinity_runs_every_forward_on_one_thread(model32, two_threads, monkeypatch):
    monkeypatch.setattr(cpu_share.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(cpu_share, "SHARE", cpu_share.CpuShare())
    seen = threads_in_forwards(model32)
    assert seen[0][0] == len(PROMPT) and len(seen) >= 3  # the prefill, then decode forwards
    assert {(torch_threads, pool) for _, torch_threads, pool in seen} == {(1, 1)}
    assert torch.get_num_threads() == 2  # the ceiling comes back after each step


@pytest.mark.parametrize(("others", "want"), [(1.0, 1), (0.1, 2)])
def test_other_processes_busy_cores_are_left_to_them(model32, two_threads, monkeypatch, others, want):
    busy = Busy()
    share = busy.share()
    share.threads(2)  # the first reading
    busy.second(others)
    monkeypatch.setattr(cpu_share, "SHARE", share)
    seen = threads_in_forwards(model32)
    assert {t for _, t, _ in seen[:1]} == {want}  # the prefill on torch's threads
    if kernels.library() is not None:  # decode: torch on one thread, the pool on the step's count
        assert {(t, pool) for _, t, pool in seen[1:]} == {(1, want)}
    assert torch.get_num_threads() == 2


def test_step_threads_lowers_and_restores_and_leaves_other_devices(two_threads):
    class One:
        def threads(self, ceiling):
            return 1

    kernels.set_threads(2)
    with step_threads(torch.device("cpu"), One()):
        assert torch.get_num_threads() == 1 and kernels.threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(KeyError), step_threads(torch.device("cpu"), One()):
        raise KeyError("boom")
    assert torch.get_num_threads() == 2
    with step_threads(torch.device("meta"), One()):
        assert torch.get_num_threads() == 2
