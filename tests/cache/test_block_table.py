"""BlockTable: the tensor a forward reads always equals the list padded with the null page, whatever list
operations ran in between (deepseek_v41/cache/block_table.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepseek_v41.cache.block_manager import BlockManager
from deepseek_v41.cache.block_table import BlockTable

NULL = BlockManager.NULL_PAGE
page = st.integers(1, 500)
operation = st.one_of(
    st.tuples(st.just("append"), page),
    st.tuples(st.just("extend"), st.lists(page, max_size=70)),
    st.tuples(st.just("iadd"), st.lists(page, max_size=5)),
    st.tuples(st.just("setitem"), st.integers(0, 200), page),
    st.tuples(st.just("setslice"), st.lists(page, max_size=90)),
    st.tuples(st.just("delitem"), st.integers(0, 200)),
    st.tuples(st.just("insert"), st.integers(0, 200), page),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), page),
    st.tuples(st.just("imul"), st.integers(0, 3)),
    st.tuples(st.just("clear")),
    st.tuples(st.just("sort")),
    st.tuples(st.just("reverse")),
    st.tuples(st.just("read"), st.integers(0, 150)),
)


def expected(pages: list[int], width: int) -> torch.Tensor:
    return torch.tensor(pages + [NULL] * (width - len(pages)), dtype=torch.int64)


def apply(table: list[int], op: tuple) -> None:
    name, *args = op
    if name == "append":
        table.append(args[0])
    elif name == "extend":
        table.extend(args[0])
    elif name == "iadd":
        table += args[0]
    elif name == "setitem" and table:
        table[args[0] % len(table)] = args[1]
    elif name == "setslice":
        table[:] = args[0]
    elif name == "delitem" and table:
        del table[args[0] % len(table)]
    elif name == "insert":
        table.insert(args[0], args[1])
    elif name == "pop" and table:
        table.pop()
    elif name == "remove" and table:
        table.remove(table[args[0] % len(table)])
    elif name == "imul" and len(table) < 50:
        table *= args[0]
    elif name in ("clear", "sort", "reverse"):
        getattr(table, name)()


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=40))
def test_padded_equals_the_list_after_any_operations(ops):
    """After any list operations, with reads in between at various widths (so the kept tensor is part synced,
    grown and shrunk), padded(width) is the list then the null page."""
    table, mirror = BlockTable(), []
    for op in ops:
        if op[0] == "read":
            width = len(mirror) + op[1]
            assert torch.equal(table.padded(width), expected(mirror, width))
        else:
            apply(table, op)
            apply(mirror, op)
        assert list(table) == mirror
    width = len(mirror) + 3
    assert torch.equal(table.padded(width), expected(mirror, width))


@pytest.mark.parametrize("op", [("append", 9), ("extend", [9, 10]), ("iadd", [9]), ("setitem", 1, 9),
                                ("setslice", [9, 8]), ("delitem", 1), ("insert", 1, 9), ("pop",), ("clear",),
                                ("sort",), ("reverse",), ("remove", 0), ("imul", 2), ("imul", 0)])
def test_each_list_operation_after_a_read(op):
    """Each list operation on a table whose kept tensor is synced (read just before) shows in the next read."""
    table, mirror = BlockTable([5, 3, 4, 1]), [5, 3, 4, 1]
    assert torch.equal(table.padded(10), expected(mirror, 10))
    apply(table, op)
    apply(mirror, op)
    assert torch.equal(table.padded(10), expected(mirror, 10))


def test_a_shrunk_table_reads_the_null_page_where_old_pages_were():
    """Pages written into the kept tensor by an earlier read are cleared once the list no longer holds them."""
    table = BlockTable([5, 6, 7, 8])
    assert table.padded(6).tolist() == [5, 6, 7, 8, NULL, NULL]
    table.clear()
    table.append(9)
    assert table.padded(6).tolist() == [9, NULL, NULL, NULL, NULL, NULL]
    table += [3, 4]
    assert table.padded(3).tolist() == [9, 3, 4]


def test_copies_keep_their_own_tensor():
    """copy / deepcopy give tables whose kept tensors are their own: changing one leaves the other's reads."""
    table = BlockTable([1, 2, 3])
    table.padded(4)
    for other in (copy.copy(table), copy.deepcopy(table)):
        assert isinstance(other, BlockTable)
        other[0] = 40
        assert other.padded(4).tolist() == [40, 2, 3, NULL]
        assert table.padded(4).tolist() == [1, 2, 3, NULL]


def test_width_below_the_pages_raises():
    with pytest.raises(ValueError, match="width 2 is below the table's 3 pages"):
        BlockTable([1, 2, 3]).padded(2)
