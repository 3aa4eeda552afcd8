"""When DSpark speculation pays: measured step costs, calibrated survival and the per-step choice between a plain
decode step and a speculative one (DSPARK.md §5, §5.3; issue 26 "DSpark must pay or step aside").

A speculative step costs more than its target forward: the draft forward and its Markov loop, the verify
bookkeeping, sampling at every verified position, the commit of accepted rows. :class:`StepCosts` measures what
the engine really spends, online, from a few ``perf_counter`` calls per decode step (no timer inside the model):

- ``plain(B)``: the whole plain decode step at batch B (schedule, forward, sampling, outputs);
- ``fixed(B)``: the part of a speculative step at batch B that does not depend on the verification length ℓ
  (the whole step minus its target forward: draft forward, verification, commit, outputs);
- ``forward(B, T)``: the verify forward over T = 1 + ℓ tokens of B sequences (a plain step's decode forward is
  not one of them: the verify path costs more even at T = 1, and mixing them would read that as a slope in T).

Each key keeps the median of its last observations (robust to a busy neighbour); the forward is a line in T
fitted per batch size to those medians, so widths rarely chosen are estimated from the others (:class:`StepCosts`).
The whole speculative step at ℓ is then ``fixed(B) + forward(B, 1 + ℓ)``.

The confidence head's survival probabilities are not calibrated (the bundled draft predicts 0.77 at the first
position where 0.62 is accepted), so :class:`SurvivalCalibration` rescales survival at each position so that,
over the recent verified drafts, it matches the acceptance that happened (mean matching, DSPARK.md §4 in spirit;
no offline STS file is needed).

:class:`SpeculationPolicy` decides each decode step, before any draft runs: with mean calibrated survival ŝ_j and
the measured costs, :func:`choose_verify_length` picks the ℓ in 0..L with the most expected committed tokens per
second, where ℓ = 0 is the plain decode step (no draft forward) — DSpark steps aside whenever plain decoding is
faster. The decision reads only past steps, never this step's drafts, so speculative sampling stays lossless and
greedy output is the target's whatever the choice (DSPARK.md §5.1). The losing kind is still probed now and then
(every ``interval`` steps, chosen so that probing costs about 0.5 % of the time) so that speculation comes back
when acceptance rises or the machine's load changes, and its estimates stay fresh; every batch size gets a first
plain and a first speculative step to measure.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence as Seq

PLAIN, SPEC = "plain", "spec"


def expected_tokens(survival: Seq[Seq[float]], caps: Seq[int], ell: int) -> float:
    """Expected committed tokens of a step verifying ``ell`` drafts: Σ_r (1 + Σ_{j <= min(ell, cap_r)} ŝ_rj) for
    per-sequence survival ``survival`` [R][L] (ŝ_rj = P(the first j drafts of sequence r are accepted)) and
    per-sequence caps [R]."""
    return sum(1.0 + sum(row[: min(ell, cap)]) for row, cap in zip(survival, caps, strict=True))


def expected_tokens_by_length(survival: Seq[Seq[float]], caps: Seq[int], max_len: int) -> list[float]:
    """:func:`expected_tokens` at every ℓ = 0..max_len [max_len + 1], from one cumulative sum per sequence
    (the policy asks for all of them at each comparison)."""
    totals = [float(len(caps))] * (max_len + 1)
    for row, cap in zip(survival, caps, strict=True):
        running, last = 0.0, min(cap, max_len, len(row))
        for ell in range(1, max_len + 1):
            if ell <= last:
                running += row[ell - 1]
            totals[ell] += running
    return totals


def choose_verify_length(survival: Seq[Seq[float]], caps: Seq[int], plain_time: float,
                         spec_times: Seq[float]) -> int:
    """The verification length of the next step that maximises expected committed tokens per second (DSPARK.md
    §5: Θ = τ · SPS), with 0 meaning a plain decode step.

    survival [R][L]: each sequence's expected survival ŝ_r1..ŝ_rL (non-increasing); caps [R]: the most drafts each
    sequence may verify; plain_time: seconds of a plain decode step of the R sequences; spec_times [L+1]: seconds of a
    speculative step verifying ℓ = 0..L drafts (draft forward included). Θ(0) = R / plain_time; Θ(ℓ >= 1) =
    expected_tokens(ℓ) / spec_times[ℓ] (a speculative step verifying nothing is never better than a plain one:
    it emits the same token later). A global argmax is safe here: the inputs are past measurements, not this
    step's drafts. Ties keep the smaller length. Raises ValueError for non-positive times.
    """
    if plain_time <= 0 or any(t <= 0 for t in spec_times):
        raise ValueError(f"step times must be positive seconds, got plain {plain_time} and {list(spec_times)}")
    best, chosen = len(caps) / plain_time, 0
    top = min(len(spec_times) - 1, max(caps, default=0))
    tokens = expected_tokens_by_length(survival, caps, top)
    for ell in range(1, top + 1):
        theta = tokens[ell] / spec_times[ell]
        if theta > best:
            best, chosen = theta, ell
    return chosen


class _Window:
    """The observations of one quantity after its first (a first step at a new shape pays one-off allocations and
    is dropped): the last ``size`` of them, and every one made in the last ``span`` decode steps (``now``, a step
    count) up to ``max(size, span)``. :meth:`median` is its running estimate. The span makes the kind that runs
    most steps keep as many observations as it made over that span, so that a burst of a busy neighbour over a few
    steps does not move its median: before it, 15 plain steps slowed by a burst lifted the plain estimate, the
    policy switched to speculation and kept the stale estimate for tens of steps (plain ran only as a probe)."""

    def __init__(self, size: int, span: int):
        self.size, self.span = size, span
        self.values: deque[tuple[int, float]] = deque(maxlen=max(size, span))
        self.warm = False

    def add(self, value: float, now: int) -> None:
        if self.warm:
            self.values.append((now, value))
            while len(self.values) > self.size and self.values[0][0] <= now - self.span:
                self.values.popleft()
        self.warm = True

    def __len__(self) -> int:
        return len(self.values)

    def median(self) -> float:
        ordered = sorted(v for _, v in self.values)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x, distinct x), extended by the end segments' slopes
    (clamped at 0: a bigger batch never costs less) and floored at a tenth of the nearest point."""
    xs = [p[0] for p in points]
    if len(points) == 1:
        return points[0][1]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    y = y0 + slope * (x - x0)
    return max(y, 0.1 * min(y0, y1))


def fit_line(points: Seq[tuple[float, float, float]]) -> tuple[float, float]:
    """Weighted least-squares line y = a + b·x through (x, y, weight) points (x >= 0) with b >= 0 (a cost never
    falls with more tokens) and a >= 0 (no width costs nothing or less: a steep fit through a few noisy medians
    is refitted through the origin); a single x gives b = 0. Returns (a, b)."""
    w = sum(p[2] for p in points)
    mx = sum(p[0] * p[2] for p in points) / w
    my = sum(p[1] * p[2] for p in points) / w
    sxx = sum(p[2] * (p[0] - mx) ** 2 for p in points)
    b = max(0.0, sum(p[2] * (p[0] - mx) * (p[1] - my) for p in points) / sxx) if sxx > 0 else 0.0
    if my - b * mx < 0:
        b = sum(p[2] * p[0] * p[1] for p in points) / sum(p[2] * p[0] ** 2 for p in points)
        return 0.0, b
    return my - b * mx, b


class StepCosts:
    """Running estimates of the decode step costs (module docstring), in seconds: per key the last ``window``
    observations and all of those of the last ``span`` decode steps (:class:`_Window`).

    ``plain(B)`` and ``fixed(B)``: the median of the batch size's observations, interpolated between observed
    batch sizes. ``forward(B, T)``: a line a_B + b_B·(T - 1) fitted to the medians of the batch's observed
    widths (weighted by their counts, so one slow step moves it little); with a single width, the per-row slope
    b_B / B of the nearest batch size that has two, or 0 (a flat line: longer verifies look cheap until one is
    measured); for an unobserved batch, a_B interpolated over batch sizes.
    Each returns None when nothing of its kind was observed."""

    def __init__(self, window: int = 15, span: int = 64):
        self.size, self.span = window, span
        self.steps = 0  # decode steps observed
        self._plain: dict[int, _Window] = {}
        self._fixed: dict[int, _Window] = {}
        self._forward: dict[tuple[int, int], _Window] = {}
        self._fitted: dict[int, tuple[float, float]] | None = None  # _lines(), until the next speculative step

    def _add(self, table: dict, key, seconds: float) -> None:
        if seconds > 0:
            window = table.get(key)
            if window is None:
                window = table[key] = _Window(self.size, self.span)
            window.add(seconds, self.steps)

    def observe_plain(self, batch: int, step: float) -> None:
        """A plain decode step of ``batch`` sequences took ``step`` seconds (the whole step)."""
        self.steps += 1
        self._add(self._plain, batch, step)

    def observe_spec(self, batch: int, width: int, step: float, forward: float) -> None:
        """A speculative step of ``batch`` sequences whose verify forward ran ``width`` = 1 + max ℓ tokens each:
        the whole step and the verify forward, seconds."""
        self.steps += 1
        self._fitted = None
        self._add(self._fixed, batch, step - forward)
        self._add(self._forward, (batch, width), forward)

    def seen(self, kind: str, batch: int) -> bool:
        """Whether a ``kind`` (PLAIN or SPEC) step of exactly ``batch`` sequences was measured (past warm-up)."""
        return len((self._plain if kind == PLAIN else self._fixed).get(batch, ())) > 0

    @staticmethod
    def _by_batch(table: dict[int, _Window], batch: int) -> float | None:
        exact = table.get(batch)
        if exact is not None and len(exact):
            return exact.median()
        points = sorted((b, w.median()) for b, w in table.items() if len(w))
        return _interpolate(points, batch) if points else None

    def plain(self, batch: int) -> float | None:
        return self._by_batch(self._plain, batch)

    def fixed(self, batch: int) -> float | None:
        return self._by_batch(self._fixed, batch)

    def _lines(self) -> dict[int, tuple[float, float]]:
        """Per observed batch size: (a_B, b_B) of its forward line a_B + b_B·(T - 1) (fitted again after each
        speculative step's observation, not at every decision)."""
        if self._fitted is not None:
            return self._fitted
        points: dict[int, list[tuple[float, float, float]]] = {}
        for (b, t), w in self._forward.items():
            if len(w):
                points.setdefault(b, []).append((t - 1, w.median(), len(w)))
        fitted = {b: fit_line(p) for b, p in points.items()}
        sloped = [(b, fitted[b][1] / b) for b, p in points.items() if len(p) > 1]
        lines = {}
        for b, p in points.items():
            if len(p) > 1 or not sloped:
                lines[b] = fitted[b]
            else:  # one width: the per-row slope of the nearest batch size with two, through its point (no
                # steeper than the line through the origin, so that narrower widths never cost less than nothing)
                x, y = p[0][0], p[0][1]
                slope = min(sloped, key=lambda q: (abs(q[0] - b), q[0]))[1] * b
                if x > 0:
                    slope = min(slope, y / x)
                lines[b] = (y - slope * x, slope)
        self._fitted = lines
        return lines

    @staticmethod
    def _line(batch: int, lines: dict[int, tuple[float, float]]) -> tuple[float, float] | None:
        """The forward line of ``batch``: its own, else the intercept interpolated over batch sizes and the
        nearest batch size's per-row slope."""
        if not lines:
            return None
        if batch in lines:
            return lines[batch]
        nearest = min(lines, key=lambda b: (abs(b - batch), b))
        intercept = _interpolate(sorted((b, line[0]) for b, line in lines.items()), batch)
        return intercept, lines[nearest][1] / nearest * batch

    def forward(self, batch: int, width: int) -> float | None:
        """Seconds of the target forward over ``width`` tokens of each of ``batch`` sequences (class docstring)."""
        line = self._line(batch, self._lines())
        return None if line is None else line[0] + line[1] * (width - 1)

    def spec_times(self, batch: int, max_len: int) -> list[float] | None:
        """Seconds of a speculative step of ``batch`` sequences verifying ℓ = 0..max_len drafts, or None before
        any speculative step was measured."""
        fixed, line = self.fixed(batch), self._line(batch, self._lines())
        if fixed is None or line is None:
            return None
        return [fixed + line[0] + line[1] * ell for ell in range(max_len + 1)]

    def summary(self, max_len: int) -> dict[int, dict[str, object]]:
        """Per measured batch size: the plain step and the speculative step at each ℓ, in ms (for stats)."""
        out = {}
        for b in sorted(set(self._plain) | set(self._fixed)):
            plain, spec = self.plain(b), self.spec_times(b, max_len)
            out[b] = {"plain_ms": None if plain is None else round(plain * 1e3, 3),
                      "spec_ms": None if spec is None else [round(t * 1e3, 3) for t in spec]}
        return out


class SurvivalCalibration:
    """Per draft position j: the decayed mean m_j of the survival the head predicted over every drafted row
    (verified or not) and the ratio ρ_j of drafts accepted to survival predicted over the verified ones, with a
    prior of ``prior`` rows at ratio 1 (in units of m_j, so a head that predicts tiny survival is corrected after
    a few rows). Counts decay by ``decay`` per speculative step: probes are rare when speculation loses, and a
    few of them must be able to bring it back. ``mean``: the planned mean survival, min(1, ρ_j m_j) kept
    non-increasing (None before any step)."""

    def __init__(self, max_len: int, decay: float = 0.9, prior: float = 1.0):
        self.decay, self.prior = decay, prior
        self.accepted = [0.0] * max_len
        self.predicted = [0.0] * max_len
        self.drafted = [0.0] * max_len  # decayed sum of predicted survival over all drafted rows
        self.rows = 0.0
        self.verified_rows = 0  # rows that verified at least one draft, ever (not decayed)
        self.mean: list[float] | None = None

    def ratio(self, j: int) -> float:
        if self.rows == 0:
            return 1.0
        pseudo = self.prior * self.drafted[j] / self.rows
        return (self.accepted[j] + pseudo) / (self.predicted[j] + pseudo) if self.predicted[j] + pseudo > 0 else 1.0

    def apply(self, survival: Seq[float]) -> list[float]:
        """Calibrated survival of one row [L]: min(1, ρ_j · a_j), kept non-increasing."""
        out, last = [], 1.0
        for j, a in enumerate(survival[: len(self.accepted)]):
            last = min(last, 1.0, self.ratio(j) * a)
            out.append(last)
        return out

    def observe(self, survival: Seq[Seq[float]], verified: Seq[int], accepted: Seq[int]) -> None:
        """One speculative step: raw survival [R][L] of every drafted row, drafts verified and accepted per row."""
        L, d = len(self.accepted), self.decay
        acc, pred, drafted = [0.0] * L, [0.0] * L, [0.0] * L
        for row, ell, a in zip(survival, verified, accepted, strict=True):
            for j in range(L):
                drafted[j] += row[j]
                if j < ell:
                    pred[j] += row[j]
                    acc[j] += j < a
        self.accepted = [d * x + y for x, y in zip(self.accepted, acc, strict=True)]
        self.predicted = [d * x + y for x, y in zip(self.predicted, pred, strict=True)]
        self.drafted = [d * x + y for x, y in zip(self.drafted, drafted, strict=True)]
        self.rows = d * self.rows + len(survival)
        self.verified_rows += sum(ell > 0 for ell in verified)
        if self.rows > 0:
            self.mean = self.apply([x / self.rows for x in self.drafted])


class SequenceAcceptance:
    """One sequence's own acceptance history, for the policy's expected tokens (:meth:`SpeculationPolicy.decide`):
    per draft position j, decayed counts of its drafts verified at j and of those accepted through j (every
    speculative step that verified a draft of it multiplies both by ``decay`` first).

    Acceptance differs between sequences (text the draft knows well, or not), and a batch's mean misleads most
    where it matters: the sequences still running at the end of a batch are the ones whose drafts were rejected
    more (the others finished sooner); planned with the mean, their last steps speculated at 2.5 committed tokens
    per sequence where the mean promised 3.9, at 1.5x the cost per token of plain steps (batch 4, bench run)."""

    def __init__(self, max_len: int, decay: float = 0.8):
        self.decay = decay
        self.verified = [0.0] * max_len
        self.accepted = [0.0] * max_len

    def observe(self, verified: int, accepted: int) -> None:
        """A speculative step verified ``verified`` drafts of this sequence and accepted the first ``accepted``."""
        if verified <= 0:
            return
        d = self.decay
        for j in range(len(self.verified)):
            self.verified[j] = d * self.verified[j] + (j < verified)
            self.accepted[j] = d * self.accepted[j] + (j < min(accepted, verified))

    def survival(self, prior: Seq[float], strength: float = 2.0) -> list[float]:
        """Expected survival [L] of this sequence's next drafts: per position its accepted / verified counts with
        ``strength`` rows of the batch's mean ``prior`` [L] added (a sequence never verified plans with the
        prior), kept non-increasing."""
        out, last = [], 1.0
        for j, mean in enumerate(prior):
            last = min(last, (self.accepted[j] + strength * mean) / (self.verified[j] + strength))
            out.append(last)
        return out


class SpeculationPolicy:
    """Chooses, before each decode step, a plain step or a speculative one (module docstring).

    ``max_len``: the most drafts a step verifies. The kind the estimates favour runs, except that the other kind
    is probed once every ``interval`` steps, where the interval is set so that probing costs about
    ``probe_budget`` of the time (the estimated loss of one step of the losing kind over ``probe_budget`` times
    the winner's step time, clamped to [``min_interval``, ``max_interval``]): a probe that costs little runs
    often, one that costs a lot rarely. ``min_gain``: speculation wins only when its expected tokens per second
    beat plain decoding's by this fraction. Near break-even the costs the estimates leave out decide, and they all
    weigh against speculation: the flush of the plain steps' backlog, and above all a batch whose sequences drift
    apart (each accepts a different number of drafts) and so finish one by one, the last of them decoding at a
    small batch. At batch 8 on 2 cores beside a busy neighbour, speculative steps 11 % ahead per step decoded
    0.8x plain over the whole batch (half of its steps ran at batch 4 or less); with a margin of 5 % the scheduler
    still let 18 % of the steps speculate (0.92x), with 15 % 10 % of them (0.94x). At 25 % it steps aside there and
    still speculates where it pays (batch 1: 2.2x, batch 2: 1.25x quiet). ``refresh``: steps a comparison of the
    estimates is reused for at one batch size (it costs tens of µs of Python and the estimates move slowly).
    ``context_window``: the draft's window W (:meth:`keep_context`; 0: every plain step keeps its rows).
    ``warmup_rows``: until this many sequence-steps have verified drafts, speculation losing is probed every
    ``min_interval`` steps: the first two speculative steps of a fresh engine once accepted 1 and 0 drafts, the
    calibrated survival fell to 0.58 / 0.14 / ..., and the next probe came 220 steps later, so a 256-token
    generation at batch 1 ran plain where the full block decodes 1.6x faster.
    ``decisions[kind]`` counts the choices, probes included. Raises ValueError for a budget or gain outside
    (0, 1) / [0, 1) or intervals not 1 <= min_interval <= max_interval."""

    def __init__(self, max_len: int, probe_budget: float = 0.005, min_interval: int = 8, max_interval: int = 512,
                 window: int = 15, refresh: int = 8, context_window: int = 0, min_gain: float = 0.25,
                 warmup_rows: int = 32):
        if not (0 < probe_budget < 1 and 0 <= min_gain < 1 and 1 <= min_interval <= max_interval):
            raise ValueError(f"need 0 < probe_budget < 1, 0 <= min_gain < 1 and 1 <= min_interval <= max_interval, "
                             f"got {probe_budget}, {min_gain}, {min_interval}, {max_interval}")
        self.min_gain = min_gain
        self.warmup_rows = warmup_rows
        self.max_len = max_len
        self.costs = StepCosts(window)
        self.calibration = SurvivalCalibration(max_len)
        self.budget, self.min_interval, self.max_interval = probe_budget, min_interval, max_interval
        self.refresh = refresh
        self.since = {PLAIN: 0, SPEC: 0}  # decode steps since each kind last ran
        self.decisions = {PLAIN: 0, SPEC: 0}
        self._cached: tuple[int, int, tuple[str, int] | None] = (0, 0, None)  # batch, steps left, comparison
        self.context_window = context_window
        self.kept = context_window  # consecutive recent decode steps whose draft context rows were kept (<= W)

    def compare(self, caps: Seq[int], histories: Seq[SequenceAcceptance | None] | None = None
                ) -> tuple[str, int] | None:
        """(the kind the estimates favour, steps between probes of the other kind) for a batch with these caps
        and the sequences' own acceptance (``histories``, None each or all: the calibrated mean), or None while a
        kind has no measurement at this batch size or no acceptance was seen."""
        B = len(caps)
        plain, spec = self.costs.plain(B), self.costs.spec_times(B, self.max_len)
        mean = self.calibration.mean
        if plain is None or spec is None or mean is None:
            return None
        survival = [mean if h is None else h.survival(mean) for h in (histories or [None] * B)]
        ell = choose_verify_length(survival, caps, plain / (1 + self.min_gain), spec)
        tokens = expected_tokens_by_length(survival, caps, self.max_len)
        if ell == 0:  # the loser: the best speculative step
            ell = max(range(1, self.max_len + 1), key=lambda n: tokens[n] / spec[n])
            # a probe's cost counts the margin too: it stands for what the estimates leave out (a speculative step
            # makes the batch ragged), and without it near-even estimates probed every few steps
            winner, t_win, tok_win = PLAIN, plain, B
            t_lose, tok_lose = spec[ell] * (1 + self.min_gain), tokens[ell]
        else:
            winner, t_win, tok_win, t_lose, tok_lose = SPEC, spec[ell], tokens[ell], plain, B
        loss = max(0.0, t_lose - tok_lose * t_win / tok_win)  # seconds a probe costs against the winner
        interval = min(max(self.min_interval, round(loss / (self.budget * t_win))), self.max_interval)
        if winner == PLAIN and self.calibration.verified_rows < self.warmup_rows:
            interval = self.min_interval  # a few unlucky first drafts must not shut speculation out for long
        return winner, interval

    def plain_steps_ahead(self) -> int:
        """Plain decode steps planned before the next speculative one, after :meth:`decide` chose this step: while
        plain decoding wins, the steps left to the next probe of speculation; else 0 (the next may speculate). A
        plan, not a promise: a new comparison (every ``refresh`` steps, or a new batch size) may bring
        speculation sooner."""
        comparison = self._cached[2]
        if comparison is None or comparison[0] != PLAIN:
            return 0
        return max(0, comparison[1] - self.since[SPEC] - 1)

    def decide(self, caps: Seq[int], histories: Seq[SequenceAcceptance | None] | None = None) -> str:
        """PLAIN or SPEC for the next decode step of ``len(caps)`` sequences with these caps and acceptance
        histories (:meth:`compare`): a batch size not yet measured in a kind runs that kind first; otherwise the
        kind :meth:`compare` favours, with the other kind probed every ``interval`` steps. Caps of 0 only (no
        draft could be verified): PLAIN."""
        B = len(caps)
        if max(caps, default=0) == 0:
            kind = PLAIN
        else:
            unseen = [k for k in (SPEC, PLAIN) if not self.costs.seen(k, B)]
            if unseen:
                kind = unseen[0]
            else:
                batch, left, comparison = self._cached
                if batch != B or left <= 0 or comparison is None:
                    comparison, left = self.compare(caps, histories), self.refresh
                self._cached = (B, left - 1, comparison)
                winner, interval = comparison or (SPEC, self.min_interval)
                loser = PLAIN if winner == SPEC else SPEC
                kind = loser if self.since[loser] + 1 >= interval else winner
                if kind == SPEC != winner and self.kept < self.context_window:
                    kind = PLAIN  # a probe waits until the draft's window is whole again (keep_context)
        for k in self.since:
            self.since[k] = 0 if k == kind else self.since[k] + 1
        if kind == SPEC:
            self.kept = self.context_window  # a speculative step commits its rows to the draft
        self.decisions[kind] += 1
        return kind

    def keep_context(self) -> bool:
        """For the plain step :meth:`decide` just chose: whether its draft context rows should be kept. With a
        ``context_window`` W (the draft reads the last W positions), not when W or more plain steps are planned
        before the next speculative one (:meth:`plain_steps_ahead`): by then the window has moved past this step.
        A probe that comes due while the last W steps did not all keep their rows waits until they have (so its
        drafts read a whole window and measure what speculation would really do); W = 0 keeps every step."""
        keep = self.context_window == 0 or self.plain_steps_ahead() + 1 <= self.context_window
        self.kept = min(self.kept + 1, self.context_window) if keep else 0
        return keep
