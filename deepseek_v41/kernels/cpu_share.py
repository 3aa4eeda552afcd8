"""How many threads an engine step may use on a machine other processes share (issue 22).

torch's intra-op threads (libgomp's OpenMP) split every op's work evenly over their threads and wait for the
slowest at the op's end. When another CPU-bound process holds one of the cores, the thread queued behind it waits
for a time slice (milliseconds) at each of the thousands of ops of a step: a 1K prefill of the bench-8m model ran
~40x slower on 2 cores beside one busy process, and decode ~5x, while one thread fewer runs at the speed of the
core that is left. So each engine step runs on the cores that are actually free (engine/model_runner.py
``step_threads``):

- the CPUs this process may run on: its affinity mask (``os.sched_getaffinity``), capped by the cgroup's CPU quota
  (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the smallest along the cgroup's path, rounded
  up as the JVM and Go do);
- less the cores other processes kept busy over the last reading: the busy time ``/proc/stat`` counts on those
  CPUs (user, nice, system, irq, softirq and a VM's steal) less this process's own CPU time, per second of wall
  time, read at most every :data:`INTERVAL` seconds at a step's start (~50-200 µs a reading; the quota every
  :data:`QUOTA_EVERY` readings); a core counts as taken from :data:`TAKEN` of it on (a busy process that shares
  the machine with two of our threads gets about 2/3 of a core, a background process that wakes now and then
  much less);
- at least one thread, and at most the count torch was given (``OMP_NUM_THREADS``, ``torch.set_num_threads``,
  ``dsv41 serve --threads``), which stays the ceiling.

Two engines that share a machine each see the other's threads and settle on half the cores each; when one goes
idle the other takes the cores back at its next reading. Where ``/proc/stat`` cannot be read (not Linux) the count
is the available CPUs. Busy processes inside the same cgroup quota are not told apart from a host's load: the quota
caps the count, the host's per-CPU load lowers it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

INTERVAL = 0.2  # seconds between readings: ~50 scheduler ticks of 2 CPUs at HZ=250, enough to tell 1 busy core
QUOTA_EVERY = 50  # readings between two reads of the cgroup quota (~10 s)
TAKEN = 0.4  # busy cores of other processes from which one core counts as taken (then 1.4, 2.4, ...)
PROC_STAT = Path("/proc/stat")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# /proc/stat per-CPU fields after the name: user nice system idle iowait irq softirq steal guest guest_nice
# (guest time is inside user); busy = all but idle and iowait.
_BUSY = (0, 1, 2, 5, 6, 7)
try:
    _TICK = os.sysconf("SC_CLK_TCK")  # /proc/stat's unit: 1 / USER_HZ seconds
except (AttributeError, ValueError, OSError):
    _TICK = 100


def affinity() -> frozenset[int]:
    """The CPUs this process may run on (all CPUs where the platform has no affinity call)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def cgroup_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """This process's cgroup CPU quota in cores: the smallest quota / period along its cgroup's path (cgroup v2
    ``cpu.max``, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None when no quota applies or the files
    cannot be read. ``proc_cgroup`` lists the process's cgroups (``/proc/self/cgroup``), ``root`` is where the
    hierarchies are mounted."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2 (unified; under root/unified on a hybrid host)
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            quotas += _along(base, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for name in (controllers, "cpu", "cpu,cpuacct"):
                if (root / name).is_dir():
                    quotas += _along(root / name, path, _v1_quota)
                    break
    return min(quotas) if quotas else None


def _along(base: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas ``read`` finds in ``base / path`` and each folder above it up to ``base`` (inside a container the
    path can name the host's folder that the container sees as ``base``: then ``base`` alone)."""
    folder = base / path.strip("/")
    if not folder.is_dir():
        folder = base
    found = []
    while True:
        quota = read(folder)
        if quota is not None:
            found.append(quota)
        if folder == base or base not in folder.parents:
            return found
        folder = folder.parent


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus(cpus: Iterable[int] | None = None, quota: float | None = None) -> int:
    """The CPUs this process can use at once: ``cpus`` (default: its affinity) capped by the cgroup ``quota`` in
    cores (default: :func:`cgroup_quota`) rounded up; at least 1."""
    count = len(frozenset(affinity() if cpus is None else cpus))
    quota = cgroup_quota() if quota is None else quota
    if quota is not None and math.isfinite(quota):
        count = min(count, math.ceil(quota))
    return max(count, 1)


def busy_seconds(text: str, cpus: frozenset[int]) -> float | None:
    """The busy time, in seconds, that ``/proc/stat`` text counts on ``cpus`` since boot; None when a CPU's line is
    missing or malformed."""
    total, seen = 0, 0
    for line in text.splitlines():
        if not line.startswith("cpu"):
            break
        name, *fields = line.split()
        if name == "cpu" or int(name[3:]) not in cpus:
            continue
        try:
            total += sum(int(fields[i]) for i in _BUSY)
        except (IndexError, ValueError):
            return None
        seen += 1
    return total / _TICK if seen == len(cpus) else None


class CpuShare:
    """Readings of the cores free for this process (see the module docstring); one per process is enough
    (:data:`SHARE`). Thread-safe. ``stat`` reads ``/proc/stat``'s text, ``own`` this process's CPU seconds,
    ``clock`` the wall clock in seconds, ``cpus`` the CPUs this process may run on, ``quota`` its cgroup quota in
    cores (tests pass their own)."""

    def __init__(self, stat: Callable[[], str] | None = None, own: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic, cpus: Callable[[], frozenset[int]] = affinity,
                 quota: Callable[[], float | None] = cgroup_quota, interval: float = INTERVAL):
        self.stat = stat or (lambda: PROC_STAT.read_text())
        self.own, self.clock, self.cpus, self.quota, self.interval = own, clock, cpus, quota, interval
        self.lock = threading.Lock()
        self.at = -math.inf  # when the last reading was taken
        self.last: tuple[frozenset[int], float, float] | None = None  # its CPUs, their busy seconds, our CPU seconds
        self.free = 0  # cores free at the last reading (0: none taken yet)
        self.others = 0.0  # busy cores of other processes at the last reading
        self.readings = 0
        self.cgroup_cores: float | None = None  # the quota, read every QUOTA_EVERY readings

    def threads(self, ceiling: int) -> int:
        """Threads for the next step: ``ceiling`` at most, lowered to the cores free at the last reading (taken
        now when :attr:`interval` has passed), at least 1."""
        if self.clock() - self.at >= self.interval:
            with self.lock:
                now = self.clock()
                if now - self.at >= self.interval:
                    self._read(now)
        return max(1, min(ceiling, self.free))

    def _read(self, now: float) -> None:
        cpus = self.cpus()
        try:
            busy = busy_seconds(self.stat(), cpus)
        except (OSError, ValueError):
            busy = None
        own = self.own()
        if self.readings % QUOTA_EVERY == 0:  # the cgroup files cost ~10x /proc/stat, and a quota rarely changes
            self.cgroup_cores = self.quota()
        self.readings += 1
        quota = self.cgroup_cores
        free = len(cpus) if quota is None else min(len(cpus), math.ceil(quota))
        if busy is not None and self.last is not None and self.last[0] == cpus and now > self.at:
            self.others = max(0.0, (busy - self.last[1]) - (own - self.last[2])) / (now - self.at)
            taken = math.ceil(self.others - TAKEN) if self.others > TAKEN else 0
            free = min(free, len(cpus) - taken)
        self.last = None if busy is None else (cpus, busy, own)
        self.at, self.free = now, max(free, 1)


SHARE = CpuShare()


def _forked_child() -> None:
    """A forked child reads afresh: the parent's last reading counted the parent's CPU time as its own."""
    SHARE.at, SHARE.last, SHARE.free, SHARE.others, SHARE.readings = -math.inf, None, 0, 0.0, 0
    SHARE.lock = threading.Lock()


os.register_at_fork(after_in_child=_forked_child)
