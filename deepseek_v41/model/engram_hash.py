"""Engram hashing layout: bucket primes, table offsets and hash multipliers (ENGRAM.md §3–§4).

Pure integer arithmetic from the config; the torch module in ``engram.py`` uses these to turn compressed
token ids into table rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

INT64_MAX = np.iinfo(np.int64).max


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
    previous one. Column ``c = (n - 2) * engram_n_heads + head``. Returns ``[layers][columns]`` ints; a layer's
    table has ``sum(sizes)`` rows.
    """
    seen: set[int] = set()
    out = []
    for _layer in cfg.engram_layer_ids:
        sizes = []
        for _order in range(2, cfg.engram_max_ngram_size + 1):
            current = cfg.engram_vocab_size - 1
            for _head in range(cfg.engram_n_heads):
                candidate = current + 1
                while candidate in seen or not is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                sizes.append(candidate)
                current = candidate
        out.append(sizes)
    return out


def engram_offsets(sizes: list[int]) -> list[int]:
    """Exclusive prefix sums of one layer's column sizes: column c owns rows [offset[c], offset[c]+size[c])."""
    return [int(v) for v in np.concatenate([[0], np.cumsum(sizes[:-1])])] if sizes else []


def hash_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> list[int]:
    """The odd int64 multipliers of Engram layer ``layer_id`` (ENGRAM.md §3).

    ``2 * default_rng(10007 * layer_id).integers(0, bound, size=max_ngram_size) + 1`` with
    ``bound = (int64_max // compressed_vocab_size) // 2``, so ``cid * mult`` never overflows int64.
    """
    bound = max(1, (INT64_MAX // compressed_vocab_size) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    draws = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return [int(2 * v + 1) for v in draws]
