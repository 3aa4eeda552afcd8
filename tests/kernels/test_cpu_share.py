"""The threads an engine step may use on a shared machine (kernels/cpu_share.py): the CPUs of the affinity mask,
capped by a cgroup quota (v1 and v2 files written here), less the cores other processes kept busy per
``/proc/stat`` (text written here, with fake clocks): arithmetic from the inputs, no timing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deepseek_v41.kernels import cpu_share
from deepseek_v41.kernels.cpu_share import CpuShare, available_cpus, busy_seconds, cgroup_quota

TICK = cpu_share._TICK  # /proc/stat ticks per second


def stat_text(busy: dict[int, float], idle: float = 1000.0) -> str:
    """/proc/stat text with ``busy[cpu]`` seconds of busy time per CPU, spread over user, system, irq, softirq
    and steal (what counts), and idle / iowait / guest fields that must not count."""
    lines = ["cpu  1 2 3 4 5 6 7 8 9 10"]
    for cpu, seconds in sorted(busy.items()):
        ticks = round(seconds * TICK)
        user, system, irq, softirq = ticks // 2, ticks // 4, ticks // 16, ticks // 16
        steal = ticks - user - system - irq - softirq
        lines.append(f"cpu{cpu} {user} 0 {system} {round(idle * TICK)} 77 {irq} {softirq} {steal} 55 0")
    return "\n".join([*lines, "intr 1 2 3", "ctxt 4", "procs_running 9"]) + "\n"


def test_busy_seconds_sums_the_busy_fields_of_the_cpus_asked_for():
    text = stat_text({0: 10.0, 1: 2.5, 2: 100.0})
    assert busy_seconds(text, frozenset({0, 1})) == pytest.approx(12.5)
    assert busy_seconds(text, frozenset({2})) == pytest.approx(100.0)
    assert busy_seconds(text, frozenset({0, 5})) is None  # a CPU without a line
    assert busy_seconds("cpu0 1 2\n", frozenset({0})) is None  # a malformed line


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_smallest_along_the_path(tmp_path):
    root = tmp_path / "cg"
    write(root / "cgroup.controllers", "cpu memory\n")
    write(root / "a" / "cpu.max", "max 100000\n")
    write(root / "a" / "b" / "cpu.max", "150000 100000\n")
    write(root / "a" / "b" / "c" / "cpu.max", "max 100000\n")
    write(tmp_path / "self", "0::/a/b/c\n")
    assert cgroup_quota(tmp_path / "self", root) == pytest.approx(1.5)
    write(root / "a" / "cpu.max", "50000 100000\n")  # a parent's smaller quota wins
    assert cgroup_quota(tmp_path / "self", root) == pytest.approx(0.5)
    write(tmp_path / "self", "0::/not/here\n")  # a container that sees its own cgroup as the root
    write(root / "cpu.max", "300000 100000\n")
    assert cgroup_quota(tmp_path / "self", root) == pytest.approx(3.0)
    write(root / "cpu.max", "max 100000\n")
    assert cgroup_quota(tmp_path / "self", root) is None


def test_cgroup_v1_and_hybrid_quotas(tmp_path):
    root = tmp_path / "cg"
    write(root / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us", "250000\n")
    write(root / "cpu,cpuacct" / "job" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")  # the root: no quota
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "self", "4:memory:/job\n2:cpu,cpuacct:/job\n0::/\n")
    assert cgroup_quota(tmp_path / "self", root) == pytest.approx(2.5)
    write(root / "unified" / "cpu.max", "100000 100000\n")  # hybrid: v2 mounted under unified/
    assert cgroup_quota(tmp_path / "self", root) == pytest.approx(1.0)
    write(tmp_path / "self", "2:cpu,cpuacct:/\n")
    assert cgroup_quota(tmp_path / "self", root) is None
    assert cgroup_quota(tmp_path / "missing", root) is None


def test_available_cpus_is_the_affinity_capped_by_the_quota_rounded_up():
    assert available_cpus({0, 1, 2, 3}, quota=1.5) == 2
    assert available_cpus({0, 1, 2, 3}, quota=8.0) == 4
    assert available_cpus({3}, quota=0.2) == 1
    assert available_cpus({0, 1, 2}, quota=math.inf) == 3


class Machine:
    """Fake inputs of a CpuShare: the wall clock, this process's CPU seconds, each CPU's busy seconds."""

    def __init__(self, cpus=(0, 1, 2, 3), affinity=None, quota=None):
        self.now, self.own, self.quota = 100.0, 5.0, quota
        self.busy = {c: 50.0 for c in cpus}
        self.affinity = frozenset(cpus if affinity is None else affinity)
        self.reads = 0

    def stat(self) -> str:
        self.reads += 1
        return stat_text(self.busy)

    def share(self) -> CpuShare:
        return CpuShare(stat=self.stat, own=lambda: self.own, clock=lambda: self.now, cpus=lambda: self.affinity,
                        quota=lambda: self.quota)

    def run(self, seconds: float, ours: float, others: dict[int, float]) -> None:
        """``seconds`` pass; this process uses ``ours`` cores (on CPU 0 and up), others ``others[cpu]``."""
        self.now += seconds
        self.own += ours * seconds
        left = ours * seconds
        for cpu in sorted(self.busy):
            mine = min(left, seconds)
            left -= mine
            self.busy[cpu] += mine + others.get(cpu, 0.0) * seconds


def test_the_first_reading_gives_the_available_cpus_then_others_busy_cores_are_taken():
    m = Machine()
    share = m.share()
    assert share.threads(8) == 4 and share.threads(2) == 2  # nothing known yet: the CPUs (up to the ceiling)
    m.run(1.0, ours=2.0, others={3: 1.0})  # one busy process
    assert share.threads(8) == 3 and share.others == pytest.approx(1.0)
    m.run(1.0, ours=2.0, others={2: 0.65, 3: 0.65})  # two processes sharing cores with ours: 1.3 cores
    assert share.threads(8) == 3
    m.run(1.0, ours=2.0, others={2: 0.9, 3: 0.9})
    assert share.threads(8) == 2
    m.run(1.0, ours=2.0, others={3: 0.3})  # a light background process takes no core
    assert share.threads(8) == 4
    m.run(1.0, ours=4.0, others={c: 1.0 for c in range(4)})  # all busy: still one thread
    assert share.threads(8) == 1
    assert share.threads(1) == 1


def test_readings_come_at_most_every_interval():
    m = Machine()
    share = m.share()
    share.threads(4)
    m.run(cpu_share.INTERVAL * 0.6, ours=1.0, others={1: 1.0, 2: 1.0})
    assert share.threads(4) == 4 and m.reads == 1  # too soon: the last reading stands
    m.run(cpu_share.INTERVAL * 0.6, ours=1.0, others={1: 1.0, 2: 1.0})
    assert share.threads(4) == 2 and m.reads == 2  # over the whole interval since the last reading


def test_only_the_affinity_cpus_count_and_the_quota_caps():
    m = Machine(affinity=(0, 1))
    share = m.share()
    assert share.threads(8) == 2
    m.run(1.0, ours=1.0, others={2: 1.0, 3: 1.0})  # busy CPUs this process may not use
    assert share.threads(8) == 2
    m.affinity = frozenset({0})  # the mask changed (taskset): a new first reading
    assert share.threads(8) == 2  # within the interval the last reading stands
    m.run(1.0, ours=1.0, others={})
    assert share.threads(8) == 1
    q = Machine(quota=2.5)
    assert q.share().threads(8) == 3


def test_an_unreadable_proc_stat_leaves_the_available_cpus():
    m = Machine(quota=3.0)

    def broken() -> str:
        raise OSError("no /proc")

    share = CpuShare(stat=broken, own=lambda: m.own, clock=lambda: m.now, cpus=lambda: m.affinity,
                     quota=lambda: m.quota)
    assert share.threads(8) == 3
    m.run(1.0, ours=1.0, others={1: 1.0, 2: 1.0, 3: 1.0})
    assert share.threads(8) == 3


def test_the_process_share_reads_this_machine():
    """The process-wide reading works on this host: at least one thread, at most the ceiling and the CPUs."""
    share = CpuShare()
    for ceiling in (1, 2, 64):
        assert 1 <= share.threads(ceiling) <= min(ceiling, available_cpus())


def test_the_quota_is_read_again_every_quota_every_readings():
    m = Machine(quota=3.0)
    reads = []
    share = CpuShare(stat=m.stat, own=lambda: m.own, clock=lambda: m.now, cpus=lambda: m.affinity,
                     quota=lambda: reads.append(m.quota) or m.quota)
    for _ in range(cpu_share.QUOTA_EVERY + 1):
        share.threads(8)
        m.run(1.0, ours=1.0, others={})
    assert len(reads) == 2 and share.threads(8) == 3
    m.quota = 1.0  # lowered: seen at the next read of the files
    for _ in range(cpu_share.QUOTA_EVERY):
        share.threads(8)
        m.run(1.0, ours=1.0, others={})
    assert len(reads) == 3 and share.threads(8) == 1
