"""The vision path: ViT, 3x3 aligner, learned delimiters and their placement (MODEL_REFERENCE.md §3.18, §8).

``patches [N, 588] -> VisionTower -> [N, 1024] -> Aligner -> [ceil(n_h/3) * ceil(n_w/3), 5120]``; the aligner rows
fill the IMAGE positions of the image's span in reading order and the learned ``image_start`` /
``image_newline`` / ``image_end`` vectors its delimiter positions (:func:`place_image_embeddings`). Every span
position is an image token: it routes with ``gate.bias_vl`` and is masked out of Engram (:func:`image_token_mask`).

Parameter names are the checkpoint's (§8) relative to the model root: ``vision.*``, ``aligner.*``,
``image_start``, ``image_newline``, ``image_end``. :func:`add_vision` registers them on any module (the text
``Transformer`` or the standalone :class:`VisionModel`), so the root's ``state_dict`` names equal the file's.

Choices on the points MODEL_REFERENCE.md §9 leaves open:

- **Patch embedding name (§9 item 8).** Canonical: ``vision.patch_embed.proj.weight`` / ``.bias`` (a ``proj``
  Linear inside ``patch_embed``). Three public V4.1 tensor inventories (one counts the released shards' 266
  vision tensors, 970,536,960 bf16 bytes = the 485,268,480 parameters built here) and every port of the V4
  vision tower spell it so; one V4.1 spec writes ``vision.patch_embed.weight``. That spelling is accepted as an
  alias: :data:`CHECKPOINT_ALIASES` / :func:`checkpoint_name_candidates` for loaders that look tensors up by
  name, and a ``load_state_dict`` pre-hook on :class:`PatchEmbed` for plain state dicts.
- **2-D RoPE (§3.18, §9 item 7) [?].** Half-split ("rotate-half") rotation over the *whole* 64-d head: channel j
  is paired with channel j + 32 (j < 32) and the pair is rotated by angle ``a_j``. The 32 angles are
  ``[row * f_0 .. row * f_15 | col * f_0 .. col * f_15]`` with ``f_k = rope_theta^(-2k / 32)`` and (row, col)
  the patch's 0-based grid position — i.e. a cos/sin table of width ``rope_dim = head_dim / 2 = 32`` laid out
  [h-freqs | w-freqs], as §3.18/§9 describe. Why this one: we have not read the reference ``vision.py``, but
  the public ports that say they follow it use exactly this layout: the vLLM and NeMo V4 vision towers (NeMo's
  V4.1 port reuses its V4 tower unchanged), and an MLX port whose fp32 parity test runs against the reference
  file and notes that an interleaved-vs-half-split mix-up diverges by ~6.7.
  Consequence: a q·k score depends on positions only through (row_q - row_k, col_q - col_k).
- **MLP and aligner details [S].** The ViT MLP is bias-free SwiGLU ``w2(silu(g) * u)`` with ``[g; u] = w1 x``
  and no clamp (the text model's ``swiglu_limit`` is not applied); the aligner's GELU is the exact (erf) one.
  Attention is plain softmax(q k^T / sqrt(64)) over all patches of one image, no sink, no mask.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41.config import ModelConfig, VisionConfig
from deepseek_v41.model.image_processor import ProcessedImage, TokenType
from deepseek_v41.model.norm import RMSNorm

# eps of every ViT RMSNorm: the reference ModelArgs' ``vision_norm_eps`` default, absent from config.json [S].
VISION_NORM_EPS = 1e-6
# Other spellings of checkpoint tensors -> the name this module uses (§9 item 8).
CHECKPOINT_ALIASES = {
    "vision.patch_embed.weight": "vision.patch_embed.proj.weight",
    "vision.patch_embed.bias": "vision.patch_embed.proj.bias",
}


def checkpoint_name_candidates(name: str) -> list[str]:
    """Names under which a checkpoint may store the model tensor ``name``: itself first, then its aliases."""
    return [name] + [alias for alias, canonical in CHECKPOINT_ALIASES.items() if canonical == name]


# ---------------------------------------------------------------------------------------------- 2-D RoPE
def vision_rope_angles(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Rotation angles [N, head_dim // 2] fp32 for patches at integer grid positions ``rows``, ``cols`` [N].

    Angle j < head_dim/4 is ``rows * f_j``, angle head_dim/4 + j is ``cols * f_j``, ``f_j = theta^(-4j/head_dim)``
    (the module docstring). Positions may be offset or negative: only differences reach the scores.
    """
    quarter = head_dim // 4
    inv_freq = theta ** (-torch.arange(quarter, dtype=torch.float64) * 2 / (head_dim // 2))
    inv_freq = inv_freq.float().to(rows.device)
    return torch.cat((rows.float()[:, None] * inv_freq, cols.float()[:, None] * inv_freq), dim=-1)


def grid_positions(n_h: int, n_w: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column index [n_h * n_w] of each patch in reading order (row-major)."""
    rows = torch.arange(n_h, device=device).repeat_interleave(n_w)
    cols = torch.arange(n_w, device=device).repeat(n_h)
    return rows, cols


def apply_vision_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (j, j + d/2) of x [..., N, H, d] by ``angles`` [N, d/2]; fp32 math, x's dtype out."""
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


# ---------------------------------------------------------------------------------------------- ViT
class PatchEmbed(nn.Module):
    """``proj``: Linear(3 * p * p -> dim, bias) on flattened patches [..., 588] -> [..., dim].

    Loading a state dict that spells the weight ``patch_embed.weight`` / ``.bias`` (no ``proj``) maps it here.
    """

    def __init__(self, patch_size: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(3 * patch_size * patch_size, dim, bias=True)
        self.register_load_state_dict_pre_hook(self._accept_alias)

    @staticmethod
    def _accept_alias(module, state_dict, prefix, *args) -> None:
        for leaf in ("weight", "bias"):
            if prefix + leaf in state_dict and prefix + "proj." + leaf not in state_dict:
                state_dict[prefix + "proj." + leaf] = state_dict.pop(prefix + leaf)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over the patches of one image, with 2-D RoPE on q and k.

    ``wqkv`` [3 * dim, dim] + bias: output rows are [q | k | v], each ``n_heads`` heads of ``dim / n_heads``;
    ``wo`` [dim, dim] + bias. ``forward(x [B, N, dim], angles [N, head_dim / 2]) -> [B, N, dim]`` in x's dtype.
    """

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=True)
        self.wo = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.wqkv(x).view(B, N, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = apply_vision_rope(q, angles), apply_vision_rope(k, angles)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(o.transpose(1, 2).reshape(B, N, C))


class VisionMLP(nn.Module):
    """SwiGLU without biases: ``w2(silu(g) * u)`` with ``[g; u] = w1 x``; w1 [2 * inter, dim], w2 [dim, inter]."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    """Pre-norm block: ``x += attn(norm1 x)``, ``x += mlp(norm2 x)``; RMSNorm eps 1e-6. x [B, N, dim]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, VISION_NORM_EPS)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.norm2 = RMSNorm(cfg.hidden_size, VISION_NORM_EPS)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), angles)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """The ViT (§3.18): ``patch_embed`` -> ``blocks`` (``num_hidden_layers``) -> ``norm``.

    ``forward(patches, n_vit_h, n_vit_w)``: patches [N, 3 * p * p] of one image, or [B, N, 3 * p * p] for B
    images of the same grid, N = n_vit_h * n_vit_w in reading order (``image_processor``) -> [(B,) N, dim] in
    the weights' dtype. Images never attend to each other. Raises ValueError for a config whose head width is
    not a multiple of 4 (2-D RoPE splits each head's pairs between rows and columns) or mis-shaped patches.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads or (cfg.hidden_size // cfg.num_attention_heads) % 4:
            raise ValueError(f"vision hidden_size {cfg.hidden_size} must split into {cfg.num_attention_heads} "
                             f"heads whose width is a multiple of 4 (2-D RoPE)")
        self.patch_size, self.rope_theta = cfg.patch_size, cfg.rope_theta
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, VISION_NORM_EPS)

    def forward(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        width = 3 * self.patch_size ** 2
        if patches.dim() not in (2, 3) or tuple(patches.shape[-2:]) != (n_vit_h * n_vit_w, width):
            raise ValueError(f"patches must be [{n_vit_h * n_vit_w}, {width}] (or batched) for a {n_vit_h}x{n_vit_w} "
                             f"grid, got {list(patches.shape)}")
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(patches.to(device=weight.device, dtype=weight.dtype))
        single = x.dim() == 2
        if single:
            x = x[None]
        angles = vision_rope_angles(*grid_positions(n_vit_h, n_vit_w, x.device), self.head_dim, self.rope_theta)
        for block in self.blocks:
            x = block(x, angles)
        x = self.norm(x)
        return x[0] if single else x


class Aligner(nn.Module):
    """3x3 patch merge + GELU MLP into the LLM width (§3.18).

    ``forward(x [(B,) n_vit_h * n_vit_w, dim], n_vit_h, n_vit_w) -> [(B,) n_llm_h * n_llm_w, out_dim]``, rows in
    reading order of the ``ceil(n_vit_h / r) x ceil(n_vit_w / r)`` token grid (r = ``downsample_ratio``). The
    patch grid is zero-padded at the bottom and right to multiples of r; the r x r group of token (i, j) is
    flattened **channel-major**: feature ``c * r * r + di * r + dj`` is channel c of patch (r i + di, r j + dj) —
    the order of ``torch.nn.functional.unfold(kernel=r, stride=r)`` on a [dim, H, W] map, which ``w1``
    [out_dim, r * r * dim] expects. Then ``w2(gelu(w1 v + b1)) + b2``.
    """

    def __init__(self, cfg: VisionConfig, out_dim: int):
        super().__init__()
        self.ratio = cfg.downsample_ratio
        self.w1 = nn.Linear(cfg.hidden_size * self.ratio ** 2, out_dim, bias=True)
        self.w2 = nn.Linear(out_dim, out_dim, bias=True)

    def merge(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """The r x r grouping alone: [B, n_vit_h * n_vit_w, C] -> [B, n_llm_h * n_llm_w, C * r * r]."""
        r = self.ratio
        B, N, C = x.shape
        grid = F.pad(x.view(B, n_vit_h, n_vit_w, C), (0, 0, 0, -n_vit_w % r, 0, -n_vit_h % r))
        gh, gw = grid.shape[1] // r, grid.shape[2] // r
        return grid.view(B, gh, r, gw, r, C).permute(0, 1, 3, 5, 2, 4).reshape(B, gh * gw, C * r * r)

    def forward(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        if x.dim() not in (2, 3) or x.shape[-2] != n_vit_h * n_vit_w:
            raise ValueError(f"aligner input must be [{n_vit_h * n_vit_w}, dim] (or batched), got {list(x.shape)}")
        single = x.dim() == 2
        v = self.merge(x[None] if single else x, n_vit_h, n_vit_w)
        out = self.w2(F.gelu(self.w1(v)))
        return out[0] if single else out


# ---------------------------------------------------------------------------------------------- model entry points
def add_vision(owner: nn.Module, config: ModelConfig) -> None:
    """Register the vision path on ``owner`` under the checkpoint names: ``vision`` (:class:`VisionTower`),
    ``aligner`` (:class:`Aligner`) and the delimiter vectors ``image_start``, ``image_newline``, ``image_end``
    [hidden_size] (zero-initialised). Honours the current default device (``torch.device("meta")`` works).
    Raises ValueError when the config has no ``vision_config``."""
    if config.vision_config is None:
        raise ValueError("this config has no vision_config: the model has no vision path")
    owner.vision = VisionTower(config.vision_config)
    owner.aligner = Aligner(config.vision_config, config.hidden_size)
    for name in ("image_start", "image_newline", "image_end"):
        owner.register_parameter(name, nn.Parameter(torch.zeros(config.hidden_size)))


def encode_images(owner: nn.Module, images: Sequence[ProcessedImage]) -> list[torch.Tensor]:
    """Aligner rows of each image: list of [n_llm_h * n_llm_w, hidden_size] in the weights' dtype, in the order
    given. ``owner`` carries :func:`add_vision`'s modules. Images of the same patch grid run as one batch (they
    still attend only within themselves). Raises ValueError when patches do not match their grid."""
    out: list[torch.Tensor | None] = [None] * len(images)
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, image in enumerate(images):
        groups[(image.grid.n_vit_h, image.grid.n_vit_w)].append(i)
    device = owner.aligner.w1.weight.device
    for (n_h, n_w), idx in groups.items():
        patches = torch.stack([images[i].patches for i in idx]).to(device)
        rows = owner.aligner(owner.vision(patches, n_h, n_w), n_h, n_w)
        for j, i in enumerate(idx):
            out[i] = rows[j]
    return out


def image_token_mask(token_types: torch.Tensor) -> torch.Tensor:
    """True at every image-span position (delimiters included): [B, T] bool, for ``bias_vl`` and Engram."""
    return token_types != int(TokenType.TEXT)


def window_key_limit(token_types: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """The window keys each query of one forward sees: ``key_limit`` [B, T] long (VISION_DESIGN.md decision 1).

    ``token_types`` [B, T] integer (:class:`TokenType` codes, -1 = text); ``positions`` [B, T] long, each row
    consecutive; ``window`` the sliding window W. A text position p gets ``p + 1`` (causal: keys ``p - W < k <=
    p``); a position p of an image span [s, e) (s its IMAGE_START, e one past its IMAGE_END) gets
    ``min(e, p + W)``: it also sees the span's later positions ``p < k < min(e, p + W)``, so attention is
    bidirectional inside the span (within the window). This follows the issue (and TensorRT-LLM's / SGLang's V4.1)
    where MODEL_REFERENCE.md §3.18 says the LLM stays causal over image tokens. A span may begin before this
    forward (a replay that starts inside it); it must end inside it (spans are never split across prefill chunks,
    decision 2): ValueError names a span position with no IMAGE_END after it in its row, or mis-shaped inputs.
    """
    if token_types.dim() != 2 or positions.shape != token_types.shape:
        raise ValueError(f"token_types and positions must both be [B, T], got {list(token_types.shape)} and "
                         f"{list(positions.shape)}")
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    types = token_types.to(positions.device)
    B, T = types.shape
    image = image_token_mask(types)
    index = torch.arange(T, device=positions.device).expand(B, T)
    # The index of the first IMAGE_END at or after each position (T where none): a cumulative min from the right.
    ends = torch.where(types == TokenType.IMAGE_END, index, T).flip(1).cummin(1).values.flip(1)
    open_span = image & (ends == T)
    if positions.device.type != "meta" and bool(open_span.any()):
        b, t = (int(v) for v in open_span.nonzero()[0])
        raise ValueError(f"the image span at position {int(positions[b, t])} (row {b}) has no IMAGE_END in this "
                         f"forward: an image span is never split across forwards")
    span_end = positions.gather(1, ends.clamp(max=T - 1)) + 1
    return torch.where(image, torch.minimum(span_end, positions + window), positions + 1)


def _span_shapes(types: list[int]) -> list[tuple[int, int]]:
    """(n_llm_h, n_llm_w) of each complete span in one flattened row of types; ValueError if malformed."""
    shapes, i = [], 0
    while i < len(types):
        if types[i] == TokenType.TEXT:
            i += 1
            continue
        if types[i] != TokenType.IMAGE_START:
            raise ValueError(f"image span at position {i} does not begin with IMAGE_START (type {types[i]})")
        j, widths = i + 1, []
        while j < len(types) and types[j] == TokenType.IMAGE:
            k = j
            while k < len(types) and types[k] == TokenType.IMAGE:
                k += 1
            if k == len(types) or types[k] != TokenType.IMAGE_NEWLINE:
                raise ValueError(f"image row at position {j} is not closed by IMAGE_NEWLINE")
            widths.append(k - j)
            j = k + 1
        if j == len(types) or types[j] != TokenType.IMAGE_END or not widths or len(set(widths)) != 1:
            raise ValueError(f"image span at position {i} is not START, equal rows of IMAGE + NEWLINE, END")
        shapes.append((len(widths), widths[0]))
        i = j + 1
    return shapes


def place_image_embeddings(h: torch.Tensor, token_types: torch.Tensor,
                           features: torch.Tensor | Sequence[torch.Tensor], image_start: torch.Tensor,
                           image_newline: torch.Tensor, image_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write image features and delimiters into text embeddings.

    ``h`` [B, T, D] float (the token embeddings); ``token_types`` [B, T] integer (:class:`TokenType` codes);
    ``features``: one [rows_i, D] tensor per image, in reading order over the batch (row 0's images first), or
    one [R, D] tensor of rows already in that order (what a chunk of a longer prompt needs, where a span may be
    cut). IMAGE positions receive the rows in reading order (batch-major, then position), IMAGE_START /
    IMAGE_NEWLINE / IMAGE_END positions the vectors [D]. Returns ``(embeddings [B, T, D] in h's dtype,
    image_mask [B, T] bool)``; text positions are unchanged.

    Raises ValueError for mis-shaped inputs, unknown type codes, a row count that differs from the IMAGE slots,
    and — with a per-image list — malformed spans or spans whose IMAGE count differs from their image's rows.
    """
    if h.dim() != 3 or token_types.shape != h.shape[:2]:
        raise ValueError(f"embeddings must be [B, T, D] and token_types [B, T]; got {list(h.shape)} and "
                         f"{list(token_types.shape)}")
    flat = token_types.reshape(-1).tolist()
    if not set(flat) <= {int(t) for t in TokenType}:
        raise ValueError(f"token_types holds codes {sorted(set(flat) - {int(t) for t in TokenType})} outside "
                         f"TokenType {[int(t) for t in TokenType]}")
    if isinstance(features, torch.Tensor):
        rows = features
    else:
        shapes = _span_shapes(flat)
        if len(shapes) != len(features):
            raise ValueError(f"token_types hold {len(shapes)} complete image span(s) but {len(features)} image "
                             f"feature tensor(s) were given")
        for n, ((n_h, n_w), f) in enumerate(zip(shapes, features, strict=True)):
            if f.dim() != 2 or f.shape[0] != n_h * n_w:
                raise ValueError(f"image {n}: its span is a {n_h}x{n_w} grid ({n_h * n_w} rows), features have "
                                 f"shape {list(f.shape)}")
        rows = torch.cat(list(features)) if len(features) else h.new_zeros(0, h.shape[-1])
    n_slots = flat.count(int(TokenType.IMAGE))
    if rows.dim() != 2 or rows.shape != (n_slots, h.shape[-1]):
        raise ValueError(f"{n_slots} IMAGE position(s) of width {h.shape[-1]} need features [{n_slots}, "
                         f"{h.shape[-1]}], got {list(rows.shape)}")
    types = token_types.to(h.device)
    out = h.clone()
    out[types == TokenType.IMAGE] = rows.to(device=h.device, dtype=h.dtype)
    for code, vector in ((TokenType.IMAGE_START, image_start), (TokenType.IMAGE_NEWLINE, image_newline),
                         (TokenType.IMAGE_END, image_end)):
        where = types == code
        out[where] = vector.to(device=h.device, dtype=h.dtype).expand(int(where.sum()), -1)
    return out, image_token_mask(types)


def embed_images(owner: nn.Module, h: torch.Tensor, token_types: torch.Tensor,
                 images: Sequence[ProcessedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``images`` (prompt order) with ``owner``'s vision path and place them into ``h`` [B, T, D]:
    :func:`encode_images` then :func:`place_image_embeddings` with ``owner.image_start/newline/end``.
    Returns ``(embeddings [B, T, D], image_mask [B, T] bool)``; raises ValueError as those two do."""
    features = encode_images(owner, images)
    return place_image_embeddings(h, token_types, features, owner.image_start, owner.image_newline, owner.image_end)


class VisionModel(nn.Module):
    """The vision path alone, with the checkpoint's names at its root (``vision.*``, ``aligner.*``,
    ``image_start``, ``image_newline``, ``image_end``): for loading or counting it without the text model
    (build it under ``torch.device("meta")`` to count parameters).

    ``forward(h [B, T, D], token_types [B, T], images) -> (embeddings [B, T, D], image_mask [B, T])`` as
    :func:`embed_images`; :meth:`encode` gives the aligner rows per image.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        add_vision(self, config)

    def encode(self, images: Sequence[ProcessedImage]) -> list[torch.Tensor]:
        return encode_images(self, images)

    def forward(self, h: torch.Tensor, token_types: torch.Tensor,
                images: Sequence[ProcessedImage]) -> tuple[torch.Tensor, torch.Tensor]:
        return embed_images(self, h, token_types, images)
