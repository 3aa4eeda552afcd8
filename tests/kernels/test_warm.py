"""kernels/fast/warm.py: prefetch hints for a block's Python objects before a few-token forward.

The hints change no result (they read nothing); what can go wrong is which addresses are gathered, when they are
gathered again, and a stale or wild address reaching the prefetch. Without the kernel library ``kernels.prefetch``
does nothing, and these tests that need it skip (fail under CI=true, like the kernel tests)."""

import os

import pytest
import torch
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast import warm as warm_module
from deepseek_v41.kernels.fast.warm import MAX_CHILDREN, REFRESH, object_addresses, warm


@pytest.fixture
def library():
    if kernels.library() is None:
        message = "the fused CPU kernels could not be built or were turned off (DSV41_CPU_KERNELS=0)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must build them")
        pytest.skip(message)


def test_addresses_cover_every_submodule_its_dicts_and_tensors():
    net = nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.LayerNorm(3)), nn.Linear(3, 2, bias=False))
    net.register_buffer("table", torch.zeros(5))
    got = set(object_addresses(net).tolist())
    for m in net.modules():
        assert {id(m), id(m.__dict__), id(m._forward_hooks), id(m._parameters), id(m._modules)} <= got
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
            assert id(t) in got and t._cdata in got
    assert object_addresses(net).dtype == torch.int64


def test_a_large_container_is_left_out():
    """The routed experts of a large MoE: a list of more than MAX_CHILDREN modules is skipped with its contents,
    a list of MAX_CHILDREN is not."""
    small = nn.ModuleList(nn.Linear(2, 2) for _ in range(MAX_CHILDREN))
    large = nn.ModuleList(nn.Linear(2, 2) for _ in range(MAX_CHILDREN + 1))
    net = nn.Sequential(nn.Linear(2, 2), small, large)
    got = set(object_addresses(net).tolist())
    assert id(net[0]) in got and id(small) in got and all(id(m) in got and id(m.weight) in got for m in small)
    assert id(large) not in got and not any(id(m) in got or id(m.weight) in got for m in large)


def test_warm_gathers_again_every_refresh_calls_and_sees_a_replaced_module(library, monkeypatch):
    net = nn.Sequential(nn.Linear(4, 3))
    seen = []
    monkeypatch.setattr(warm_module.kernels, "prefetch", lambda addresses: seen.append(set(addresses.tolist())))
    warm(net)
    first = net.__dict__[warm_module._KEY][1] - 1  # a block's first count is its own (spreads the gatherings)
    assert 0 <= first < REFRESH
    old = net[0]
    net[0] = nn.Linear(4, 3)  # the addresses kept still name the old module until the next gathering
    for _ in range(REFRESH - 1 - first):
        warm(net)
    assert id(old) in seen[-1] and id(net[0]) not in seen[-1]
    warm(net)  # this call gathers them again
    assert id(net[0]) in seen[-1] and id(old) not in seen[-1]
    for _ in range(REFRESH - 1):  # from then on every REFRESH calls
        warm(net)
    net[0] = old
    assert id(old) not in seen[-1]
    warm(net)
    assert id(old) in seen[-1]


def test_prefetch_takes_stale_and_wild_addresses(library):
    """Hints only: addresses of freed objects, of nothing, of the kernel's half of the address space."""
    freed = object_addresses(nn.Linear(2, 2))
    kernels.prefetch(freed)
    kernels.prefetch(torch.tensor([0, 1, 4095, 2 ** 47 - 64, -64, 2 ** 62], dtype=torch.int64))
    kernels.prefetch(torch.zeros(0, dtype=torch.int64))


def test_a_decode_forward_warms_each_block_once_and_gives_the_same_logits(library, monkeypatch):
    """The fast ``run_layers`` (installed) warms each block of a few-token forward on the module path (here a dense
    context: no decode plan) once; the hints change nothing.
    Uninstalling drops the kept addresses with the other fast state."""
    from deepseek_v41.config import tiny_config
    from deepseek_v41.kernels.fast import decode as fast_decode
    from deepseek_v41.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    assert fast.install(model).modules["Transformer"] == 1
    ids = torch.randint(3, 100, (2, 1))
    with torch.inference_mode():
        monkeypatch.setattr(fast_decode, "warm", lambda block: None)
        want = model(ids)
        warmed = []
        monkeypatch.setattr(fast_decode, "warm", lambda block: warmed.append(block) or warm(block))
        got = model(ids)
    assert [id(b) for b in warmed] == [id(b) for b in model.layers]
    assert torch.equal(got, want)
    assert all(warm_module._KEY in b.__dict__ for b in model.layers)
    fast.uninstall(model)
    assert not any(warm_module._KEY in b.__dict__ for b in model.layers)
