"""load_sharded (issue 28): a rank's shard read slice by slice from the checkpoint equals the whole model loaded and
then sharded, bit for bit, for the official FP8 / FP4 format and for plain tensors; and a cut inside an FP8 block
decodes the whole tensor. Sharding alone runs no collective, so every rank is checked in this one process."""

from __future__ import annotations

import pytest
import torch
from shard_worker import LAYOUTS

from deepseek_v41.config import tiny_config
from deepseek_v41.distributed.comm import ParallelState
from deepseek_v41.distributed.loader import load_sharded, read_slice
from deepseek_v41.distributed.shard import shard_model
from deepseek_v41.model.checkpoint import _Reader, load_model, weight_files
from deepseek_v41.model.transformer import Transformer


@pytest.fixture(scope="module", params=["official", "none"])
def checkpoint(request, tmp_path_factory):
    """A tiny model saved in the official format (FP8 dense 32x32 blocks, FP4 experts, FP8 Engram) or as is;
    intermediate size 64 so that a TP=2 slice of an FP4 expert is whole 32-column blocks."""
    torch.manual_seed(0)
    model = Transformer(tiny_config().replace(moe_intermediate_size=64)).eval()
    path = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    model.save_pretrained(path, quantization=request.param)
    return path


@pytest.mark.parametrize("shard_engram", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_load_sharded_equals_load_then_shard(checkpoint, layout, shard_engram):
    for rank in range(2):
        state = ParallelState.of(LAYOUTS[layout], rank)
        want = shard_model(load_model(checkpoint, torch.float64), state, shard_engram=shard_engram).state_dict()
        got = load_sharded(checkpoint, state, torch.float64, shard_engram=shard_engram).state_dict()
        assert list(got) == list(want)
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), (layout, rank, name)


def test_a_cut_inside_an_fp8_block_decodes_the_whole_tensor(checkpoint):
    reader = _Reader(weight_files(checkpoint))
    name = "layers.0.attn.wq_b.weight"  # [128, 32]
    whole = read_slice(reader, name, (128, 32), None, 0, torch.float64, (32, 32))
    for start, n in ((0, 64), (64, 64), (16, 40), (100, 28)):
        part = read_slice(reader, name, (n, 32), 0, start, torch.float64, (32, 32))
        assert torch.equal(part, whole[start:start + n])
