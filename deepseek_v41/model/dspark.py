"""DSpark draft model ``mtp.0..S-1``: target features, draft context KV, block backbone, Markov and confidence
heads, the cached draft step and the training objective (DSPARK.md §1–§4, §7, §8; MODEL_REFERENCE.md §3.17).

Positions (DSPARK.md §2): the target has committed positions 0..p and sampled the anchor t* at position p+1. The
draft block is ``[t*, noise x (K-1)]`` at positions p+1..p+K; row i predicts the token at p+2+i. Its context is
the last W = ``sliding_window`` committed positions (p-W, p], one KV row per draft layer built from main_x only.

- :meth:`DSparkDraft.propose` — one cached step over a :class:`DSparkState` (the rings of committed rows);
- :meth:`DSparkDraft.teacher_forced` — every anchor of whole sequences at once (training, exact, no cache);
- :func:`dspark_loss` — DSPARK.md §8's objective.

The draft shares the target's embedding and LM head: they are passed in (``embed_weight``, ``head_weight``
[V, D]), never copied, and the training path treats them as frozen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41.config import ModelConfig
from deepseek_v41.model.block import Block
from deepseek_v41.model.hyper import collapse
from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import RMSNorm
from deepseek_v41.plan import LayerSpec, build_layer_plan
from deepseek_v41.quant import fake_quant_fp8


class MarkovHead(nn.Module):
    """Rank-r bias from the previous token (DSPARK.md §3.3): ``e = embed[prev]``, ``bias = head · e``.

    ``embed.weight`` = W1 [V, r], ``head.weight`` = W2 [V, r]. ``forward(prev [...] long) -> (e [..., r] fp32,
    bias [..., V] fp32)`` (the reference computes the bias in fp32).
    """

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(prev).float()
        return e, e @ self.head.weight.float().t()


class ConfidenceHead(nn.Module):
    """Raw acceptance logit ``z = proj · [hpre ; e]`` (DSPARK.md §3.4): no bias, fp32, sigmoid left to the consumer.

    ``forward(hpre [..., D], e [..., r]) -> z [...] fp32``; hpre is the pre-norm collapsed hidden of the row and e
    the Markov embedding of its previous token.
    """

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(dim + rank, 1, bias=False)

    def forward(self, hpre: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return (torch.cat((hpre.float(), e.float()), -1) @ self.proj.weight.float().t()).squeeze(-1)


class SharedVocab:
    """How the draft applies the target's embedding and LM head, which it is handed as weights (``embed_weight``,
    ``head_weight`` [V, D]: shared, never copied; DSPARK.md §1): ``embed(ids [...] long, weight) -> [..., D]`` in
    the weight's dtype and ``logits(x [..., D], weight) -> [..., V]`` fp32 (the reference computes the base logits
    in fp32). A tensor-parallel model (issue 28) hands the draft its rank's vocabulary rows of both weights and
    replaces this by :class:`deepseek_v41.distributed.layers.VocabParallelSharedVocab` (the same values)."""

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, weight)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.float() @ weight.float().t()


class DSparkBlock(Block):
    """Draft stage ``mtp.k``: a window-only backbone block with the draft's MoE (``dspark_n_routed_experts``,
    top ``dspark_num_experts_per_tok``). The first stage also owns ``main_proj`` [D, n_taps * D] and
    ``main_norm``; the last ``norm``, ``markov_head`` and ``confidence_head`` (MODEL_REFERENCE.md §8 names). Its
    router is the backbone's gate function, ``gate_temp`` included: DSPARK.md §10 item 4 reuses the backbone's
    gate function for the draft [I]; mlx-lm's port drops ``mtp.*`` and cannot confirm either way."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, first: bool, last: bool):
        super().__init__(cfg, spec, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
        D = cfg.hidden_size
        if first:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * D, D, bias=False)
            self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(D, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(D, cfg.dspark_markov_rank)


class DraftContext:
    """KV context of one draft forward over N blocks of K rows (the window part of ``context.py``'s protocol).

    positions [N, K] (p+1..p+K); rows [S, N, P, d]: each draft layer's committed context rows (post-RoPE, FP8
    values); visible [N, P] bool: which of them lie in (p-W, p]. Every query of a block sees the same keys — all
    visible context rows and all K block rows: the block is bidirectional and the window is anchored at the last
    committed position (DSPARK.md §3.2). The shared attention's test ``q_pos - W < key_pos <= q_pos`` expresses
    exactly that when every visible key reports the anchor position p+1 (K <= W): key positions only decide
    visibility, the keys were rotated at their true positions before.
    """

    def __init__(self, positions: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, fake_quant: bool):
        self.positions = positions
        self.rows = rows
        self.fake_quant = fake_quant
        self.shared: dict = {}
        self.banded_window = False  # block rows report the anchor position: visibility by position only
        self.key_limit = None  # causal window (no image span in a draft block)
        anchor = positions[:, :1]
        self._key_pos = torch.cat((torch.where(visible, anchor, -1), anchor.expand_as(positions)), 1)

    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block = fake_quant_fp8(kv, 32) if self.fake_quant else kv  # FP8 block keys (DSPARK.md §3.2, §10 item 3)
        return torch.cat((self.rows[layer].to(kv.dtype), block), 1), self._key_pos


class DSparkState:
    """Draft context of B sequences: each draft layer's ring of W committed KV rows (DSPARK.md §3.1, §7).

    ``keys`` [S, B, W, d] (post-RoPE; FP8 values when fake-quant is on), ``positions`` [B, W] long (-1 = empty);
    position q lives in slot q mod W. Rows arrive in two steps: :meth:`stage` holds the rows of a target chunk
    (prompt, or anchor + verified drafts), :meth:`commit` writes only the accepted prefix of each sequence.
    Rejected rows never reach the ring, so a ring of exactly W rows suffices (DSPARK.md §7).
    """

    def __init__(self, keys: torch.Tensor, positions: torch.Tensor):
        self.keys = keys
        self.positions = positions
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(cls, num_layers: int, batch: int, window: int, head_dim: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> DSparkState:
        return cls(torch.zeros(num_layers, batch, window, head_dim, dtype=dtype, device=device),
                   torch.full((batch, window), -1, dtype=torch.long, device=device))

    def stage(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Hold rows [S, B, L, d] of positions [B, L] (-1 = padding), newer than every committed row; replaces
        anything staged before. Raises ValueError on shapes that do not fit the ring."""
        S, B, W, d = self.keys.shape
        if rows.dim() != 4 or rows.shape[0] != S or rows.shape[1] != B or rows.shape[3] != d:
            raise ValueError(f"staged rows must be [{S}, {B}, L, {d}], got {tuple(rows.shape)}")
        if positions.shape != rows.shape[1:3]:
            raise ValueError(f"positions {tuple(positions.shape)} must be [batch, L] = {tuple(rows.shape[1:3])}")
        self._staged = (rows, positions)

    def discard(self) -> None:
        """Drop the staged rows (a whole chunk rejected)."""
        self._staged = None

    def commit(self, accepted: torch.Tensor | None = None) -> None:
        """Write the first ``accepted[b]`` staged rows of sequence b (all when None; [B] long) at pos mod W and
        clear the stage. Only the newest row per slot is written. Raises RuntimeError when nothing is staged."""
        if self._staged is None:
            raise RuntimeError("commit() without stage(): nothing to commit")
        rows, pos = self._staged
        self._staged = None
        S, B, L, d = rows.shape
        W = self.positions.shape[1]
        keep = pos >= 0
        if accepted is not None:
            keep = keep & (torch.arange(L, device=pos.device) < accepted.to(pos.device)[:, None])
        slot = torch.where(keep, pos % W, W)  # slot W: a scratch column for rows that are not written
        newest = torch.full((B, W + 1), -1, dtype=pos.dtype, device=pos.device)
        newest = newest.scatter_reduce(1, slot, torch.where(keep, pos, -1), "amax")
        slot = torch.where(keep & (pos == newest.gather(1, slot)), slot, W)
        positions = torch.cat((self.positions, self.positions[:, :1]), 1).scatter(1, slot, pos)
        keys = torch.cat((self.keys, self.keys[:, :, :1]), 2)
        keys = keys.scatter(2, slot[None, :, :, None].expand(S, B, L, d), rows.to(keys.dtype))
        self.positions, self.keys = positions[:, :W], keys[:, :, :W]

    def window(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context of anchors at ``position`` [B]: (keys [S, B, W, d], visible [B, W]) — rows of (p-W, p], p =
        position - 1."""
        W = self.positions.shape[1]
        last = position[:, None] - 1
        visible = (self.positions >= 0) & (self.positions <= last) & (self.positions > last - W)
        return self.keys, visible


class Proposal(NamedTuple):
    """One draft step for B sequences, K = block size.

    tokens [B, K] long: d_1..d_K. probs [B, K, V] fp32: q_i, the distribution d_{i+1} was drawn from (one-hot
    when greedy) — what rejection sampling needs (DSPARK.md §6.2). logits [B, K, V] fp32: Markov-corrected
    logits L_i before temperature. confidence [B, K] fp32: raw logits z_i. survival [B, K] fp32:
    a_j = prod_{i<=j} sigmoid(z_i / T_i) (DSPARK.md §4).
    """

    tokens: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    survival: torch.Tensor


class TeacherForced(NamedTuple):
    """Draft outputs at A anchors per sequence (DSPARK.md §8).

    logits [B, A, K, V] fp32 (Markov bias from the true previous tokens), confidence [B, A, K] fp32 (raw),
    labels [B, A, K] long (token at s+1+i; -1 outside the sequence), mask [B, A, K] bool (slot supervised),
    anchors [B, A] long (-1 = padding).
    """

    logits: torch.Tensor
    confidence: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    anchors: torch.Tensor


class DSparkDraft(nn.ModuleList):
    """The DSpark draft stages ``mtp.0..S-1`` (S = ``num_nextn_predict_layers``) and the draft step around them.

    Raises ValueError when the config has no draft layers or a block longer than the window.
    ``fake_quant`` (default True) switches the FP8 round trip of context rows and block keys.
    """

    def __init__(self, config: ModelConfig):
        specs = build_layer_plan(config).dspark_layers
        if not specs:
            raise ValueError("num_nextn_predict_layers is 0: the config has no DSpark draft")
        if config.dspark_block_size > config.sliding_window:
            raise ValueError(f"dspark_block_size ({config.dspark_block_size}) exceeds sliding_window "
                             f"({config.sliding_window})")
        super().__init__(DSparkBlock(config, s, i == 0, i == len(specs) - 1) for i, s in enumerate(specs))
        self.config = config
        self.block_size = config.dspark_block_size
        self.window = config.sliding_window
        self.noise_token_id = config.dspark_noise_token_id
        self.target_layer_ids = tuple(config.dspark_target_layer_ids)
        self.fake_quant = True
        self.vocab = SharedVocab()  # how the handed embed / head weights are applied (sharded: vocab-parallel)

    # ------------------------------------------------------------------ context (DSPARK.md §3.1)
    def main_x(self, taps: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """``main_norm(main_proj(concat_j mean_streams taps[j]))``: taps maps each target layer id (in
        ``dspark_target_layer_ids`` order) to its **input** residual streams [B, T, hc, D] -> [B, T, D].
        Raises ValueError when a target layer is missing."""
        missing = [j for j in self.target_layer_ids if j not in taps]
        if missing:
            raise ValueError(f"taps of target layers {missing} are missing (need {list(self.target_layer_ids)})")
        feats = torch.cat([taps[j].float().mean(-2).to(taps[j].dtype) for j in self.target_layer_ids], -1)
        return self[0].main_norm(self[0].main_proj(feats))

    def context_rows(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each stage's window row of committed positions: ``fp8(rope_q(kv_norm_s(wkv_s(main_x))))`` with
        stage s's own ``attn.wkv``/``attn.kv_norm``/RoPE table at the row's own position q (no ``attn_norm``:
        main_x is already normalised). main_x [B, L, D], positions [B, L] -> [S, B, L, d]."""
        rows = []
        for block in self:
            attn = block.attn
            kv = attn.rope(attn.kv_norm(attn.wkv(main_x)), positions)
            rows.append(fake_quant_fp8(kv, 32) if self.fake_quant else kv)
        return torch.stack(rows)

    def new_state(self, batch: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> DSparkState:
        """An empty :class:`DSparkState` for ``batch`` sequences."""
        return DSparkState.empty(len(self), batch, self.window, self.config.head_dim, dtype, device)

    def stage(self, state: DSparkState, taps: Mapping[int, torch.Tensor], positions: torch.Tensor) -> None:
        """Stage the context rows of a target chunk: taps [B, L, hc, D] per target layer at positions [B, L]."""
        state.stage(self.context_rows(self.main_x(taps), positions), positions)

    # ------------------------------------------------------------------ block backbone (DSPARK.md §3.2)
    def backbone(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor,
                 embed_weight: torch.Tensor) -> torch.Tensor:
        """Pre-norm collapsed hidden ``hpre`` [N, K, D] of blocks ids [N, K] at positions [N, K] over context
        rows [S, N, P, d] (visible [N, P]): shared embedding into hc streams, one-hot pre on stream 0, the draft
        stages, collapse with the last stage's FFN ``pre``."""
        h = self.vocab.embed(ids, embed_weight)
        N, K, D = h.shape
        hc = self.config.hc_mult
        streams = h[:, :, None, :].expand(N, K, hc, D).contiguous()
        pre = torch.zeros(N, K, hc, dtype=torch.float32, device=h.device)
        pre[..., 0] = 1.0
        ctx = DraftContext(positions, rows, visible, self.fake_quant)
        for block in self:
            streams, pre = block(streams, pre, ctx)
        return collapse(streams, pre)

    def base_logits(self, hpre: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Base logits U = head(norm(hpre)) in fp32: [..., D] -> [..., V]."""
        return self.vocab.logits(self[-1].norm(hpre), head_weight)

    # ------------------------------------------------------------------ cached step (DSPARK.md §3.3, §3.4, §4)
    @torch.no_grad()
    def propose(self, state: DSparkState, last_token: torch.Tensor, position: torch.Tensor,
                embed_weight: torch.Tensor, head_weight: torch.Tensor, temperature: float | torch.Tensor = 0.0,
                generator: torch.Generator | None = None,
                logits_processor: Callable[[torch.Tensor], torch.Tensor] | None = None,
                sts_temperatures: torch.Tensor | None = None) -> Proposal:
        """Draft K tokens after the anchor ``last_token`` [B] at ``position`` [B] (p+1: the positions committed to
        ``state`` are <= p), reading the committed rows of ``state`` (never writing them).

        Row i adds the Markov bias of its previous token (the anchor, then the row's own previous draft) and
        draws d_{i+1}: argmax where ``temperature`` (float or [B]) is <= 0, else a sample from
        ``softmax(logits_processor(L_i / temperature))`` by the exponential race with ``generator``.
        ``sts_temperatures`` [K] scale the confidence logits before the sigmoid (default 1). Returns a
        :class:`Proposal`. Raises ValueError on mismatched shapes.
        """
        B, K = last_token.shape[0], self.block_size
        if last_token.dim() != 1 or position.shape != last_token.shape or state.positions.shape[0] != B:
            raise ValueError(f"last_token {tuple(last_token.shape)} and position {tuple(position.shape)} must be "
                             f"[batch] with batch = the state's {state.positions.shape[0]}")
        device = last_token.device
        positions = position[:, None] + torch.arange(K, device=device)
        noise = torch.full((B, K - 1), self.noise_token_id, dtype=last_token.dtype, device=device)
        keys, visible = state.window(position)
        hpre = self.backbone(torch.cat((last_token[:, None], noise), 1), positions, keys, visible, embed_weight)
        base = self.base_logits(hpre, head_weight)
        tau = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(B)
        all_greedy = not isinstance(temperature, torch.Tensor) and temperature <= 0
        markov, confidence_head = self[-1].markov_head, self[-1].confidence_head
        prev, tokens, probs, logits, conf = last_token, [], [], [], []
        for i in range(K):
            e, bias = markov(prev)
            row = base[:, i] + bias
            conf.append(confidence_head(hpre[:, i], e))
            top = row.argmax(-1)
            q = torch.zeros_like(row).scatter_(1, top[:, None], 1.0)
            if not all_greedy:
                greedy = tau <= 0
                scaled = row / torch.where(greedy, 1.0, tau)[:, None]
                sampled_q = torch.softmax(logits_processor(scaled) if logits_processor else scaled, -1)
                race = torch.empty_like(sampled_q).exponential_(generator=generator)
                drawn = (sampled_q / race.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)
                top = torch.where(greedy, top, drawn)
                q = torch.where(greedy[:, None], q, sampled_q)
            tokens.append(top)
            probs.append(q)
            logits.append(row)
            prev = top
        z = torch.stack(conf, 1)
        scaled_z = z if sts_temperatures is None else z / sts_temperatures.to(z)
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(logits, 1), z,
                        torch.sigmoid(scaled_z).cumprod(-1))

    # ------------------------------------------------------------------ training path (DSPARK.md §8)
    def teacher_forced(self, taps: Mapping[int, torch.Tensor], input_ids: torch.Tensor, embed_weight: torch.Tensor,
                       head_weight: torch.Tensor, anchors: torch.Tensor | None = None,
                       loss_mask: torch.Tensor | None = None, anchor_chunk: int = 64) -> TeacherForced:
        """Draft logits and confidence at every anchor of whole sequences, exactly as :meth:`propose` computes
        them after committing positions < s, but with the true previous tokens in the Markov bias.

        taps: target layer id -> input streams [B, T, hc, D] of positions 0..T-1 (detached: the target is
        frozen); input_ids [B, T]; anchors [B, A] long (-1 = padding; default every s in 1..T-2). Anchor s:
        block [x_s, noise...] at s..s+K-1 over the committed rows (s-1-W, s-1], labels x_{s+1..s+K}; a slot is
        supervised while its label is inside the sequence and ``loss_mask`` [B, T] stays on from s+1 (cumprod).
        The shared embedding and head are used detached (frozen, DSPARK.md §8). Anchors run ``anchor_chunk`` at
        a time (memory O(B * chunk * (S * W * d + K * V))). Raises ValueError when there is no anchor.
        """
        B, T = input_ids.shape
        K, W = self.block_size, self.window
        device = input_ids.device
        if anchors is None:
            anchors = torch.arange(1, max(T - 1, 1), device=device).expand(B, -1)
        if anchors.shape[1] == 0:
            raise ValueError(f"no anchors: sequences of {T} tokens need at least 3 for one anchor")
        embed_weight, head_weight = embed_weight.detach(), head_weight.detach()
        main_x = self.main_x({j: taps[j].detach() for j in self.target_layer_ids if j in taps})
        rows = self.context_rows(main_x, torch.arange(T, device=device).expand(B, T))  # [S, B, T, d]
        S, d = rows.shape[0], rows.shape[-1]
        offsets, back = torch.arange(K, device=device), torch.arange(-W, 0, device=device)
        logits, conf = [], []
        for a0 in range(0, anchors.shape[1], anchor_chunk):
            s = anchors[:, a0:a0 + anchor_chunk].clamp(min=0)
            a = s.shape[1]
            ctx_pos = s[..., None] + back  # [B, a, W]: positions s-W..s-1
            ctx_rows = rows.gather(2, ctx_pos.clamp(min=0).view(1, B, a * W, 1).expand(S, B, a * W, d))
            pos = s[..., None] + offsets  # [B, a, K]
            noise = torch.full((B, a, K - 1), self.noise_token_id, dtype=input_ids.dtype, device=device)
            ids = torch.cat((input_ids.gather(1, s)[..., None], noise), -1)
            hpre = self.backbone(ids.view(B * a, K), pos.view(B * a, K), ctx_rows.view(S, B * a, W, d),
                                 (ctx_pos >= 0).view(B * a, W), embed_weight)
            prev = input_ids.gather(1, pos.clamp(max=T - 1).view(B, a * K)).view(B * a, K)
            e, bias = self[-1].markov_head(prev)
            logits.append((self.base_logits(hpre, head_weight) + bias).view(B, a, K, -1))
            conf.append(self[-1].confidence_head(hpre, e).view(B, a, K))
        label_pos = anchors[..., None] + 1 + offsets  # [B, A, K]
        inside = (anchors >= 0)[..., None] & (label_pos < T)
        flat = label_pos.clamp(0, T - 1).view(B, -1)
        labels = torch.where(inside, input_ids.gather(1, flat).view(label_pos.shape), -1)
        mask = inside
        if loss_mask is not None:
            mask = (inside & loss_mask.gather(1, flat).view(label_pos.shape)).long().cumprod(-1).bool()
        return TeacherForced(torch.cat(logits, 1), torch.cat(conf, 1), labels, mask, anchors)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """Up to ``num_anchors`` anchors per sequence, uniformly without replacement among positions s >= 1 whose
    token and next token are in ``loss_mask`` [B, T] bool (DSPARK.md §8 step 1): [B, num_anchors] long,
    ascending, padded with -1."""
    B, T = loss_mask.shape
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, 1:T - 1] = loss_mask[:, 1:T - 1] & loss_mask[:, 2:]
    score = torch.rand(B, T, generator=generator, device=loss_mask.device).masked_fill(~ok, -1.0)
    top = score.topk(min(num_anchors, T), -1)
    picked = torch.where(top.values >= 0, top.indices, T).sort(-1).values
    picked = torch.where(picked == T, -1, picked)
    return F.pad(picked, (0, num_anchors - picked.shape[1]), value=-1)


def dspark_loss(out: TeacherForced, target_logits: torch.Tensor, decay: float | None = None,
                weights: tuple[float, float, float] = (0.1, 0.9, 1.0)) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DSpark training objective (DSPARK.md §8, paper eqs. 9–12): ``L = 0.1 L_ce + 0.9 L_tv + 1.0 L_conf``.

    With p^d_i = softmax(draft logits of slot i), p^t_i = softmax(target logits at position s+i) (the target's
    distribution for the same label, temperature 1, detached), w_i = exp(-i / decay) on supervised slots
    (decay defaults to the block size; DSPARK.md §10 item 5):

    - L_ce = Σ w_i (-log p^d_i(x_{s+1+i})) / Σ w;
    - L_tv = Σ w_i ||p^d_i - p^t_i||_1 / Σ w (the raw L1, not halved);
    - L_conf = Σ w_i BCE(sigmoid(z_i), c*_i) / Σ w, soft label c*_i = clamp(1 - ½||p^d_i - p^t_i||_1, 0, 1)
      without gradient.

    out: :meth:`DSparkDraft.teacher_forced`'s result; target_logits [B, T, V]. Returns (loss, stats) with
    detached stats ``ce``, ``tv``, ``conf`` and ``acceptance`` [K] (mean analytic acceptance 1 - ½L1 per slot).
    """
    B, A, K, V = out.logits.shape
    T = target_logits.shape[1]
    offsets = torch.arange(K, device=out.logits.device)
    rows = (out.anchors.clamp(min=0)[..., None] + offsets).clamp(max=T - 1).view(B, A * K, 1).expand(B, A * K, V)
    p_t = torch.softmax(target_logits.detach().float().gather(1, rows).view(B, A, K, V), -1)
    logp_d = torch.log_softmax(out.logits.float(), -1)
    ce = -logp_d.gather(-1, out.labels.clamp(min=0)[..., None]).squeeze(-1)
    l1 = (logp_d.exp() - p_t).abs().sum(-1)
    label = (1 - 0.5 * l1).clamp(0, 1).detach()
    bce = F.binary_cross_entropy_with_logits(out.confidence.float(), label, reduction="none")
    w = torch.exp(-offsets.float() / (decay or K)) * out.mask
    total = w.sum().clamp(min=1e-20)
    terms = {name: (w * x).sum() / total for name, x in (("ce", ce), ("tv", l1), ("conf", bce))}
    loss = weights[0] * terms["ce"] + weights[1] * terms["tv"] + weights[2] * terms["conf"]
    slots = out.mask.float()
    acceptance = ((1 - 0.5 * l1.detach()) * slots).sum((0, 1)) / slots.sum((0, 1)).clamp(min=1)
    return loss, {**{k: v.detach() for k, v in terms.items()}, "acceptance": acceptance}
