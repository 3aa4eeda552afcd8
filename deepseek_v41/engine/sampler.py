"""The sampler: logits [B, V] -> one token per row, each row with its own parameters and generator.

Processing order (vLLM v1, ``vllm/v1/sample/sampler.py``), on fp32 logits:
  0. structured outputs: before the sampler, the engine sets the logits of the tokens a constrained row's grammar
     does not allow to -inf (``deepseek_v41.structured``; vLLM applies its grammar bitmask there too), so every
     step below, and the logprobs, see the masked logits;
  1. min_tokens: EOS (unless ``ignore_eos``) and ``stop_token_ids`` -> -inf while fewer than ``min_tokens``
     tokens are generated;
  2. penalties (vLLM's formulas): repetition over prompt + output tokens (positive logits / r, negative * r),
     then ``logit -= frequency * count + presence * [count > 0]`` over output tokens;
  3. greedy rows (``temperature < 1e-5``) take the argmax here;
  4. temperature: ``logits / T``;
  5. min-p: drop tokens with ``p < min_p * max p``;
  6. top-k: drop logits below the k-th largest (ties with it kept);
  7. top-p: over the distribution left by top-k, keep the smallest most-likely set whose mass reaches
     ``top_p`` (every token tied with its least likely member kept);
  8. ``probs = softmax(logits)`` and the reference's exponential race ``argmax(probs / Exp(1))``
     (MODEL_REFERENCE.md §7; equivalent to Gumbel-max), drawn from the row's own ``torch.Generator``.
Steps 1 and 2 commute (a -inf logit stays -inf). Top-k, top-p and min-p use thresholds on values, never
sort indices, so ties and the batch around a row cannot change which tokens survive.

Batch invariance: every step above is row-wise, and each row draws exactly V exponentials per sampled position
from its own generator, so a request's tokens do not depend on which other requests share its batch, and a
seeded request repeats across runs on the same device type.

Logprobs follow vLLM's default ``logprobs_mode="raw_logprobs"``: ``log_softmax`` of the logits as given to the
sampler, before min_tokens, penalties, temperature and filtering. ``logprobs_mode="processed_logprobs"`` returns
the log of the distribution the token was drawn from (after all processing; for greedy rows after penalties).

Source: SPEC.md §4.4; MODEL_REFERENCE.md §7; DSPARK.md §6.2 (``probs`` and ``sample_row`` for lossless
speculative sampling).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from deepseek_v41 import kernels
from deepseek_v41.engine.sampling_params import SamplingParams

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


@dataclass(eq=False)
class SamplingState:
    """Per-request sampling state: the parameters, the request's generator and the tokens the penalties read.

    Args:
        params: the request's :class:`SamplingParams`.
        prompt_token_ids: prompt ids (the repetition penalty reads them).
        eos_token_id: the model's EOS id (min_tokens masks it unless ``params.ignore_eos``); None = no EOS.
        output_token_ids: generated ids so far. The engine may pass its own list and append to it; the sampler
            only reads it, and treats it as append-only (it counts only the new tail each step).
        device: where the generator lives; it must be the device of the logits given to the sampler.
        generator: a generator to use as is (e.g. from an engine-level seed); by default one is created and seeded
            with ``params.seed``, or with a fresh 63-bit seed from the OS when the seed is None.

    Attributes:
        seed: the seed the generator was given (None when ``generator`` was passed in).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    device: torch.device | str = "cpu"
    generator: torch.Generator | None = None
    seed: int | None = field(init=False, default=None)
    min_tokens_stop_ids: list[int] = field(init=False, default_factory=list)
    _counts: Tensor | None = field(init=False, default=None, repr=False)
    _num_counted: int = field(init=False, default=0, repr=False)
    _prompt_mask: Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.generator is None:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(self.seed)
        # Fixed for the request's life: what min_tokens masks.
        self.min_tokens_stop_ids = self.params.min_tokens_stop_ids(self.eos_token_id)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far (``len(output_token_ids)``)."""
        return len(self.output_token_ids)

    def output_counts(self, vocab_size: int, device: torch.device) -> Tensor:
        """Occurrences of each token id in ``output_token_ids``: [V] fp32, updated with the new tail only."""
        n = len(self.output_token_ids)
        if (self._counts is None or self._counts.shape[0] != vocab_size or self._counts.device != device
                or n < self._num_counted):
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._num_counted = 0
        if n > self._num_counted:
            new = _ids_tensor(self.output_token_ids[self._num_counted:], vocab_size, device, "output_token_ids")
            self._counts.index_add_(0, new, torch.ones(new.shape[0], device=device))
            self._num_counted = n
        return self._counts

    def prompt_mask(self, vocab_size: int, device: torch.device) -> Tensor:
        """[V] bool, True at every token id that occurs in the prompt (computed once)."""
        if self._prompt_mask is None or self._prompt_mask.shape[0] != vocab_size or self._prompt_mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            mask[_ids_tensor(self.prompt_token_ids, vocab_size, device, "prompt_token_ids")] = True
            self._prompt_mask = mask
        return self._prompt_mask


class Logprob(NamedTuple):
    """One token's logprob and its 1-based rank in the vocabulary (vLLM's ``Logprob`` without the text)."""

    logprob: float
    rank: int


@dataclass
class LogprobsTensors:
    """Logprobs of a sampled batch (vLLM's layout).

    Attributes:
        token_ids: [B, 1 + N] int64; column 0 the sampled token, then the top-N ids by logprob (N = the largest
            ``logprobs`` in the batch).
        logprobs: [B, 1 + N] fp32, the logprobs of those ids.
        ranks: [B] int64, rank of the sampled token: the number of tokens with logprob >= its own (1 = top).
    """

    token_ids: Tensor
    logprobs: Tensor
    ranks: Tensor

    def to_dict(self, row: int, num_logprobs: int) -> dict[int, Logprob]:
        """Row ``row`` as vLLM returns it: the sampled token plus the top ``num_logprobs`` tokens.

        Returns: token id -> :class:`Logprob`; ``num_logprobs`` or ``num_logprobs + 1`` entries.
        """
        ids = self.token_ids[row].tolist()
        lps = self.logprobs[row].tolist()
        out = {ids[0]: Logprob(lps[0], int(self.ranks[row]))}
        for rank in range(1, num_logprobs + 1):
            out.setdefault(ids[rank], Logprob(lps[rank], rank))
        return out


@dataclass
class SampleOutput:
    """What :meth:`Sampler.sample` returns.

    Attributes:
        token_ids: [B] int64, the sampled (or greedy) token of each row.
        logprobs: :class:`LogprobsTensors` for every row (computed for the batch; read only the rows that asked,
            with their own ``params.logprobs``), or None when no row asked.
    """

    token_ids: Tensor
    logprobs: LogprobsTensors | None = None


class _Row(NamedTuple):
    """One logits row: its request state, and ``drafts[:num_drafts]`` decided after ``state.output_token_ids``."""

    state: SamplingState
    drafts: Sequence[int] = ()
    num_drafts: int = 0  # a count, not a slice: K positions would otherwise copy O(K^2) ids


class Sampler:
    """Samples one token per logits row with per-request parameters (see the module docstring for the order).

    Args:
        logprobs_mode: ``"raw_logprobs"`` (vLLM's default: before any processing) or ``"processed_logprobs"``
            (the distribution sampled from).

    Raises:
        ValueError: an unknown ``logprobs_mode``.
    """

    def __init__(self, logprobs_mode: LogprobsMode = "raw_logprobs"):
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def sample(self, logits: Tensor, rows: Sequence[SamplingState]) -> SampleOutput:
        """Sample the next token of every row.

        Args:
            logits: [B, V] fp32 (other float dtypes are converted), row i belonging to ``rows[i]``; not modified.
            rows: B sampling states; row i draws from ``rows[i].generator`` only.

        Returns:
            :class:`SampleOutput` with ``token_ids`` [B] int64 and logprobs when any row asked for them.

        Raises:
            ValueError: ``logits`` not 2-D, its row count not ``len(rows)``, or a token id of a prompt/output
                outside [0, V).
        """
        logits = _check_logits(logits, len(rows))
        return self._run(logits, [_Row(state) for state in rows], joint_state=None)

    def sample_row(self, logits: Tensor, state: SamplingState, draft_token_ids: Sequence[int] = ()) -> SampleOutput:
        """Sample K consecutive positions of one request at once (speculative verification).

        Position k is processed as if ``draft_token_ids[:k]`` had already been generated (penalties and min_tokens
        see them); the K draws come from ``state.generator`` in one [K, V] call.

        Args:
            logits: [K, V] fp32, the target's logits at K consecutive positions of one sequence.
            state: the request's sampling state.
            draft_token_ids: the tokens at positions 0..K-2 (at least K-1 of them; extra ones are ignored).

        Returns:
            :class:`SampleOutput` with ``token_ids`` [K] int64.

        Raises:
            ValueError: bad ``logits`` shape or fewer than K-1 draft tokens.
        """
        return self._run(*self._positions(logits, state, draft_token_ids), joint_state=state)

    def probs(self, logits: Tensor, state: SamplingState, draft_token_ids: Sequence[int] = ()) -> Tensor:
        """The distribution the sampler draws from at K consecutive positions of one request.

        Same processing and the same ``draft_token_ids`` contract as :meth:`sample_row`; greedy requests give a
        one-hot at the argmax, which makes speculative acceptance "draft == argmax" (DSPARK.md §6.2).

        Returns:
            [K, V] fp32, each row summing to 1.
        """
        logits, positions = self._positions(logits, state, draft_token_ids)
        logits = _penalise(logits, positions)
        if state.params.is_greedy:
            return torch.nn.functional.one_hot(argmax(logits), logits.shape[1]).to(torch.float32)
        return torch.softmax(_filter(logits, [state.params] * logits.shape[0]), dim=-1)

    @staticmethod
    def _positions(logits: Tensor, state: SamplingState, draft_token_ids: Sequence[int]) -> tuple[Tensor, list[_Row]]:
        logits = _check_logits(logits, None)
        k = logits.shape[0]
        if len(draft_token_ids) < k - 1:
            raise ValueError(f"{k} positions need at least {k - 1} draft_token_ids (the tokens before positions "
                             f"1..{k - 1}), got {len(draft_token_ids)}")
        return logits, [_Row(state, draft_token_ids, i) for i in range(k)]

    def _run(self, logits: Tensor, rows: list[_Row], joint_state: SamplingState | None) -> SampleOutput:
        want_logprobs = [r.state.params.logprobs for r in rows if r.state.params.logprobs is not None]
        raw = torch.log_softmax(logits, dim=-1) if want_logprobs and self.logprobs_mode == "raw_logprobs" else None
        penalised = _penalise(logits, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        processed = penalised if want_logprobs and self.logprobs_mode == "processed_logprobs" else None

        greedy = [i for i, r in enumerate(rows) if r.state.params.is_greedy]
        if len(greedy) == len(rows):  # every row greedy (no copy of the rows, no scatter)
            tokens = argmax(penalised)
        elif greedy:
            index = torch.tensor(greedy, device=logits.device)
            tokens[index] = argmax(penalised[index])
        rand = [i for i, r in enumerate(rows) if not r.state.params.is_greedy]
        if rand:
            index = torch.tensor(rand, device=logits.device)
            filtered = _filter(penalised[index], [rows[i].state.params for i in rand])
            probs = torch.softmax(filtered, dim=-1)
            if joint_state is not None:
                tokens[index] = exponential_race(probs, joint_state.generator)
            else:
                for j, i in enumerate(rand):
                    tokens[i] = exponential_race(probs[j:j + 1], rows[i].state.generator)[0]
            if processed is not None:
                processed = processed.index_copy(0, index, filtered)

        if not want_logprobs:
            return SampleOutput(tokens)
        logprobs = raw if raw is not None else torch.log_softmax(processed, dim=-1)
        return SampleOutput(tokens, _gather_logprobs(logprobs, tokens, min(max(want_logprobs), logits.shape[1])))



def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for x [..., V]: int64 [...], the first index of the largest value (NaN counts as the
    largest), as ``x.max(dim=-1).indices`` (documented to give the first one) computes it; fp32 rows on the CPU by
    :func:`deepseek_v41.kernels.argmax` (8 x 8192 on one thread: ~40-90 µs in ATen, ~15 there with its Python)."""
    if x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0 and kernels.usable(x):
        return kernels.argmax(x)
    return x.max(dim=-1).indices


def exponential_race(probs: Tensor, generator: torch.Generator) -> Tensor:
    """Draw one token per row by the reference's exponential race: ``argmax(probs / Exp(1))``.

    Equivalent to sampling from ``probs`` (Gumbel-max in the probability domain; MODEL_REFERENCE.md §7). Draws
    exactly ``probs.numel()`` exponentials from ``generator``. Zero-probability tokens are never drawn.

    Args:
        probs: [K, V] fp32 non-negative, rows not necessarily normalised (the argmax ignores a row's scale).
        generator: on ``probs.device``.

    Returns:
        [K] int64 token ids.
    """
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # exponential_ may return exactly 0 (-log1p(-u) at u = 0); 0/0 would be NaN and argmax would pick it.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return argmax(probs / noise)


def _check_logits(logits: Tensor, rows: int | None) -> Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if rows is not None and logits.shape[0] != rows:
        raise ValueError(f"logits has {logits.shape[0]} rows but {rows} sampling states were given")
    return logits.float()


def _ids_tensor(ids: Sequence[int], vocab_size: int, device: torch.device, what: str) -> Tensor:
    ids = list(ids)
    # Checked on the host list: a check on the tensor would synchronise with the device every step.
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"{what} holds ids outside [0, {vocab_size}): min {min(ids)}, max {max(ids)}")
    return torch.tensor(ids, dtype=torch.long, device=device)


def _penalise(logits: Tensor, rows: Sequence[_Row]) -> Tensor:
    """min_tokens masking and repetition/frequency/presence penalties: [N, V], ``logits`` itself when no row has
    either (callers do not modify the result), else a new tensor."""
    n, vocab = logits.shape
    out = logits
    mask_rows: list[int] = []
    mask_cols: list[int] = []
    for i, r in enumerate(rows):
        if r.state.num_generated + r.num_drafts < r.state.params.min_tokens:
            # Ids >= V cannot be sampled anyway; masking them would index out of range.
            cols = [t for t in r.state.min_tokens_stop_ids if t < vocab]
            mask_rows += [i] * len(cols)
            mask_cols += cols
    if mask_rows:
        out = logits.clone()
        out[torch.tensor(mask_rows, device=out.device), torch.tensor(mask_cols, device=out.device)] = float("-inf")

    pen = [i for i, r in enumerate(rows) if _has_penalties(r.state.params)]
    if not pen:
        return out
    device = out.device
    counts, prompt = [], []
    for i in pen:
        state, drafts, num_drafts = rows[i]
        c = state.output_counts(vocab, device)
        if num_drafts:
            drafts = _ids_tensor(drafts[:num_drafts], vocab, device, "draft_token_ids")
            c = c + torch.bincount(drafts, minlength=vocab)
        counts.append(c)
        # Only the repetition penalty reads the prompt; skip building its mask otherwise.
        prompt.append(state.prompt_mask(vocab, device) if state.params.repetition_penalty != 1.0
                      else torch.zeros(vocab, dtype=torch.bool, device=device))
    counts = torch.stack(counts)
    seen = counts > 0
    prompt = torch.stack(prompt)
    params = [rows[i].state.params for i in pen]
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    index = torch.tensor(pen, device=device)
    x = out[index]
    r = torch.where(prompt | seen, rep, 1.0)
    x = torch.where(x > 0, x / r, x * r)
    x = x - freq * counts - presence * seen
    return out.index_copy(0, index, x)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _filter(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Temperature, min-p, top-k, top-p on [R, V] logits of random-sampling rows; dropped tokens -> -inf."""
    device = logits.device
    x = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    neg_inf = float("-inf")
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), neg_inf)
    vocab = x.shape[1]
    use_p = [p.top_p < 1.0 for p in params]
    if not any(0 < p.top_k < vocab for p in params) and not any(use_p):
        return x
    ordered = x.sort(dim=-1, descending=True).values
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    threshold = ordered.gather(1, (k - 1)[:, None])  # the k-th largest logit; V-th (the minimum) when off
    if any(use_p):
        ordered = ordered.masked_fill(ordered < threshold, neg_inf)
        sorted_probs = torch.softmax(ordered, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
        # mass_before is non-decreasing and 0 at the top token, so the kept prefix has length >= 1.
        keep = (mass_before < top_p).sum(dim=-1, keepdim=True)
        p_threshold = ordered.gather(1, keep - 1)
        on = torch.tensor(use_p, device=device)[:, None]
        threshold = torch.where(on, torch.maximum(threshold, p_threshold), threshold)
    return x.masked_fill(x < threshold, neg_inf)


def _gather_logprobs(logprobs: Tensor, tokens: Tensor, num: int) -> LogprobsTensors:
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    top = logprobs.topk(num, dim=-1)
    return LogprobsTensors(torch.cat([tokens[:, None], top.indices], dim=1), torch.cat([chosen, top.values], dim=1),
                           ranks)
