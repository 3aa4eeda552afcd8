"""RoPE (MODEL_REFERENCE.md §3.3): the engine's rotation equals the textbook pair rotation bit for bit, and the
per-forward phase cache serves only the forward it belongs to."""

import torch

from deepseek_v41.model.rope import RotaryEmbedding


def textbook(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, r: int, sign: float = 1.0):
    angles = positions.float()[..., None] * inv_freq
    if x.dim() == 4:
        angles = angles[:, :, None, :]
    cos, sin = torch.cos(angles), sign * torch.sin(angles)
    tail = x[..., -r:].float().unflatten(-1, (r // 2, 2))
    a, b = tail[..., 0], tail[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    return torch.cat((x[..., :-r], rotated.to(x.dtype)), -1)


def test_rotation_is_bit_identical_to_the_textbook_form():
    torch.manual_seed(0)
    yarn = {"factor": 8, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 64}
    for rope in (RotaryEmbedding(16, 10000.0, None), RotaryEmbedding(16, 160000.0, yarn)):
        positions = torch.randint(0, 5000, (3, 7))
        for x in (torch.randn(3, 7, 64), torch.randn(3, 7, 4, 64), torch.randn(3, 7, 64).bfloat16()):
            for inverse in (False, True):
                got = rope(x, positions, inverse=inverse)
                want = textbook(x, positions, rope.inv_freq, 16, -1.0 if inverse else 1.0)
                assert got.dtype == x.dtype and torch.equal(got, want)
        # The inverse undoes the rotation (to rounding).
        x = torch.randn(3, 7, 64)
        torch.testing.assert_close(rope(rope(x, positions), positions, inverse=True), x, atol=1e-5, rtol=1e-5)


def test_phase_cache_is_per_forward_and_shared_by_tables_built_alike():
    rope, twin = RotaryEmbedding(8, 10000.0, None), RotaryEmbedding(8, 10000.0, None)
    x = torch.randn(1, 4, 16)
    positions = torch.arange(4)[None]
    cache: dict = {}
    first = rope(x, positions, cache=cache)
    assert len(cache) == 1 and torch.equal(twin(x, positions, cache=cache), first)  # one computation, reused
    other = RotaryEmbedding(8, 500.0, None)  # another table: its own entry
    assert torch.equal(other(x, positions, cache=cache), textbook(x, positions, other.inv_freq, 8))
    assert len(cache) == 2
    moved = positions + 100  # a new forward brings a new cache; without one nothing is kept
    assert torch.equal(rope(x, moved), textbook(x, moved, rope.inv_freq, 8))
    assert torch.equal(rope(x, moved, cache={}), textbook(x, moved, rope.inv_freq, 8))
