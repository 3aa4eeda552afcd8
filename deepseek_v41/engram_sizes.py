"""Engram table sizes: the bucket primes a config implies (ENGRAM.md §4). Pure integers, no torch.

It sits beside the config, below the model: :mod:`deepseek_v41.config` checks ``engram_num_embeddings`` and sizes
the tiny preset with it, and :mod:`deepseek_v41.model.engram_hash` lays the tables out with it.
"""

from __future__ import annotations

import functools
from typing import Any


def is_prime(value: int) -> bool:
    """Deterministic primality by trial division (values here are about 1.6e7: fast enough)."""
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    factor = 3
    while factor * factor <= value:
        if value % factor == 0:
            return False
        factor += 2
    return True


def engram_table_sizes(cfg: Any) -> list[list[int]]:
    """Bucket sizes (primes) of every hash column, per Engram layer, in ``engram_layer_ids`` order.

    ENGRAM.md §4: a global ``seen`` set; for each layer, for each n-gram order n = 2..max, the search restarts at
    ``engram_vocab_size - 1`` and each of the ``engram_n_heads`` heads takes the smallest unused prime above the
    previous one. Column ``c = (n - 2) * engram_n_heads + head``. ``cfg``: anything with ``engram_layer_ids``,
    ``engram_max_ngram_size``, ``engram_vocab_size`` and ``engram_n_heads``. Returns ``[layers][columns]`` ints; a
    layer's table has ``sum(sizes)`` rows.
    """
    return [list(s) for s in table_sizes(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size,
                                         cfg.engram_vocab_size, cfg.engram_n_heads)]


@functools.lru_cache(maxsize=16)
def table_sizes(layer_ids: tuple[int, ...], max_ngram: int, vocab_size: int,
                n_heads: int) -> tuple[tuple[int, ...], ...]:
    """:func:`engram_table_sizes` from the four keys, as tuples (cached: the prime search runs once per config)."""
    seen: set[int] = set()
    out = []
    for _layer in layer_ids:
        sizes = []
        for _order in range(2, max_ngram + 1):
            current = vocab_size - 1
            for _head in range(n_heads):
                candidate = current + 1
                while candidate in seen or not is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                sizes.append(candidate)
                current = candidate
        out.append(tuple(sizes))
    return tuple(out)
