"""DSpark speculative decoding in the engine: draft proposals, the verification-length scheduler, lossless
verification and the commit of accepted tokens (DSPARK.md §3–§7; SPEC.md §4.4).

One speculative step for the decoding sequences (each has committed positions < p+1 and its anchor t* at p+1):

1. **Propose** (DSPARK.md §3): the draft ``model.mtp`` reads each slot's ring of committed context rows and
   drafts K = ``dspark_block_size`` tokens with their draft distributions q and survival probabilities a_j.
0. **Plain or speculative** (spec_schedule.py): before drafting, the adaptive policy compares the measured
   plain decode step with the measured speculative step and the recent acceptance; when plain decoding is
   faster the step runs without the draft (:meth:`DSparkSpeculator.speculate`), and the draft's context rows of
   the positions it computed wait in the sequence's backlog until the next speculative step.
2. **Schedule** (§5): :func:`schedule_verify_lengths` picks the verification length ℓ from the survival
   probabilities and the cost of a step at each ℓ (measured whole-step seconds, or the user's cost table).
3. **Verify** (§6): the target runs ``[t*, d_1..d_ℓ]`` of every sequence in one batched forward
   (:meth:`~deepseek_v41.engine.model_runner.ModelRunner.verify`); :func:`verify_sequence` accepts the longest
   prefix matching the target's greedy tokens, or by lossless speculative sampling with the sampler's own
   processed distribution, and emits the accepted drafts plus one target token. A structured-output sequence's
   position i is masked with its grammar's state after drafts 0..i-1 (the drafts are walked through its
   matcher, up to the first one the grammar refuses, which is verified and rejected, or its stop token), and the
   rejected drafts are rolled back: its tokens follow non-speculative constrained decoding's distribution.
4. **Commit** (§7): pending pairs and Engram history of the accepted prefix
   (:meth:`~deepseek_v41.engine.model_runner.ModelRunner.commit_verify`), the draft rings take the anchor and
   accepted rows only; window rows and compressed entries of rejected positions lie beyond the committed length,
   where nothing reads them (``window_slack_rows >= speculative_max_len``, checked at engine start) and the next
   forward overwrites them; the engine registers only pages below the committed length in the prefix cache.

Batching: the verify forward pads every row to the longest ℓ with that row's further drafts; padded positions
are computed and ignored (their entries go past the committed length, or to the null page).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from deepseek_v41.engine.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingState,
    _filter,
    _gather_logprobs,
    exponential_race,
)
from deepseek_v41.engine.sampling_params import SamplingParams
from deepseek_v41.engine.sequence import Sequence
from deepseek_v41.engine.spec_schedule import PLAIN, SPEC, SequenceAcceptance, SpeculationPolicy
from deepseek_v41.model.dspark import DSparkState
from deepseek_v41.structured import mask_draft_positions

SPECULATIVE_METHODS = ("dspark",)
FIXED = "fixed"  # speculative_cost_table value: no cost table, verify speculative_max_len drafts every step


def parse_cost_table(table: Mapping[int, float] | Seq[float], max_len: int) -> list[float]:
    """A user cost table -> ``[c_0 .. c_max_len]`` (c_ℓ = relative cost of a target forward verifying ℓ drafts
    per sequence). ``table``: a list indexed by ℓ, or a dict ℓ -> cost; it must cover 0..max_len (extra entries
    are ignored) with positive finite costs. Raises ValueError naming what is missing or wrong."""
    if isinstance(table, Mapping):
        try:
            items = {int(k): float(v) for k, v in table.items()}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"speculative_cost_table keys must be verification lengths and values costs: {exc}") \
                from exc
    else:
        items = {i: float(v) for i, v in enumerate(table)}
    missing = [ell for ell in range(max_len + 1) if ell not in items]
    if missing:
        raise ValueError(f"speculative_cost_table must give a cost for every verification length 0..{max_len} "
                         f"(speculative_max_len); missing {missing}")
    costs = [items[ell] for ell in range(max_len + 1)]
    if not all(0 < c < float("inf") for c in costs):
        raise ValueError(f"speculative_cost_table costs must be positive and finite, got {costs}")
    return costs


def schedule_verify_lengths(survival: Seq[Seq[float]], caps: Seq[int], cost: Seq[float] | None) -> list[int]:
    """Verification length of every sequence of one step (DSPARK.md §5.1, Algorithm 1, for a padded batch).

    survival [R][K]: a_{r,j} = prod_{i<=j} sigmoid(z_{r,i}) (non-increasing in j); caps [R]: the most drafts
    sequence r may verify (speculative_max_len, or fewer near max_tokens); cost [L+1]: c_ℓ, the relative cost of
    a target forward verifying ℓ drafts per sequence (None: verify ``caps``, the whole block).

    The verify forward pads every row to the longest ℓ, so its cost is c_ℓ whatever each row uses: level ℓ is
    admitted for every sequence at once. With τ(ℓ) = Σ_r (1 + Σ_{j <= min(ℓ, cap_r)} a_{r,j}) expected emitted
    tokens, Θ(ℓ) = τ(ℓ) / c_ℓ; starting from Θ(0), level ℓ+1 is admitted while it raises Θ strictly, and the
    first level that does not ends the scan (Algorithm 1's early stop). Level ℓ's value reads a_{·,ℓ}, which
    depends on drafts < ℓ only (the confidence of draft j sees d_{j-1}, not d_j), so whether a draft is verified
    never depends on the draft itself: speculative sampling stays lossless (DSPARK.md §5.1, Appendix A).
    Returns ``[min(ℓ*, cap_r)]``.
    """
    top = max(caps, default=0)
    if cost is None or top == 0:
        return list(caps)
    tau = float(len(caps))
    best, chosen = tau / cost[0], 0
    for level in range(1, top + 1):
        tau += sum(row[level - 1] for row, cap in zip(survival, caps, strict=True) if cap >= level)
        theta = tau / cost[level]
        if not theta > best:
            break
        best, chosen = theta, level
    return [min(chosen, cap) for cap in caps]


class Verdict(NamedTuple):
    """Outcome of one verify step of one sequence: ``tokens`` to emit (the accepted drafts, then the target's
    token), their ``logprobs`` entries (None when the request asked for none) and ``accepted`` drafts."""

    tokens: list[int]
    logprobs: list[dict] | None
    accepted: int


def verify_sequence(sampler: Sampler, logits: torch.Tensor, state: SamplingState, drafts: Seq[int],
                    draft_probs: torch.Tensor | None) -> Verdict:
    """Accept a prefix of ``drafts`` (ℓ tokens) against the target's ``logits`` [ℓ+1, V] at the anchor and each
    draft, processed by ``sampler`` exactly as non-speculative decoding would (penalties, min_tokens, top-k/p).

    Greedy requests (DSPARK.md §6.1): the longest prefix equal to the target's own greedy tokens, then the
    target's token after it. Sampling (§6.2): draft j is accepted with probability min(1, P_j(d)/q_j(d)) where P
    is :meth:`Sampler.probs` and q = ``draft_probs`` [ℓ, V] (the distribution d was drawn from); at the first
    rejection the token comes from the residual norm(max(0, P_j - q_j)) (P_j when it has no mass), and after ℓ
    acceptances from P_ℓ. Draws come from the request's generator. Logprobs follow ``sampler.logprobs_mode``.
    """
    drafts = list(drafts)
    ell = len(drafts)
    num = state.params.logprobs
    if state.params.is_greedy:
        out = sampler.sample_row(logits, state, drafts)
        greedy = out.token_ids.tolist()
        accepted = next((j for j in range(ell) if drafts[j] != greedy[j]), ell)
        entries = None
        if out.logprobs is not None and num is not None:
            entries = [out.logprobs.to_dict(j, num) for j in range(accepted + 1)]
        return Verdict(greedy[: accepted + 1], entries, accepted)
    probs = sampler.probs(logits, state, drafts)
    generator = state.generator
    tokens: list[int] = []
    for j, d in enumerate(drafts):
        p, q = probs[j, d], draft_probs[j, d]
        u = torch.rand((), generator=generator, device=probs.device)
        if u * q < p:  # accept with probability min(1, p / q)
            tokens.append(d)
            continue
        residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        if residual.sum() <= torch.finfo(residual.dtype).tiny:
            residual = probs[j]
        tokens.append(_draw(residual, generator))
        break
    else:
        tokens.append(_draw(probs[ell], generator))
    accepted = len(tokens) - 1
    entries = None
    if num is not None:
        rows = logits[: accepted + 1].float()
        logprobs = torch.log_softmax(rows, -1) if sampler.logprobs_mode == "raw_logprobs" else \
            torch.log(probs[: accepted + 1])
        table: LogprobsTensors = _gather_logprobs(logprobs, torch.tensor(tokens, device=rows.device),
                                                  min(num, rows.shape[1]))
        entries = [table.to_dict(j, num) for j in range(accepted + 1)]
    return Verdict(tokens, entries, accepted)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(exponential_race(probs[None], generator)[0])


@dataclass
class SpecDecodeStats:
    """Counters of speculative decoding (vLLM's ``SpecDecodingStats`` names, plus the chosen lengths).

    As vLLM's, a draft counts only when the target verified some of it: ``num_drafts``: steps of a sequence that
    verified >= 1 draft; ``num_draft_tokens``: drafts verified; ``num_accepted_tokens``: drafts accepted;
    ``accepted_per_pos[j]`` / ``verified_per_pos[j]``: accepted / verified drafts at draft position j.
    ``verify_lengths[ℓ]``: decode steps of a sequence that verified ℓ drafts (the step mix; ℓ = 0 counts the
    plain steps, which ran no draft, and the speculative steps that verified none of theirs);
    ``num_plain_steps``: decode steps of a sequence that ran without the draft (the scheduler's ℓ = 0).
    """

    max_len: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_plain_steps: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    verified_per_pos: list[int] = field(default_factory=list)
    verify_lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.max_len
        self.verified_per_pos = [0] * self.max_len
        self.verify_lengths = [0] * (self.max_len + 1)

    def record(self, verified: int, accepted: int) -> None:
        """One speculative step of one sequence that verified ``verified`` drafts and accepted ``accepted``."""
        self.verify_lengths[verified] += 1
        if verified == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += verified
        self.num_accepted_tokens += accepted
        for j in range(verified):
            self.verified_per_pos[j] += 1
            self.accepted_per_pos[j] += j < accepted

    def record_plain(self, sequences: int) -> None:
        """A plain decode step (no draft) of ``sequences`` sequences."""
        self.num_plain_steps += sequences
        self.verify_lengths[0] += sequences

    def as_dict(self) -> dict[str, Any]:
        """``spec_decode_*`` entries of ``LLMEngine.stats``; the mean accepted length counts the bonus token and
        is over the verified drafts (vLLM's); the mean verify length is over all decode steps, plain ones too."""
        n = max(1, self.num_drafts)
        steps = sum(self.verify_lengths)
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_plain_steps": self.num_plain_steps,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_num_verified_tokens_per_pos": list(self.verified_per_pos),
            "spec_decode_acceptance_per_pos": [a / v if v else 0.0 for a, v in
                                               zip(self.accepted_per_pos, self.verified_per_pos, strict=True)],
            "spec_decode_mean_accepted_length": 1.0 + self.num_accepted_tokens / n if self.num_drafts else 0.0,
            "spec_decode_verify_lengths": list(self.verify_lengths),
            "spec_decode_mean_verify_length": self.num_draft_tokens / steps if steps else 0.0,
        }


class TargetTaps(dict):
    """A ``taps`` dict for ``Transformer.run_layers`` that keeps only the draft's target layers ``layers`` (the
    others would pin every layer's activations), and of those only the last ``last`` positions (copied)."""

    def __init__(self, layers: Seq[int], last: int | None = None):
        super().__init__()
        self.layers = frozenset(layers)
        self.last = last

    def __setitem__(self, layer: int, streams: torch.Tensor) -> None:
        if layer in self.layers:
            super().__setitem__(layer, streams if self.last is None else streams[:, -self.last:].clone())


class DSparkSpeculator:
    """The DSpark proposer, the verification-length scheduler and verification for one engine.

    ``model``: the target (its ``mtp`` is the draft); ``cache``: a cache built with ``draft_layers`` (the draft
    rings live per slot there); ``runner``, ``sampler``: the engine's. ``max_len``: the most drafts a step
    verifies (<= ``dspark_block_size``); ``cost``: a user's ``[c_0..c_max_len]`` (every step speculates and
    Algorithm 1 reads this table), or None. ``policy``: with ``cost`` None, the
    :class:`~deepseek_v41.engine.spec_schedule.SpeculationPolicy` that measures the engine's steps and chooses
    plain or speculative steps (the default); None with ``cost`` None: every step verifies ``max_len`` drafts.
    """

    def __init__(self, model, cache, runner, sampler: Sampler, max_len: int, cost: list[float] | None,
                 policy: SpeculationPolicy | None = None):
        self.model, self.cache, self.runner, self.sampler = model, cache, runner, sampler
        self.draft = model.mtp
        self.max_len = max_len
        self.cost = cost
        self.policy = policy
        self.window = self.draft.window
        self.stats = SpecDecodeStats(max_len)
        # the last decode step: kind, B, T, its target forward and backlog flush in seconds
        self._last: tuple[str, int, int, float, float] | None = None

    # ------------------------------------------------------------------ draft context (DSPARK.md §3.1)
    def prefill_taps(self) -> TargetTaps:
        """A taps dict for a prefill chunk: the target layers' inputs of the chunk's last W positions."""
        return TargetTaps(self.draft.target_layer_ids, self.window)

    def decode_taps(self, seqs: list[Sequence]) -> TargetTaps | None:
        """A taps dict for a plain decode step of ``seqs`` (:meth:`defer_context` takes it afterwards), or None when
        this step's rows cannot reach the draft: the policy plans W or more plain steps before its next
        speculative one, and by then the draft's window (the last W positions) has moved past them
        (:meth:`~deepseek_v41.engine.spec_schedule.SpeculationPolicy.keep_context`; a probe waits for a whole
        window). The
        sequences' ``draft_context_from`` then moves past this step's position: a speculative step that comes
        sooner than planned drafts over a window with holes (fewer context rows; verification keeps the output
        exact), and its acceptance is left out of the policy's estimates (:meth:`step`).

        The taps copy the one row each target layer computed, so the backlog pins a fresh [B, 1, hc, D] per layer
        and step rather than the layer's input tensors themselves: pinning those for up to W steps made a plain
        step of a speculative engine 0.885x a plain engine's at batch 8, and with the copy it is 1.04x (paired
        runs, bench/README.md; why the originals cost so much was not traced). Taking none when they are not
        needed saves about 1 % more at batch 8, where plain decoding wins (bench/README.md)."""
        if self.policy is not None and not self.policy.keep_context():
            for seq in seqs:
                seq.draft_context_from = seq.num_computed + 1
            return None
        return TargetTaps(self.draft.target_layer_ids, 1)

    @torch.no_grad()
    def add_context(self, seq: Sequence, taps: Mapping[int, torch.Tensor], end: int) -> None:
        """Commit the draft context rows of prefilled positions (every one of them is committed): ``taps`` from
        :meth:`prefill_taps` filled by a prefill chunk ending at ``end``. Layers that did not run (a CED chunk
        before the decoder start) leave nothing to add. A prefill recomputes every position a plain step left
        in the sequence's backlog (it only runs again after a preemption), so the backlog is dropped."""
        seq.draft_backlog.clear()
        seq.draft_context_from = 0
        if set(taps) != set(self.draft.target_layer_ids):
            return
        n = min(t.shape[1] for t in taps.values())
        if n == 0:
            return
        positions = torch.arange(end - n, end, device=self.cache.device)[None]
        self._commit_rows([seq], {j: t[:, -n:] for j, t in taps.items()}, positions, None)

    def defer_context(self, seqs: list[Sequence], taps: Mapping[int, torch.Tensor] | None) -> None:
        """After a plain decode step (``taps`` from :meth:`decode_taps`, [B, 1, hc, D] per target layer, or None:
        nothing to keep): put the
        position each sequence computed in its backlog (at most W entries), with a reference to the step's taps
        and its row there. No tensor work: the rows reach the draft ring at the sequence's next speculative step,
        all in one batch (:meth:`_flush`). Memory: the taps of the last W plain steps stay referenced (W x 3 x B
        x hc x D values; for V4.1 in bf16 about 15 MB per sequence)."""
        if taps is None:
            return
        step = tuple(taps[j] for j in self.draft.target_layer_ids)
        for b, seq in enumerate(seqs):
            backlog = seq.draft_backlog
            backlog.append((seq.num_computed, step, b))
            if len(backlog) > self.window:
                del backlog[0]

    @torch.no_grad()
    def _flush(self, seqs: list[Sequence]) -> None:
        """Write the backlog rows of ``seqs`` into their draft rings: gathered per plain step (one index per step
        and target layer), padded to the longest backlog, staged and committed in one draft projection."""
        waiting = [s for s in seqs if s.draft_backlog]
        if not waiting:
            return
        device = self.cache.device
        L = max(len(s.draft_backlog) for s in waiting)
        first = waiting[0].draft_backlog[0][1][0]
        rows = [torch.zeros(len(waiting), L, *first.shape[2:], dtype=first.dtype, device=device)
                for _ in self.draft.target_layer_ids]  # per target layer [B', L, hc, D]
        positions = torch.full((len(waiting), L), -1, dtype=torch.long, device=device)
        steps: dict[int, tuple[tuple[torch.Tensor, ...], list[int], list[int], list[int]]] = {}
        for w, seq in enumerate(waiting):
            for t, (_, step, b) in enumerate(seq.draft_backlog):
                group = steps.setdefault(id(step), (step, [], [], []))
                group[1].append(w)
                group[2].append(t)
                group[3].append(b)
            positions[w, : len(seq.draft_backlog)] = torch.tensor([p for p, _, _ in seq.draft_backlog])
            seq.draft_backlog.clear()
        for step, ws, ts, bs in steps.values():
            for layer, tap in zip(rows, step, strict=True):
                layer[ws, ts] = tap[bs, 0]
        self._commit_rows(waiting, dict(zip(self.draft.target_layer_ids, rows, strict=True)), positions, None)

    def _state(self, slots: torch.Tensor) -> DSparkState:
        return DSparkState(self.cache.draft_keys[:, slots], self.cache.draft_pos[slots])

    def _commit_rows(self, seqs: list[Sequence], taps: Mapping[int, torch.Tensor], positions: torch.Tensor,
                     keep: torch.Tensor | None) -> None:
        """Write the rows of ``taps`` at ``positions`` [B, L] (the first ``keep[b]`` of row b; all when None)."""
        slots = torch.tensor([s.slot for s in seqs], device=self.cache.device)
        state = self._state(slots)
        self.draft.stage(state, taps, positions)
        state.commit(keep)
        self.cache.draft_keys[:, slots] = state.keys
        self.cache.draft_pos[slots] = state.positions

    # ------------------------------------------------------------------ plain or speculative (spec_schedule.py)
    def speculate(self, seqs: list[Sequence]) -> bool:
        """Whether the next decode step of ``seqs`` drafts (True) or runs as a plain decode step (False).

        A user cost table or ``"fixed"``: always. Adaptive: the policy's choice from past steps; a batch with
        a seeded sampling request always speculates (its verification length must depend on itself alone,
        :meth:`verify_lengths`, and a plain step would draw its tokens differently)."""
        if self.policy is None:
            return True
        if any(not s.params.is_greedy and s.params.seed is not None for s in seqs):
            return True
        return self.policy.decide(self.caps(seqs), [s.spec_acceptance for s in seqs]) == SPEC

    def record_plain(self, seqs: list[Sequence]) -> None:
        """A plain decode step of ``seqs`` ran."""
        self.stats.record_plain(len(seqs))
        self._last = (PLAIN, len(seqs), 1, 0.0, 0.0)

    def observe_step(self, seconds: float) -> None:
        """The engine's wall time of the decode-only step that just ended (plain or speculative)."""
        measurement = self.measurement(seconds)
        if measurement is not None:
            self.observe_measurement(measurement)

    def measurement(self, seconds: float) -> list | None:
        """The step that just ended as ``[kind, batch, width, seconds, forward_s, flush_s]`` (what
        :meth:`observe_measurement` takes; JSON-able), or None when the policy has nothing to learn from it. Several
        ranks in lockstep (issue 28) all observe rank 0's measurement, one step late, so that their adaptive
        policies stay identical."""
        last, self._last = self._last, None
        if self.policy is None or last is None:
            return None
        kind, batch, width, forward, flush = last
        return [kind, batch, width, float(seconds), float(forward), float(flush)]

    def observe_measurement(self, measurement: list) -> None:
        """Feed one :meth:`measurement` (this process's or rank 0's) to the adaptive policy."""
        if self.policy is None:
            return
        kind, batch, width, seconds, forward, flush = measurement
        if kind == PLAIN:
            self.policy.costs.observe_plain(batch, seconds)
        else:
            self.policy.costs.observe_spec(batch, width, seconds - flush, forward)

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def propose(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft a block for every sequence: tokens [B, K] long, q [B, K, V] fp32 (None when every request is
        greedy: greedy acceptance never reads q), survival [B, K] fp32. Greedy requests draft by argmax in one
        batched draft forward; sampling requests one by one, from their own generator and with their own
        temperature / min-p / top-k / top-p (so q is what the target sampler would use, and a seeded request
        does not depend on its batch)."""
        device = self.cache.device
        model, draft = self.model, self.draft
        anchors = torch.tensor([s.token_at(s.num_computed, s.num_computed + 1)[0] for s in seqs], device=device)
        positions = torch.tensor([s.num_computed for s in seqs], device=device)
        slots = torch.tensor([s.slot for s in seqs], device=device)
        B, K, V = len(seqs), draft.block_size, model.config.vocab_size
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        survival = torch.zeros(B, K, dtype=torch.float32, device=device)
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        probs = torch.zeros(B, K, V, dtype=torch.float32, device=device) if sampled else None
        greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
        embed, head = model.embed.weight, model.head.weight
        if greedy:
            idx = torch.tensor(greedy, device=device)
            out = draft.propose(self._state(slots[idx]), anchors[idx], positions[idx], embed, head)
            tokens[idx], survival[idx] = out.tokens, out.survival
        for i in sampled:
            params: SamplingParams = seqs[i].params
            one = slice(i, i + 1)
            out = draft.propose(self._state(slots[one]), anchors[one], positions[one], embed, head, 1.0,
                                seqs[i].sampling.generator, lambda x, p=params: _filter(x, [p] * x.shape[0]))
            tokens[one], probs[one], survival[one] = out.tokens, out.probs, out.survival
        return tokens, probs, survival

    def caps(self, seqs: list[Sequence]) -> list[int]:
        """The most drafts each sequence may verify: ``max_len``, and no more than it can still emit - 1."""
        caps = []
        for seq in seqs:
            limit = seq.detokenizer.max_tokens
            left = self.max_len if limit is None else limit - len(seq.output_token_ids) - 1
            caps.append(max(0, min(self.max_len, left)))
        return caps

    def verify_lengths(self, seqs: list[Sequence], survival: Seq[Seq[float]]) -> list[int]:
        """Drafts each sequence verifies this step: a seeded sampling request its cap (:meth:`caps`), the others
        what :func:`schedule_verify_lengths` picks for them together from their survival [B][K] and the cost
        of a step at each length: the user's table, or with the adaptive policy the measured seconds of the
        whole speculative step at this batch size and the calibrated survival (the whole block before any
        step was measured).

        Which drafts are verified decides how many of a request's random draws a step takes and which tokens
        come from which draw; the scheduler's choice depends on the batch and on measured costs (so it differs
        between engines and runs). A seeded request verifies a length that depends on itself alone, so its
        tokens repeat in any engine, batch or preemption (greedy requests emit the target's tokens whatever the
        length)."""
        caps = self.caps(seqs)
        fixed = [not s.params.is_greedy and s.params.seed is not None for s in seqs]
        free = [b for b, f in enumerate(fixed) if not f]
        cost, rows = self.cost, [list(r) for r in survival]
        if self.policy is not None:
            cost = self.policy.costs.spec_times(len(seqs), self.max_len)
            rows = [self.policy.calibration.apply(r) for r in rows]
        chosen = schedule_verify_lengths([rows[b] for b in free], [caps[b] for b in free], cost)
        lengths = list(caps)
        for b, ell in zip(free, chosen, strict=True):
            lengths[b] = ell
        return lengths

    @torch.no_grad()
    def step(self, seqs: list[Sequence]) -> list[Verdict]:
        """One speculative decode step of ``seqs`` (context backlog, propose, schedule, verify, commit). Advances
        each ``num_computed`` by the anchor + accepted drafts (the engine clamps it when a stop cuts the tokens)
        and returns each sequence's :class:`Verdict`; the tokens are not appended here."""
        started = time.perf_counter()
        # sequences whose draft window (the last W committed positions) has no hole
        whole = [b for b, s in enumerate(seqs) if s.draft_context_from <= max(0, s.num_computed - self.window)]
        self._flush(seqs)
        flush = time.perf_counter() - started  # the plain steps' deferred work: not a cost of this step
        tokens, probs, survival = self.propose(seqs)
        raw = survival.tolist()
        lengths = self.verify_lengths(seqs, raw)
        T = 1 + max(lengths)
        device = self.cache.device
        anchors = torch.tensor([[s.token_at(s.num_computed, s.num_computed + 1)[0]] for s in seqs], device=device)
        ids = torch.cat((anchors, tokens[:, : T - 1]), 1)
        taps = TargetTaps(self.draft.target_layer_ids)
        started = time.perf_counter()
        logits, state = self.runner.verify(seqs, ids, taps)
        forward = time.perf_counter() - started
        drafts = tokens.tolist()
        walked = [0] * len(seqs)
        for b, seq in enumerate(seqs):
            if seq.grammar is not None:  # mask each position; verify the drafts the grammar can reach
                lengths[b], walked[b] = mask_draft_positions(logits[b, : lengths[b] + 1], seq.grammar,
                                                             drafts[b][: lengths[b]])
        verdicts = []
        for b, seq in enumerate(seqs):
            ell = lengths[b]
            verdicts.append(verify_sequence(self.sampler, logits[b, : ell + 1], seq.sampling, drafts[b][:ell],
                                            None if probs is None else probs[b, :ell]))
            if seq.grammar is not None:  # the matcher walked drafts: keep the accepted ones
                seq.grammar.rollback(walked[b] - verdicts[-1].accepted)
        accepted = [v.accepted for v in verdicts]
        self.runner.commit_verify(seqs, state, accepted)
        starts = torch.tensor([s.num_computed for s in seqs], device=device)
        positions = starts[:, None] + torch.arange(T, device=device)
        self._commit_rows(seqs, taps, positions, torch.tensor(accepted, device=device) + 1)
        for seq, ell, a in zip(seqs, lengths, accepted, strict=True):
            seq.num_computed += 1 + a
            seq.spec_accepted_tokens += a
            seq.spec_verify_steps += ell > 0
            self.stats.record(ell, a)
        if self.policy is not None:  # what the draft does with a whole window (holes: decode_taps)
            self.policy.calibration.observe([raw[b] for b in whole], [lengths[b] for b in whole],
                                            [accepted[b] for b in whole])
            for b in whole:
                seq, ell, a = seqs[b], lengths[b], accepted[b]
                if seq.spec_acceptance is None:
                    seq.spec_acceptance = SequenceAcceptance(self.max_len)
                seq.spec_acceptance.observe(ell, a)
            self._last = (SPEC, len(seqs), T, forward, flush)
        return verdicts


# ---------------------------------------------------------------------- engine construction
def speculative_max_len(model, method: str | None, max_len: int | None, cost_table, window_slack_rows: int) -> int:
    """Drafts a step verifies at most (0: no speculation) for the engine settings ``speculative`` (``method``),
    ``speculative_max_len`` (``max_len``), ``speculative_cost_table`` and ``window_slack_rows`` (SPEC.md §4.4).

    Raises ValueError for a length or cost table without a method, an unknown method, a checkpoint without a
    DSpark draft, a length outside [1, dspark_block_size], or fewer window slack rows than the length (the rows
    of rejected drafts must land in the ring's slack)."""
    if method is None:
        given = [name for name, value in (("speculative_max_len", max_len), ("speculative_cost_table", cost_table))
                 if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} needs speculative='dspark' (speculative is None: no "
                             f"speculative decoding)")
        return 0
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS} or None, got {method!r}")
    if model.mtp is None:
        raise ValueError("speculative='dspark' needs a DSpark draft, but this checkpoint has none "
                         "(num_nextn_predict_layers = 0)")
    block = model.config.dspark_block_size
    length = block if max_len is None else max_len
    if not 1 <= length <= block:
        raise ValueError(f"speculative_max_len ({length}) must be in [1, dspark_block_size ({block})]: the "
                         f"draft proposes dspark_block_size tokens per step")
    if window_slack_rows < length:
        raise ValueError(f"speculative_max_len ({length}) needs window_slack_rows >= {length} (got "
                         f"{window_slack_rows}): rows of rejected drafts must land in the ring's slack")
    return length


def build_speculator(model, cache, runner, sampler: Sampler, max_len: int, cost_table) -> DSparkSpeculator:
    """The engine's DSpark speculator verifying at most ``max_len`` drafts per step. ``cost_table``: None (the
    default: the adaptive :class:`~deepseek_v41.engine.spec_schedule.SpeculationPolicy`, which measures the
    engine's own steps and runs plain decode steps whenever they are faster), a list or dict
    (:func:`parse_cost_table`: every step speculates, lengths from this table) or ``"fixed"`` (every step
    verifies ``max_len`` drafts). Raises ValueError for any other string and for what :func:`parse_cost_table`
    refuses."""
    if isinstance(cost_table, str) and cost_table != FIXED:
        raise ValueError(f"speculative_cost_table must be a list, a dict, {FIXED!r} or None, got {cost_table!r}")
    cost = parse_cost_table(cost_table, max_len) if cost_table is not None and cost_table != FIXED else None
    policy = SpeculationPolicy(max_len, context_window=model.mtp.window) if cost_table is None else None
    return DSparkSpeculator(model, cache, runner, sampler, max_len, cost, policy)
