"""DSpark draft model (issue 7, model part; DSPARK.md §1–§4, §7, §8, MODEL_REFERENCE.md §3.17, §8).

Oracles: the checkpoint name/shape table of MODEL_REFERENCE.md §8 / DSPARK.md §1; ``oracle_step``, a float64
re-derivation of one draft step written from DSPARK.md §3 with loops (torch's own float8_e4m3fn cast for the FP8
round trip); the teacher-forced path against the cached path; plain argmax / cumprod arithmetic for the heads.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from deepseek_v41.config import flash_config, tiny_config
from deepseek_v41.model.context import DenseContext
from deepseek_v41.model.dspark import DSparkDraft, dspark_loss, sample_anchors
from deepseek_v41.model.transformer import Transformer

# Two draft stages, so the first (main_proj) and last (heads) stages differ; window 16, block 4.
CFG = tiny_config().replace(num_nextn_predict_layers=2, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1])
K, W, V, D, HC = CFG.dspark_block_size, CFG.sliding_window, CFG.vocab_size, CFG.hidden_size, CFG.hc_mult


def make(cfg=CFG, seed=0, dtype=torch.float32):
    """A draft with random weights (mHC, sinks and router biases far from their inits) and shared embed/head."""
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("_fn"):
                p.normal_(0, 0.05)
            elif name.endswith(("_base", "attn_sink", "gate.bias", "gate.bias_vl")):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "markov_head" in name:
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.15
    return draft.to(dtype).eval(), embed.to(dtype), head.to(dtype)


def random_taps(batch, length, seed, cfg=CFG, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {j: torch.randn(batch, length, cfg.hc_mult, cfg.hidden_size, generator=gen).to(dtype)
            for j in cfg.dspark_target_layer_ids}


def sliced(taps, positions):
    """taps at positions [B, L] -> {layer: [B, L, hc, D]}."""
    return {j: t.gather(1, positions[..., None, None].expand(-1, -1, *t.shape[2:])) for j, t in taps.items()}


def committed_state(draft, taps, n, dtype=torch.float32):
    """A state with positions 0..n-1 committed."""
    B = next(iter(taps.values())).shape[0]
    state = draft.new_state(B, dtype)
    pos = torch.arange(n).expand(B, n)
    draft.stage(state, sliced(taps, pos), pos)
    state.commit()
    return state


# ---------------------------------------------------------------------------------------------- names, meta
@pytest.fixture(scope="module")
def flash_draft():
    with torch.device("meta"):
        return DSparkDraft(flash_config())


def expected_flash_names():
    """MODEL_REFERENCE.md §8 / DSPARK.md §1, with weights at their logical (dequantized) shapes."""
    D, E = 5120, 128
    names = {}
    for i in range(3):
        m = f"mtp.{i}."
        names.update({m + "attn_norm.weight": (D,), m + "ffn_norm.weight": (D,)})
        for site in ("attn", "ffn"):
            names.update({m + f"hc_{site}_fn": (24, 4 * D), m + f"hc_{site}_base": (24,), m + f"hc_{site}_scale": (3,)})
        names.update({m + "attn.wq_a.weight": (1280, D), m + "attn.q_norm.weight": (1280,),
                      m + "attn.wq_b.weight": (32768, 1280), m + "attn.wkv.weight": (512, D),
                      m + "attn.kv_norm.weight": (512,), m + "attn.wo_a.weight": (8192, 4096),
                      m + "attn.wo_b.weight": (D, 8192), m + "attn.attn_sink": (64,),
                      m + "ffn.gate.weight": (E, D), m + "ffn.gate.bias": (E,), m + "ffn.gate.bias_vl": (E,)})
        for e in [*(f"experts.{k}" for k in range(E)), "shared_experts"]:
            names.update({m + f"ffn.{e}.w1.weight": (2304, D), m + f"ffn.{e}.w3.weight": (2304, D),
                          m + f"ffn.{e}.w2.weight": (D, 2304)})
    names.update({"mtp.0.main_proj.weight": (D, 15360), "mtp.0.main_norm.weight": (D,), "mtp.2.norm.weight": (D,),
                  "mtp.2.markov_head.embed.weight": (129280, 256), "mtp.2.markov_head.head.weight": (129280, 256),
                  "mtp.2.confidence_head.proj.weight": (1, 5376)})
    return names


def test_flash_names_and_shapes_on_meta(flash_draft):
    got = {f"mtp.{k}": tuple(v.shape) for k, v in flash_draft.state_dict().items()}
    assert got == expected_flash_names()
    assert flash_draft[1].ffn.gate.topk == 3 and flash_draft[1].ffn.gate.route_scale == 1.5
    rope = [b.attn.rope.inv_freq[1].item() for b in DSparkDraft(CFG)]  # base rope_theta, no YaRN (DSPARK.md §1)
    assert rope == pytest.approx([CFG.rope_theta ** (-2 / CFG.qk_rope_head_dim)] * 2, rel=1e-6)


def test_flash_draft_runs_on_meta(flash_draft):
    cfg = flash_config()
    taps = {j: torch.empty(2, 6, 4, 5120, device="meta") for j in cfg.dspark_target_layer_ids}
    state = flash_draft.new_state(2, device="meta")
    flash_draft.stage(state, taps, torch.arange(6, device="meta").expand(2, 6))
    state.commit(torch.full((2,), 4, device="meta"))
    shared = torch.empty(cfg.vocab_size, 5120, device="meta")
    out = flash_draft.propose(state, torch.zeros(2, dtype=torch.long, device="meta"),
                              torch.full((2,), 4, device="meta"), shared, shared, temperature=torch.ones(2))
    assert out.tokens.shape == (2, 5) and out.probs.shape == (2, 5, 129280) and out.survival.device.type == "meta"
    tf = flash_draft.teacher_forced(taps, torch.zeros(2, 6, dtype=torch.long, device="meta"), shared, shared)
    loss, _ = dspark_loss(tf, torch.empty(2, 6, 129280, device="meta"))
    assert tf.logits.shape == (2, 4, 5, 129280) and loss.device.type == "meta"


def test_transformer_hosts_the_draft_and_shares_embed_and_head():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    names = [n for n in model.state_dict() if n.startswith("mtp.")]
    assert "mtp.0.main_proj.weight" in names and "mtp.0.confidence_head.proj.weight" in names
    assert not [n for n in names if n.endswith(("embed.weight", "head.weight")) and "markov_head" not in n]
    assert all(p is not model.embed.weight and p is not model.head.weight for p in model.mtp.parameters())
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    taps = {}
    with torch.no_grad():
        streams, pre = model.embed_streams(ids)
        model.run_layers(range(cfg.num_hidden_layers), streams, pre, DenseContext(2, 20, "cpu"),
                         engram_rows=model.hasher(ids), taps=taps)
    state = committed_state(model.mtp, taps, 19)
    out = model.mtp.propose(state, ids[:, 19], torch.full((2,), 19), model.embed.weight, model.head.weight)
    assert out.tokens.shape == (2, cfg.dspark_block_size) and torch.isfinite(out.logits).all()


# ---------------------------------------------------------------------------------------------- state
def test_commit_writes_only_the_accepted_prefix():
    draft, _, _ = make()
    draft.fake_quant = False  # rows of different chunk shapes then agree to rounding (no FP8 tie flips)
    taps, garbage = random_taps(2, 40, 1), random_taps(2, 40, 2)
    state = committed_state(draft, taps, 21)  # 21 > W rows: the ring wrapped
    assert sorted(state.positions[0].tolist()) == list(range(21 - W, 21))
    chunk = 21 + torch.arange(K + 1).expand(2, K + 1)
    accepted = torch.tensor([2, 0])  # drafts accepted: rows kept = anchor + accepted
    keep = (torch.arange(K + 1) <= accepted[:, None])[..., None, None]
    bad = sliced(garbage, chunk)
    mixed = {j: torch.where(keep, t, bad[j]) for j, t in sliced(taps, chunk).items()}
    draft.stage(state, mixed, chunk)
    state.commit(accepted + 1)
    for b, a in enumerate(accepted.tolist()):  # the same as committing the clean prefix 0..21+a
        ref = committed_state(draft, {j: t[b:b + 1] for j, t in taps.items()}, 21 + a + 1)
        assert torch.equal(state.positions[b], ref.positions[0])
        torch.testing.assert_close(state.keys[:, b], ref.keys[:, 0], atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="nothing to commit"):
        state.commit()
    draft.stage(state, sliced(garbage, chunk + K + 1), chunk + K + 1)
    before = state.keys.clone()
    state.discard()
    with pytest.raises(RuntimeError, match="nothing to commit"):
        state.commit()
    assert torch.equal(state.keys, before)


# ---------------------------------------------------------------------------------------------- cached = teacher-forced
def test_cached_steps_equal_teacher_forced_across_rejections():
    """An engine-like loop: propose, accept a per-sequence prefix, stage the verify chunk (rejected rows carry
    garbage features), commit the accepted rows. The teacher-forced path over the final sequence, at the same
    anchors, gives the same logits: rows 0..a exactly (same previous tokens), every row once the Markov bias of
    the row's previous token is taken out."""
    draft, embed, head = make()
    B, T = 2, 48
    taps, garbage = random_taps(B, T, 3), random_taps(B, T, 4)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))
    pos = torch.tensor([10, 12])
    state = draft.new_state(B)
    first = torch.arange(12).expand(B, 12)
    draft.stage(state, sliced(taps, first), first)
    state.commit(pos)  # sequence 0 commits 0..9, sequence 1 0..11
    schedule = [[2, 0], [4, 1], [0, 4], [3, 2], [1, 3], [4, 4], [2, 0]]  # accepted drafts per step
    steps = []
    for accepted in torch.tensor(schedule):
        out = draft.propose(state, ids.gather(1, pos[:, None])[:, 0], pos, embed, head)
        steps.append((pos.clone(), out, accepted))
        for b in range(B):
            p, a = int(pos[b]), int(accepted[b])
            ids[b, p + 1:p + 1 + a] = out.tokens[b, :a]
            if a < K:  # the bonus token differs from the rejected draft
                ids[b, p + 1 + a] = (out.tokens[b, a] + 1) % V
        chunk = pos[:, None] + torch.arange(K + 1)
        draft.stage(state, sliced(garbage, chunk), chunk)
        state.discard()  # a whole chunk dropped leaves nothing behind
        keep = (torch.arange(K + 1) <= accepted[:, None])[..., None, None]
        bad = sliced(garbage, chunk)
        draft.stage(state, {j: torch.where(keep, t, bad[j]) for j, t in sliced(taps, chunk).items()}, chunk)
        state.commit(accepted + 1)
        pos = pos + accepted + 1
    anchors = torch.stack([p for p, _, _ in steps], 1)
    with torch.no_grad():
        tf = draft.teacher_forced(taps, ids, embed, head, anchors=anchors, anchor_chunk=3)
        markov = draft[-1].markov_head
        for j, (p, out, accepted) in enumerate(steps):
            for b in range(B):
                a = int(accepted[b])
                torch.testing.assert_close(tf.logits[b, j, :a + 1], out.logits[b, :a + 1], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(tf.confidence[b, j, :a + 1], out.confidence[b, :a + 1], atol=1e-5,
                                           rtol=1e-5)
                own_prev = torch.cat((ids[b, p[b]:p[b] + 1], out.tokens[b, :-1]))
                true_prev = ids[b, p[b]:p[b] + K]
                torch.testing.assert_close(tf.logits[b, j] - markov(true_prev)[1],
                                           out.logits[b] - markov(own_prev)[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(tf.labels[0, 0], ids[0, 11:11 + K]) and tf.mask.all()


# ---------------------------------------------------------------------------------------------- window, block
def test_window_holds_at_most_sliding_window_committed_rows():
    draft, embed, head = make()
    taps = random_taps(1, 40, 6)
    anchor, n = torch.tensor([7]), 30  # committed 0..29, anchor at 30: context rows 14..29
    state = committed_state(draft, taps, n)
    assert int(state.window(torch.tensor([n]))[1].sum()) == W
    base = draft.propose(state, anchor, torch.tensor([n]), embed, head).logits
    for q, changes in ((n - W - 1, False), (n - W, True), (n - 1, True)):
        moved = {j: t.clone() for j, t in taps.items()}
        moved[CFG.dspark_target_layer_ids[0]][:, q] += 1.0
        logits = draft.propose(committed_state(draft, moved, n), anchor, torch.tensor([n]), embed, head).logits
        assert torch.equal(logits, base) != changes, q
        ids = torch.zeros(1, 40, dtype=torch.long)
        ids[0, n] = anchor
        tf = draft.teacher_forced(moved, ids, embed, head, anchors=torch.tensor([[n]]))
        assert ((tf.logits[0, 0, 0] - base[0, 0]).abs().max() > 1e-4) == changes, q


def test_block_is_bidirectional():
    """DSPARK.md §3.2: every block row sees every other block row; a later slot changes an earlier row."""
    draft, embed, _ = make()
    taps = random_taps(1, 20, 7)
    state = committed_state(draft, taps, 12)
    keys, visible = state.window(torch.tensor([12]))
    positions = 12 + torch.arange(K)[None]
    ids = torch.tensor([[5] + [CFG.dspark_noise_token_id] * (K - 1)])
    with torch.no_grad():
        h = draft.backbone(ids, positions, keys, visible, embed)
        other = ids.clone()
        other[0, K - 1] = 6
        h2 = draft.backbone(other, positions, keys, visible, embed)
    assert (h[0, 0] - h2[0, 0]).abs().max() > 1e-3  # the last slot reaches row 0
    assert visible.sum() == 12  # fewer committed rows than the window: all of them


# ---------------------------------------------------------------------------------------------- heads
def test_zero_markov_head_leaves_the_backbone_logits():
    draft, embed, head = make()
    with torch.no_grad():
        draft[-1].markov_head.embed.weight.zero_()
        draft[-1].markov_head.head.weight.zero_()
    taps = random_taps(2, 30, 8)
    state = committed_state(draft, taps, 20)
    position = torch.tensor([20, 20])
    out = draft.propose(state, torch.tensor([3, 4]), position, embed, head)
    keys, visible = state.window(position)
    ids = torch.tensor([[3] + [CFG.dspark_noise_token_id] * (K - 1), [4] + [CFG.dspark_noise_token_id] * (K - 1)])
    with torch.no_grad():
        base = draft.base_logits(draft.backbone(ids, 20 + torch.arange(K).expand(2, K), keys, visible, embed), head)
    assert torch.equal(out.logits, base)
    assert torch.equal(out.tokens, base.argmax(-1))


def test_greedy_chain_uses_its_own_previous_draft():
    draft, embed, head = make()
    taps = random_taps(2, 30, 9)
    state = committed_state(draft, taps, 20)
    anchor, position = torch.tensor([3, 4]), torch.tensor([20, 20])
    out = draft.propose(state, anchor, position, embed, head)
    w1, w2 = draft[-1].markov_head.embed.weight.detach(), draft[-1].markov_head.head.weight.detach()
    prev = anchor
    for i in range(K):
        base = out.logits[:, i] - w1[prev] @ w2.t()
        assert torch.equal(out.tokens[:, i], (base + w1[prev] @ w2.t()).argmax(-1))
        assert torch.equal(out.probs[:, i].argmax(-1), out.tokens[:, i]) and torch.all(out.probs[:, i].sum(-1) == 1)
        prev = out.tokens[:, i]
    torch.testing.assert_close(out.survival, torch.sigmoid(out.confidence).cumprod(-1))
    assert (out.survival[:, 1:] <= out.survival[:, :-1]).all()
    sts = torch.tensor([1.0, 2.0, 0.5, 1.5])
    scaled = draft.propose(state, anchor, position, embed, head, sts_temperatures=sts).survival
    torch.testing.assert_close(scaled, torch.sigmoid(out.confidence / sts).cumprod(-1))


def test_sampling_is_reproducible_and_returns_the_drawn_distribution():
    draft, embed, head = make()
    state = committed_state(draft, random_taps(2, 30, 10), 20)
    args = (state, torch.tensor([3, 4]), torch.tensor([20, 20]), embed, head)
    greedy = draft.propose(*args)
    a = draft.propose(*args, temperature=1.5, generator=torch.Generator().manual_seed(1))
    b = draft.propose(*args, temperature=1.5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)
    torch.testing.assert_close(a.probs.sum(-1), torch.ones(2, K))
    assert (a.probs.gather(-1, a.tokens[..., None]) > 0).all()
    prev = torch.cat((torch.tensor([[3], [4]]), a.tokens[:, :-1]), 1)  # q_i is softmax(L_i / T) of the own chain
    w1, w2 = draft[-1].markov_head.embed.weight.detach(), draft[-1].markov_head.head.weight.detach()
    torch.testing.assert_close(a.probs, torch.softmax(a.logits / 1.5, -1))
    torch.testing.assert_close(a.logits - w1[prev] @ w2.t(), greedy.logits - w1[
        torch.cat((torch.tensor([[3], [4]]), greedy.tokens[:, :-1]), 1)] @ w2.t(), atol=1e-5, rtol=1e-5)

    def top1(x):
        return x.masked_fill(x < x.max(-1, keepdim=True).values, float("-inf"))

    assert torch.equal(draft.propose(*args, temperature=1.0, logits_processor=top1).tokens, greedy.tokens)
    mixed = draft.propose(*args, temperature=torch.tensor([0.0, 1.0]), generator=torch.Generator().manual_seed(2))
    assert torch.equal(mixed.tokens[0], greedy.tokens[0]) and torch.equal(mixed.probs[0], greedy.probs[0])


# ---------------------------------------------------------------------------------------------- oracle
def oracle_step(draft, embed, head, taps, anchor, p, cfg=CFG):
    """One greedy draft step of one sequence, DSPARK.md §3.1–§3.4 in float64 with loops: committed positions
    0..p, anchor token at p+1. Returns (logits [K, V], confidence [K], tokens [K])."""
    P = {n: t.detach().double() for n, t in draft.state_dict().items()}
    E = {n: t.detach().double() for n, t in {"embed": embed, "head": head}.items()}
    hc, H, d, r = cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    eps, hc_eps, G, lim = cfg.rms_norm_eps, cfg.hc_eps, cfg.o_groups, cfg.swiglu_limit
    S, last = cfg.num_nextn_predict_layers, cfg.num_nextn_predict_layers - 1
    inv = [cfg.rope_theta ** (-2 * j / r) for j in range(r // 2)]

    def rms(x, w):
        return x / torch.sqrt((x * x).mean() + eps) * w

    def rope(x, pos, sign=1.0):
        out = x.clone()
        for j in range(r // 2):
            i = d - r + 2 * j
            c, s = math.cos(sign * pos * inv[j]), math.sin(sign * pos * inv[j])
            out[..., i], out[..., i + 1] = x[..., i] * c - x[..., i + 1] * s, x[..., i] * s + x[..., i + 1] * c
        return out

    def fp8(x):
        out = x.clone()
        for i in range(0, d, 32):
            scale = 2.0 ** math.ceil(math.log2(max(float(x[i:i + 32].abs().max()), 1e-4) / 448))
            out[i:i + 32] = (x[i:i + 32] / scale).to(torch.float8_e4m3fn).double() * scale
        return out

    def mix(R, name):
        fn, base, scale = P[name + "_fn"], P[name + "_base"], P[name + "_scale"]
        f = R.flatten()
        m = fn @ f / math.sqrt(float((f * f).mean()) + eps)
        pre = torch.sigmoid(m[:hc] * scale[0] + base[:hc]) + hc_eps
        post = 2 * torch.sigmoid(m[hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = torch.softmax((m[2 * hc:] * scale[2] + base[2 * hc:]).view(hc, hc), -1) + hc_eps
        comb = comb / (comb.sum(0, keepdim=True) + hc_eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(0, keepdim=True) + hc_eps)
        return pre, post, comb

    def expert(name, x):
        g = (P[name + ".w1.weight"] @ x).clamp(max=lim)
        u = (P[name + ".w3.weight"] @ x).clamp(-lim, lim)
        return P[name + ".w2.weight"] @ (g * torch.sigmoid(g) * u)

    def moe(s, x):
        scores = torch.sqrt(F.softplus(P[f"{s}.ffn.gate.weight"] @ x))
        chosen = sorted(range(len(scores)), key=lambda e: -float(scores[e] + P[f"{s}.ffn.gate.bias"][e]))
        chosen = chosen[:cfg.dspark_num_experts_per_tok]
        total = sum(float(scores[e]) for e in chosen)
        out = expert(f"{s}.ffn.shared_experts", x)
        for e in chosen:
            out = out + float(scores[e]) / total * cfg.routed_scaling_factor * expert(f"{s}.ffn.experts.{e}", x)
        return out

    # §3.1: context rows of the committed window, from main_x only.
    ring = {s: [] for s in range(S)}
    for q in range(max(0, p - W + 1), p + 1):
        f = torch.cat([taps[j][0, q].double().mean(0) for j in cfg.dspark_target_layer_ids])
        main_x = rms(P["0.main_proj.weight"] @ f, P["0.main_norm.weight"])
        for s in range(S):
            ring[s].append(fp8(rope(rms(P[f"{s}.attn.wkv.weight"] @ main_x, P[f"{s}.attn.kv_norm.weight"]), q)))
    # §3.2: block backbone.
    ids = [anchor] + [cfg.dspark_noise_token_id] * (K - 1)
    R = [E["embed"][t].expand(hc, -1).clone() for t in ids]
    pre_in = [torch.eye(hc, dtype=torch.float64)[0] for _ in ids]
    for s in range(S):
        site = [mix(R[t], f"{s}.hc_attn") for t in range(K)]
        x = [rms(pre_in[t] @ R[t], P[f"{s}.attn_norm.weight"]) for t in range(K)]
        qs = [rope((P[f"{s}.attn.wq_b.weight"] @ rms(P[f"{s}.attn.wq_a.weight"] @ x[t], P[f"{s}.attn.q_norm.weight"]))
                   .view(H, d), p + 1 + t) for t in range(K)]
        block = [fp8(rope(rms(P[f"{s}.attn.wkv.weight"] @ x[t], P[f"{s}.attn.kv_norm.weight"]), p + 1 + t))
                 for t in range(K)]
        keys = ring[s] + block  # every row sees the window and the whole block
        for t in range(K):
            o = torch.zeros(H, d, dtype=torch.float64)
            for h in range(H):
                scores = [float(qs[t][h] @ k) / math.sqrt(d) for k in keys]
                sink = float(P[f"{s}.attn.attn_sink"][h])
                m = max(max(scores), sink)
                num = sum(math.exp(sc - m) * k for sc, k in zip(scores, keys, strict=True))
                o[h] = num / (sum(math.exp(sc - m) for sc in scores) + math.exp(sink - m))
            o = rope(o, p + 1 + t, -1.0)
            wo_a = P[f"{s}.attn.wo_a.weight"]
            rank = wo_a.shape[0] // G
            z = torch.cat([wo_a[g * rank:(g + 1) * rank] @ o[g * H // G:(g + 1) * H // G].flatten() for g in range(G)])
            y = P[f"{s}.attn.wo_b.weight"] @ z
            a_pre, a_post, a_comb = site[t]
            M = a_post[:, None] * y + a_comb.t() @ R[t]
            f_pre, f_post, f_comb = mix(M, f"{s}.hc_ffn")
            y = moe(s, rms(a_pre @ M, P[f"{s}.ffn_norm.weight"]))
            R[t] = f_post[:, None] * y + f_comb.t() @ M
            pre_in[t] = f_pre
    # §3.2 step 3–4, §3.3, §3.4: collapse, base logits, greedy Markov chain, confidence.
    logits, conf, tokens, prev = [], [], [], anchor
    for t in range(K):
        hpre = pre_in[t] @ R[t]
        e = P[f"{last}.markov_head.embed.weight"][prev]
        row = E["head"] @ rms(hpre, P[f"{last}.norm.weight"]) + P[f"{last}.markov_head.head.weight"] @ e
        conf.append(P[f"{last}.confidence_head.proj.weight"][0] @ torch.cat((hpre, e)))
        logits.append(row)
        prev = int(row.argmax())
        tokens.append(prev)
    return torch.stack(logits), torch.stack(conf), torch.tensor(tokens)


def test_one_draft_step_matches_an_independent_derivation():
    draft, embed, head = make(seed=11)
    taps = random_taps(1, 30, 12)
    p = 24  # committed 0..24: the ring has wrapped
    out = draft.propose(committed_state(draft, taps, p + 1), torch.tensor([77]), torch.tensor([p + 1]), embed, head)
    logits, conf, tokens = oracle_step(draft, embed, head, taps, 77, p)
    torch.testing.assert_close(out.logits[0].double(), logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.confidence[0].double(), conf, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.tokens[0], tokens)


# ---------------------------------------------------------------------------------------------- training
def test_sample_anchors():
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 4:] = True
    mask[1, 2:5] = True
    anchors = sample_anchors(mask, 6, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 6)
    assert sorted(anchors[0].tolist()) == anchors[0].tolist() and set(anchors[0].tolist()) <= set(range(4, 11))
    assert anchors[1].tolist() == [2, 3, -1, -1, -1, -1]  # s and s+1 both in the mask


def test_dspark_loss_trains_the_draft_only():
    draft, embed, head = make(seed=13)
    draft.train()
    embed, head = torch.nn.Parameter(embed), torch.nn.Parameter(head)
    B, T = 2, 24
    taps = {j: t.requires_grad_() for j, t in random_taps(B, T, 14).items()}
    gen = torch.Generator().manual_seed(15)
    ids = torch.randint(0, V, (B, T), generator=gen)
    target_logits = 3 * torch.randn(B, T, V, generator=gen)
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    loss_mask[1, 15] = False  # slots whose label run crosses position 15 are not supervised
    anchors = sample_anchors(loss_mask, 10, gen)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        out = draft.teacher_forced(taps, ids, embed, head, anchors=anchors, loss_mask=loss_mask, anchor_chunk=4)
        loss, stats = dspark_loss(out, target_logits)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            assert torch.isfinite(loss) and set(stats) == {"ce", "tv", "conf", "acceptance"}
            expect = 0.1 * stats["ce"] + 0.9 * stats["tv"] + stats["conf"]
            torch.testing.assert_close(loss.detach(), expect)
            for module in (draft[0].main_proj, draft[-1].markov_head.embed, draft[-1].markov_head.head,
                           draft[-1].confidence_head.proj, draft[-1].attn.wkv):
                assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0
            assert embed.grad is None and head.grad is None and all(t.grad is None for t in taps.values())
            label_pos = anchors[1, :, None] + 1 + torch.arange(K)
            crossed = (label_pos == 15).long().cumsum(-1) > 0
            assert torch.equal(out.mask[1], (anchors[1, :, None] >= 0) & ~crossed & (label_pos < T))
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] * 0.9, losses


def test_bf16_paths_run():
    draft, embed, head = make(dtype=torch.bfloat16)
    taps = random_taps(2, 30, 16, dtype=torch.bfloat16)
    state = committed_state(draft, taps, 20, dtype=torch.bfloat16)
    out = draft.propose(state, torch.tensor([3, 4]), torch.tensor([20, 20]), embed, head, temperature=0.7,
                        generator=torch.Generator().manual_seed(0))
    assert state.keys.dtype == torch.bfloat16 and out.logits.dtype == torch.float32
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.survival).all()
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(1))
    loss, _ = dspark_loss(draft.teacher_forced(taps, ids, embed, head), torch.randn(2, 30, V))
    loss.backward()
    assert torch.isfinite(loss) and draft[0].main_proj.weight.grad.dtype == torch.bfloat16
