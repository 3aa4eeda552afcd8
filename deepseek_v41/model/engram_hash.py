"""Engram hashing: compressed token map, bucket primes, offsets, multipliers and n-gram row ids (ENGRAM.md §2–§7).

Pure integer logic. ``build_token_map`` turns a ``tokenizer.json`` into the compressed token map; the layout
functions turn the config into primes, offsets and multipliers; ``engram_row_ids`` / :class:`EngramHasher` turn
compressed ids into the table rows the :class:`~deepseek_v41.model.engram.Engram` module gathers.

Conventions used throughout:
- a *compressed id* (cid) is ``token_map[token_id]``; ``DEAD`` (-1) marks a masked (image) position;
- ``history`` [batch, max_ngram - 1] int64 holds the cids of the positions just before a chunk, oldest first,
  ``DEAD`` for "before the sequence start" or "masked" (both latch to pad, ENGRAM.md §5), so that a sequence
  hashed in chunks gives exactly the rows of one call over the whole sequence (ENGRAM.md §6);
- hash column ``c = (n - 2) * engram_n_heads + head`` for n-gram order ``n = 2 .. engram_max_ngram_size``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers
from torch import nn

from deepseek_v41.engram_sizes import table_sizes

INT64_MAX = np.iinfo(np.int64).max
DEAD = -1  # cid of a masked position, and of "before the sequence start" in a history
# sha256 of the DeepSeek-V4.1 compressed token map as little-endian int32 (ENGRAM.md §2): the check a loader runs.
V41_TOKEN_MAP_SHA256 = "c60a86322ec17b4142bfef3c57a8d81fb428550cdf487f88a4320cb59fe46481"
# Stands in for a lone-space result so that Strip keeps it (ENGRAM.md §2 step 4); must stay the literal U+E000.
_SPACE_SENTINEL = "\ue000"


# ---------------------------------------------------------------------------------------------- token map
def _normalizer() -> Any:
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def build_token_map(tokenizer_json: str | Path) -> torch.Tensor:
    """The compressed token map of a ``tokenizer.json`` (ENGRAM.md §2).

    Every token id 0 .. len(tokenizer)-1 (added/special tokens included) is decoded alone with the raw
    ``tokenizers`` backend (special tokens kept); its key is the raw token string if the text contains U+FFFD (a
    partial UTF-8 byte), else the text normalised by NFKC -> NFD -> StripAccents -> Lowercase -> collapse
    ``[ \\t\\r\\n]+`` -> lone space kept -> Strip, or the decoded text itself when that normalises to empty. The
    cid is the order of first appearance of the key.

    Returns int64 [vocab]. On the DeepSeek-V4/V4.1 tokenizer: 129,280 entries, 99,092 distinct cids, digest
    :data:`V41_TOKEN_MAP_SHA256` (see :func:`token_map_sha256`). Raises FileNotFoundError when the file is
    missing.
    """
    path = Path(tokenizer_json)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    tokenizer = Tokenizer.from_file(str(path))
    norm = _normalizer()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[tid] for tid in range(size)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    out = torch.empty(size, dtype=torch.int64)
    for tid, text in enumerate(texts):
        # A partial UTF-8 byte decodes to U+FFFD: key on the byte-level token string, which stays distinct.
        key = tokenizer.id_to_token(tid) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out[tid] = keys.setdefault(key, len(keys))
    return out


def identity_token_map(vocab_size: int) -> torch.Tensor:
    """The map of a model without a tokenizer-derived map: cid = token id (compressed vocab = vocab).

    Returns int64 [vocab_size]; raises ValueError when ``vocab_size`` is not positive.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return torch.arange(vocab_size, dtype=torch.int64, device="cpu")


def token_map_sha256(token_map: torch.Tensor) -> str:
    """sha256 hex digest of a token map written as little-endian int32 (the form ENGRAM.md §2 pins)."""
    return hashlib.sha256(token_map.cpu().numpy().astype("<i4").tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- layout
def engram_offsets(sizes: list[int]) -> list[int]:
    """Exclusive prefix sums of one layer's column sizes: column c owns rows [offset[c], offset[c]+size[c])."""
    return [int(v) for v in np.concatenate([[0], np.cumsum(sizes[:-1])])] if sizes else []


def hash_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> list[int]:
    """The odd int64 multipliers of Engram layer ``layer_id`` (ENGRAM.md §3).

    ``2 * default_rng(10007 * layer_id).integers(0, bound, size=max_ngram_size) + 1`` with
    ``bound = (int64_max // compressed_vocab_size) // 2``, so ``cid * mult`` never overflows int64.
    ``layer_id`` is the real layer index (1 and 14 in the release), not the table index.
    """
    bound = max(1, (INT64_MAX // compressed_vocab_size) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    draws = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return [int(2 * v + 1) for v in draws]


@dataclass(frozen=True)
class EngramLayout:
    """Everything the hash needs from the config, per Engram layer in ``engram_layer_ids`` order.

    ``primes[i]`` / ``offsets[i]``: [n_cols] column bucket sizes and first rows of table ``i``;
    ``multipliers[i]``: [max_ngram] odd multipliers (k = 0 is the current token). ``n_cols`` =
    ``(max_ngram - 1) * n_heads``. Source: ENGRAM.md §3–§4.
    """

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    compressed_vocab_size: int
    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]

    @property
    def n_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    def table_index(self, layer_id: int) -> int:
        """Position of layer ``layer_id`` in ``engram_layer_ids``; ValueError when it has no Engram."""
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} has no Engram (engram_layer_ids={list(self.layer_ids)})")
        return self.layer_ids.index(layer_id)


def engram_layout(cfg: Any) -> EngramLayout:
    """The :class:`EngramLayout` of a config (cached: the prime search runs once per distinct config).

    Raises ValueError when the config has no Engram layers.
    """
    if not cfg.engram_layer_ids:
        raise ValueError("the config has no Engram layers (engram_layer_ids is empty)")
    return _layout(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_vocab_size,
                   cfg.engram_n_heads, cfg.engram_compressed_vocab_size)


@functools.lru_cache(maxsize=16)
def _layout(layer_ids: tuple[int, ...], max_ngram: int, vocab_size: int, n_heads: int,
            compressed_vocab_size: int) -> EngramLayout:
    primes = table_sizes(layer_ids, max_ngram, vocab_size, n_heads)
    return EngramLayout(
        layer_ids=layer_ids, max_ngram=max_ngram, n_heads=n_heads, compressed_vocab_size=compressed_vocab_size,
        primes=primes, offsets=tuple(tuple(engram_offsets(list(p))) for p in primes),
        multipliers=tuple(tuple(hash_multipliers(lid, compressed_vocab_size, max_ngram)) for lid in layer_ids),
    )


# ---------------------------------------------------------------------------------------------- the hash
def _check_ids(name: str, ids: torch.Tensor, low: int, high: int, what: str) -> None:
    """Range check of integer ids (skipped on ``meta``, which has no values; it syncs on an accelerator)."""
    if ids.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {ids.dtype}")
    if ids.device.type == "meta" or ids.numel() == 0:
        return
    bad = (ids < low) | (ids >= high)
    if bool(bad.any()):
        value = int(ids[bad][0])
        raise ValueError(f"{name} holds {value}, outside {what} [{low}, {high})")


def _history_or_start(history: torch.Tensor | None, batch: int, depth: int, device: torch.device) -> torch.Tensor:
    if history is None:
        return torch.full((batch, depth), DEAD, dtype=torch.int64, device=device)
    if history.shape != (batch, depth):
        raise ValueError(f"history must have shape [batch, max_ngram - 1] = {[batch, depth]}, "
                         f"got {list(history.shape)}")
    return history.to(device)


def lookback_tokens(compressed_ids: torch.Tensor, history: torch.Tensor | None, pad_cid: int,
                    max_ngram: int) -> torch.Tensor:
    """The cids each position hashes: ``[batch, seq, max_ngram]``, k = 0 the token itself, k the k-th before.

    A look-back that reaches a ``DEAD`` entry (masked position or before the sequence start) is blocked and so is
    every deeper one (the block latches, ENGRAM.md §5); blocked look-backs read ``pad_cid``. Inputs are int64:
    ``compressed_ids`` [batch, seq] (``DEAD`` = masked), ``history`` [batch, max_ngram - 1] or None (start).
    Values are not range-checked here; :func:`engram_row_ids` and :class:`EngramHasher` do that.
    """
    batch, seq = compressed_ids.shape
    depth = max_ngram - 1
    past = _history_or_start(history, batch, depth, compressed_ids.device)
    ext = torch.cat([past, compressed_ids], dim=1)  # ext[:, depth + p] is position p of the chunk
    tokens = torch.stack([ext[:, depth - k: depth - k + seq] for k in range(max_ngram)], dim=-1)
    blocked = torch.cumsum(tokens == DEAD, dim=-1) > 0
    return tokens.masked_fill(blocked, pad_cid)


def _rows(tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
          n_heads: int) -> torch.Tensor:
    """Row ids ``[..., layers, n_cols]`` from look-back tokens ``[..., max_ngram]`` and per-layer constants
    ``multipliers`` [layers, max_ngram], ``primes`` / ``offsets`` [layers, n_cols] (ENGRAM.md §5)."""
    products = tokens.unsqueeze(-2) * multipliers  # [..., layers, max_ngram]; < 2^63 because cid < vocab
    mixes = []
    mix = products[..., 0]
    for k in range(1, products.shape[-1]):
        mix = mix ^ products[..., k]
        mixes.append(mix)  # order n = k + 1
    mixed = torch.stack(mixes, dim=-1).repeat_interleave(n_heads, dim=-1)  # [..., layers, n_cols]
    return mixed % primes + offsets  # mix >= 0, so floor and truncating modulo agree


def _constants(layout: EngramLayout, tables: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    def as_tensor(values: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        return torch.tensor([values[t] for t in tables], dtype=torch.int64, device=device)

    return as_tensor(layout.multipliers), as_tensor(layout.primes), as_tensor(layout.offsets)


def engram_row_ids(compressed_ids: torch.Tensor, layer_id: int, config: Any, history: torch.Tensor | None = None,
                   pad_cid: int | None = None) -> torch.Tensor:
    """Table rows of one Engram layer: int64 ``[batch, seq, (max_ngram - 1) * n_heads]``, offsets added.

    ``compressed_ids``: int64 [batch, seq] cids, ``DEAD`` (-1) at masked positions. ``layer_id``: the real layer
    index (e.g. 14), not the table index. ``history``: int64 [batch, max_ngram - 1] from :func:`next_history`, or
    None at the sequence start. ``pad_cid``: ``token_map[engram_pad_token_id]``; defaults to
    ``engram_pad_token_id`` itself, which is right for the DeepSeek map (cid 2 = id 2) and the identity map.
    Column ``c = (n - 2) * n_heads + head`` reads rows ``[offset[c], offset[c] + prime[c])`` (ENGRAM.md §4–§5).

    Raises ValueError for a layer without Engram, wrong shapes or dtypes, and cids outside
    ``[-1, engram_compressed_vocab_size)``.
    """
    layout = engram_layout(config)
    table = layout.table_index(layer_id)
    pad = config.engram_pad_token_id if pad_cid is None else pad_cid
    _check_pad(pad, layout)
    _check_chunk(compressed_ids, history, layout)
    tokens = lookback_tokens(compressed_ids, history, pad, layout.max_ngram)
    return _rows(tokens, *_constants(layout, [table], compressed_ids.device), layout.n_heads)[..., 0, :]


def start_history(batch: int, config: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """The history of fresh sequences: int64 [batch, engram_max_ngram_size - 1], all ``DEAD`` (ENGRAM.md §6)."""
    return torch.full((batch, config.engram_max_ngram_size - 1), DEAD, dtype=torch.int64, device=device)


def next_history(history: torch.Tensor, compressed_ids: torch.Tensor) -> torch.Tensor:
    """The history after a chunk: the last ``depth`` entries of ``history`` followed by ``compressed_ids``.

    ``history``: int64 [batch, depth] (:func:`start_history` at the sequence start), ``compressed_ids``: int64
    [batch, seq] with ``DEAD`` at masked positions. Returns int64 [batch, depth], oldest first. A speculative
    rollback is a call on the kept prefix: ``next_history(history_before, accepted_cids)``. Raises ValueError
    when the batch sizes differ or a tensor is not 2-D.
    """
    if compressed_ids.dim() != 2 or history.dim() != 2:
        raise ValueError(f"history and compressed_ids must be [batch, depth] and [batch, seq], got shapes "
                         f"{list(history.shape)} and {list(compressed_ids.shape)}")
    past = _history_or_start(history, compressed_ids.shape[0], history.shape[1], compressed_ids.device)
    return torch.cat([past, compressed_ids], dim=1)[:, compressed_ids.shape[1]:]


def _check_pad(pad: int, layout: EngramLayout) -> None:
    if not 0 <= pad < layout.compressed_vocab_size:
        raise ValueError(f"pad cid {pad} is outside the compressed vocabulary [0, {layout.compressed_vocab_size})")


def _check_chunk(compressed_ids: torch.Tensor, history: torch.Tensor | None, layout: EngramLayout) -> None:
    if compressed_ids.dim() != 2:
        raise ValueError(f"compressed_ids must be [batch, seq], got shape {list(compressed_ids.shape)}")
    vocab = layout.compressed_vocab_size
    _check_ids("compressed_ids", compressed_ids, DEAD, vocab, "the compressed vocabulary (-1 = masked)")
    if history is not None:
        _check_ids("history", history, DEAD, vocab, "the compressed vocabulary (-1 = start or masked)")


class EngramHasher(nn.Module):
    """Row ids of every Engram layer of a config in one call, from token ids (ENGRAM.md §2–§7, §11).

    ``token_map``: int64 [vocab_size] from :func:`build_token_map`; its largest cid + 1 must equal
    ``engram_compressed_vocab_size``. When None, a config whose compressed vocab equals its vocab gets
    :func:`identity_token_map`; otherwise (the release) the map is set later with :meth:`set_token_map`, and
    hashing real ids before that raises ValueError. The map is kept on the CPU and copied once to each device it
    is used on, so it survives meta initialisation and ``to_empty``; the hasher has no parameters or buffers
    and adds nothing to a state dict. Raises ValueError for a config without Engram or a map that does not fit.
    """

    def __init__(self, config: Any, token_map: torch.Tensor | None = None):
        super().__init__()
        self.layout = engram_layout(config)
        self.vocab_size = int(config.vocab_size)
        self.pad_token_id = int(config.engram_pad_token_id)
        self.pad_cid = self.pad_token_id
        self._maps: dict[torch.device, torch.Tensor] = {}
        self._constants: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        if token_map is None and self.layout.compressed_vocab_size == self.vocab_size:
            token_map = identity_token_map(self.vocab_size)
        if token_map is not None:
            self.set_token_map(token_map)

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """Install the compressed token map (int64 [vocab_size], e.g. from :func:`build_token_map`).

        Raises ValueError when its size or its cids do not fit the config (ENGRAM.md §2: the number of cids is
        ``engram_compressed_vocab_size``, on which every multiplier depends).
        """
        if token_map.dim() != 1 or token_map.dtype != torch.int64:
            raise ValueError(f"token_map must be int64 [vocab], got {token_map.dtype} {list(token_map.shape)}")
        if token_map.shape[0] != self.vocab_size:
            raise ValueError(f"token_map has {token_map.shape[0]} entries, the config's vocab_size is "
                             f"{self.vocab_size}")
        if token_map.device.type == "meta":
            raise ValueError("token_map is on the meta device and holds no values; build it on the CPU")
        token_map = token_map.cpu()
        vocab = self.layout.compressed_vocab_size
        _check_ids("token_map", token_map, 0, vocab, "the compressed vocabulary")
        if int(token_map.max()) + 1 != vocab:
            raise ValueError(f"token_map uses cids 0..{int(token_map.max())}, but engram_compressed_vocab_size "
                             f"is {vocab} (ENGRAM.md §2: they must agree, every multiplier depends on it)")
        self.pad_cid = int(token_map[self.pad_token_id])
        self._maps = {token_map.device: token_map}

    @property
    def has_token_map(self) -> bool:
        return bool(self._maps)

    @property
    def depth(self) -> int:
        """History entries per sequence: ``max_ngram - 1``."""
        return self.layout.max_ngram - 1

    def start_history(self, batch: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The history of fresh sequences: int64 [batch, depth], all ``DEAD``."""
        return torch.full((batch, self.depth), DEAD, dtype=torch.int64, device=device)

    def compress(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """cids of ``input_ids`` int64 [batch, seq], ``DEAD`` where ``image_mask`` (bool [batch, seq]) is True.

        Raises ValueError for ids outside ``[0, vocab_size)``, a mask of another shape, or no token map yet.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        _check_ids("input_ids", input_ids, 0, self.vocab_size, "the vocabulary")
        if image_mask is not None and (image_mask.shape != input_ids.shape or image_mask.dtype != torch.bool):
            raise ValueError(f"image_mask must be bool {list(input_ids.shape)}, got {image_mask.dtype} "
                             f"{list(image_mask.shape)}")
        device = input_ids.device
        if device.type == "meta":  # shapes only: no map needed
            cids = torch.empty_like(input_ids)
        elif not self._maps:
            raise ValueError("this EngramHasher has no token map yet: call set_token_map(build_token_map("
                             "'tokenizer.json')) (ENGRAM.md §2)")
        else:
            if device not in self._maps:
                self._maps[device] = next(iter(self._maps.values())).to(device)
            cids = self._maps[device][input_ids]
        return cids if image_mask is None else cids.masked_fill(image_mask, DEAD)

    def forward(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None,
                history: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """Rows of every Engram layer for one chunk: ``{layer_id: int64 [batch, seq, n_cols]}``.

        ``input_ids`` int64 [batch, seq]; ``image_mask`` bool [batch, seq] (True = image position: hashed as
        ``DEAD``, ENGRAM.md §7) or None; ``history`` int64 [batch, depth] (see :meth:`next_history`) or None at
        the sequence start. Raises ValueError on bad input.
        """
        cids = self.compress(input_ids, image_mask)
        self._check_history(history)
        tokens = lookback_tokens(cids, history, self.pad_cid, self.layout.max_ngram)
        device = cids.device
        if device not in self._constants:
            self._constants[device] = _constants(self.layout, list(range(len(self.layout.layer_ids))), device)
        rows = _rows(tokens, *self._constants[device], self.layout.n_heads)
        return {layer: rows[:, :, i] for i, layer in enumerate(self.layout.layer_ids)}

    def next_history(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None,
                     history: torch.Tensor | None = None) -> torch.Tensor:
        """The history after this chunk (same arguments as :meth:`forward`): int64 [batch, depth]."""
        cids = self.compress(input_ids, image_mask)
        self._check_history(history)
        past = history if history is not None else self.start_history(cids.shape[0], cids.device)
        return next_history(past, cids)

    def _check_history(self, history: torch.Tensor | None) -> None:
        if history is not None:
            _check_ids("history", history, DEAD, self.layout.compressed_vocab_size,
                       "the compressed vocabulary (-1 = start or masked)")
