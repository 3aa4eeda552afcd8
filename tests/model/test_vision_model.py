"""The vision path inside the whole model (issue 27 "Must show"; MODEL_REFERENCE.md §3.18, §9 item 7).

- image positions route with ``gate.bias_vl`` and text positions with ``gate.bias``: the routing every router of an
  exact forward with images made, against a selection recomputed here from each router's input;
- Engram sees image positions masked on the raw ids: the raw ids of a span do not reach the output at all, text
  after a span hashes as a fresh sequence, and the Engram layer leaves image positions untouched;
- 2-D RoPE of the ViT against a re-derivation written here with complex numbers (each pair (j, j + d/2) is one
  complex number, turned by e^(i angle)), both alone at the official head width and inside a whole tower.
"""

import dataclasses
import math

import torch

from deepseek_v41.config import VisionConfig, tiny_config
from deepseek_v41.model.engram_hash import DEAD
from deepseek_v41.model.image_processor import ImageGrid, ProcessedImage, TokenType, expand_image_placeholders
from deepseek_v41.model.moe import Gate
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.model.vision import VisionTower, apply_vision_rope, grid_positions, vision_rope_angles

IMAGE_ID = 509
SMALL = VisionConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=12, patch_size=2,
                     rope_theta=100.0, downsample_ratio=3, max_image_tokens=64, min_pixels=16)


def tiny_vlm(seed=0) -> Transformer:
    cfg = dataclasses.replace(tiny_config(), vision_config=SMALL, image_token_id=IMAGE_ID)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("vision.", "aligner.", "image_")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith(("gate.bias", "gate.bias_vl")):  # different, non-zero corrections
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def image(n_vit_h, n_vit_w, seed) -> ProcessedImage:
    g = torch.Generator().manual_seed(seed)
    r, p = SMALL.downsample_ratio, SMALL.patch_size
    grid = ImageGrid(n_vit_h * p, n_vit_w * p, n_vit_h, n_vit_w, math.ceil(n_vit_h / r), math.ceil(n_vit_w / r))
    return ProcessedImage(torch.randn(n_vit_h * n_vit_w, 3 * p * p, generator=g), grid)


def prompt(seed=0):
    """Two rows of text with images (row 0: one 2x2-token image; row 1: a 1x2 and a 2x1 image), same length."""
    images = [image(6, 5, seed), image(2, 4, seed + 1), image(4, 3, seed + 2)]
    text0 = [5, 6, 7, IMAGE_ID, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    text1 = [20, IMAGE_ID, 21, 22, IMAGE_ID, 23, 24, 25, 26, 27, 28]
    row0, t0 = expand_image_placeholders(text0, [images[0].grid], IMAGE_ID)
    row1, t1 = expand_image_placeholders(text1, [g.grid for g in images[1:]], IMAGE_ID)
    assert len(row0) == len(row1) == 20
    return torch.tensor([row0, row1]), torch.tensor([t0, t1]), images


# ---------------------------------------------------------------------------------------------- bias_vl
def test_image_positions_route_with_bias_vl():
    model = tiny_vlm()
    ids, types, images = prompt()
    image_mask = (types != int(TokenType.TEXT)).reshape(-1)
    seen = []

    def record(gate, args, out):
        seen.append((gate, args[0].detach(), args[1], out[0]))

    gates = [m for m in model.modules() if isinstance(m, Gate)]
    hooks = [g.register_forward_hook(record) for g in gates]
    with torch.no_grad():
        model(ids, token_types=types, images=images)
    for h in hooks:
        h.remove()
    assert len(seen) == len(model.layers)
    differs = 0
    for gate, x, mask, picked in seen:
        assert torch.equal(mask, image_mask)
        scores = torch.sqrt(torch.nn.functional.softplus(x.double() @ gate.weight.double().t()))
        text_pick = torch.topk(scores + gate.bias.double(), gate.topk, dim=-1).indices.sort(-1).values
        image_pick = torch.topk(scores + gate.bias_vl.double(), gate.topk, dim=-1).indices.sort(-1).values
        want = torch.where(image_mask[:, None], image_pick, text_pick)
        assert torch.equal(picked.sort(-1).values, want)
        differs += int((text_pick != image_pick).any(-1)[image_mask].sum())
    assert differs > 10  # the two biases really route these image positions differently


# ---------------------------------------------------------------------------------------------- Engram
def test_raw_ids_of_image_positions_never_reach_the_output():
    """Image positions carry the placeholder id; any other ids there change nothing (embedding overwritten by the
    vision path, Engram hashes them as masked), bit for bit."""
    model = tiny_vlm()
    ids, types, images = prompt()
    other = ids.clone()
    spans = types != int(TokenType.TEXT)
    other[spans] = torch.randint(0, 500, (int(spans.sum()),), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a = model(ids, token_types=types, images=images)
        b = model(other, token_types=types, images=images)
    assert torch.equal(a, b)


def test_engram_sees_image_positions_masked():
    model = tiny_vlm()
    ids, types, images = prompt()
    mask = types != int(TokenType.TEXT)
    (layer,) = [j for j, block in enumerate(model.layers) if block.engram is not None]
    calls = []
    hook = model.layers[layer].engram.register_forward_hook(lambda m, args, out: calls.append((args, out)))
    with torch.no_grad():
        model(ids, token_types=types, images=images)
    hook.remove()
    (streams, rows, passed), out = calls[0]
    assert torch.equal(passed, mask)
    assert torch.equal(out[mask], streams[mask]) and not torch.equal(out[~mask], streams[~mask])
    # Row 0's span is positions 3..10; the text after it (11..19) hashes as a sequence that starts there, the
    # text before it (0..2) as the plain prefix.
    assert types[0, 3] == int(TokenType.IMAGE_START) and types[0, 10] == int(TokenType.IMAGE_END)
    hasher = model.hasher
    assert torch.equal(rows[0, 11:], hasher(ids[:1, 11:])[layer][0])
    assert torch.equal(rows[0, :3], hasher(ids[:1, :3])[layer][0])
    assert not torch.equal(rows[0, 11:], hasher(ids[:1])[layer][0, 11:])  # unmasked, the n-grams would cross it
    # Image positions themselves hash as masked (DEAD) tokens.
    assert torch.equal(hasher.compress(ids, mask)[mask], torch.full((int(mask.sum()),), DEAD))


# ---------------------------------------------------------------------------------------------- 2-D RoPE
def rope_by_complex(x: torch.Tensor, row: int, col: int, theta: float) -> torch.Tensor:
    """One head vector x [d] of the patch at (row, col): pair j = (x_j, x_{j+d/2}) as x_j + i x_{j+d/2}, times
    e^(i a_j) with a_j = row * theta^(-j / (d/4)) for j < d/4 and col * theta^(-(j - d/4) / (d/4)) after."""
    d = x.shape[0]
    half, quarter = d // 2, d // 4
    z = torch.complex(x[:half].double(), x[half:].double())
    a = torch.tensor([(row if j < quarter else col) * theta ** (-(j % quarter) / quarter) for j in range(half)],
                     dtype=torch.float64)
    z = z * torch.exp(1j * a)
    return torch.cat((z.real, z.imag))


def test_vision_rope_matches_complex_rotation_at_the_official_width():
    d, theta = 64, 10000.0  # 16 heads x 64 (MODEL_REFERENCE.md §3.18)
    rows, cols = torch.tensor([0, 0, 5, 36, 21]), torch.tensor([0, 7, 37, 0, 36])
    x = torch.randn(len(rows), 3, d, generator=torch.Generator().manual_seed(0))
    got = apply_vision_rope(x, vision_rope_angles(rows, cols, d, theta))
    for n in range(len(rows)):
        for h in range(3):
            want = rope_by_complex(x[n, h], int(rows[n]), int(cols[n]), theta)
            torch.testing.assert_close(got[n, h].double(), want, rtol=0, atol=2e-5)
    assert torch.equal(got[0], x[0])  # patch (0, 0) is not rotated


def tower_by_hand(tower: VisionTower, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    """The ViT of MODEL_REFERENCE.md §3.18 in float64 with :func:`rope_by_complex` on every q and k."""
    P = {k: v.double() for k, v in tower.state_dict().items()}
    heads, theta, eps = tower.blocks[0].attn.n_heads, tower.rope_theta, 1e-6

    def rms(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * w

    x = patches.double() @ P["patch_embed.proj.weight"].T + P["patch_embed.proj.bias"]
    N, C = x.shape
    d = C // heads
    for i in range(len(tower.blocks)):
        b = f"blocks.{i}."
        y = rms(x, P[b + "norm1.weight"])
        qkv = y @ P[b + "attn.wqkv.weight"].T + P[b + "attn.wqkv.bias"]
        o = torch.zeros(N, C, dtype=torch.float64)
        for h in range(heads):
            q = torch.stack([rope_by_complex(qkv[n, h * d:(h + 1) * d], n // n_w, n % n_w, theta) for n in range(N)])
            k = torch.stack([rope_by_complex(qkv[n, C + h * d:C + (h + 1) * d], n // n_w, n % n_w, theta)
                             for n in range(N)])
            v = qkv[:, 2 * C + h * d:2 * C + (h + 1) * d]
            o[:, h * d:(h + 1) * d] = torch.softmax(q @ k.T / math.sqrt(d), -1) @ v
        x = x + o @ P[b + "attn.wo.weight"].T + P[b + "attn.wo.bias"]
        y = rms(x, P[b + "norm2.weight"])
        g, u = (y @ P[b + "mlp.w1.weight"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(g) * u) @ P[b + "mlp.w2.weight"].T
    return rms(x, P["norm.weight"])


def test_tower_rope_matches_a_plain_re_derivation():
    """A non-square grid, so rows and columns cannot be confused: the tower's output equals the hand-written ViT."""
    cfg = dataclasses.replace(SMALL, hidden_size=32, num_attention_heads=2, num_hidden_layers=2)
    torch.manual_seed(2)
    tower = VisionTower(cfg).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0.0, 0.3)
    n_h, n_w = 3, 5
    patches = torch.randn(n_h * n_w, 3 * cfg.patch_size ** 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = tower(patches, n_h, n_w)
    torch.testing.assert_close(got.double(), tower_by_hand(tower, patches, n_h, n_w), rtol=0, atol=1e-4)
    # The reading order is rows of n_w patches: what the tower's grid positions say.
    rows, cols = grid_positions(n_h, n_w)
    assert rows.tolist()[:6] == [0, 0, 0, 0, 0, 1] and cols.tolist()[:6] == [0, 1, 2, 3, 4, 0]
