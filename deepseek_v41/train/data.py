"""``dsv41 data prepare``: the training corpus — deduplicated, split by document, checksummed, licensed.

Output folder:

- ``train.txt`` / ``heldout.txt``: UTF-8 documents, each followed by a line holding exactly the EOS marker
  ``<｜end▁of▁sentence｜>`` (:data:`SEPARATOR` = ``"\\n" + EOS + "\\n"`` after every document; the marker never
  occurs inside a document). Read them back with :func:`read_documents`. Documents are in the order of their key
  (a hash), so the sources are mixed in any prefix of a file.
- ``manifest.json``: per source its origin (package and version), license, input-file checksum and counts
  (read, dropped as too short or not UTF-8, exact and near duplicates) and per split the documents, UTF-8 bytes,
  characters, lines and whitespace-separated words; the files downloaded to build it (``downloaded``: name, sha256,
  the command that fetched it); the sha256 of every output file.
- ``LICENSES.md``: a license note per source followed by the license files it was read with.
- ``downloads/`` (unless ``download_dir`` says elsewhere): the fetched ``.deb`` files and sdist and their unpacked
  trees; safe to delete, a rerun fetches them again.

Deduplication keeps the first document (sources in the order of :func:`~deepseek_v41.train.sources.
collect_sources`, files in name order) of every exact key and of every near key
(:mod:`deepseek_v41.train.text`). The split is by document: held out when the first 64 bits of its near key (of
``sha256(group)`` for a grouped document) read as a fraction in [0, 1) are below ``heldout_fraction``; a source that
drew no held-out document gives up its group of smallest fraction (:func:`split_documents`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

from deepseek_v41.chat.tokens import EOS
from deepseek_v41.progress import Progress
from deepseek_v41.train.sources import Document, Source, collect_sources, user_folder_source
from deepseek_v41.train.text import exact_key, near_key

SEPARATOR = f"\n{EOS}\n"
SPLITS = ("train", "heldout")
Split = Literal["train", "heldout"]


def deduplicate(documents: Iterable[Document]) -> tuple[list[Document], Counter]:
    """Drop exact and near-exact repeats, keeping first occurrences in input order.

    Returns the kept documents and a Counter keyed by ``(source, "duplicates_exact" | "duplicates_near")``
    counting what was dropped, charged to the source of the dropped copy.
    """
    exact: set[str] = set()
    near: set[str] = set()
    kept, dropped = [], Counter()
    for doc in documents:
        e, n = exact_key(doc.text), near_key(doc.text)
        if e in exact:
            dropped[doc.source, "duplicates_exact"] += 1
        elif n in near:
            dropped[doc.source, "duplicates_near"] += 1
        else:
            kept.append(doc)
        exact.add(e)
        near.add(n)
    return kept, dropped


def split_fraction(doc: Document) -> float:
    """The document's split key as a fraction in [0, 1): the first 64 bits of its near-duplicate key, or of
    ``sha256(group)`` when it has a group."""
    key = near_key(doc.text) if doc.group is None else hashlib.sha256(doc.group.encode("utf-8")).hexdigest()
    return int(key[:16], 16) / 2**64


def split_of(doc: Document, heldout_fraction: float) -> Split:
    """"heldout" when :func:`split_fraction` is below ``heldout_fraction``, else "train"."""
    return "heldout" if split_fraction(doc) < heldout_fraction else "train"


def split_documents(documents: Iterable[Document], heldout_fraction: float) -> dict[Split, list[Document]]:
    """Documents by split (see the module docstring), each list in near-key order.

    :func:`split_of` decides, except that a source none of whose documents drew "heldout" gives its group of
    smallest :func:`split_fraction` to "heldout" when it has at least two groups and ``heldout_fraction > 0``: a
    small source (a few dozen plays) would otherwise often have no held-out text at all. Raises ValueError for a
    fraction outside [0, 1).
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    documents = list(documents)
    fractions = [split_fraction(d) for d in documents]
    held = [f < heldout_fraction for f in fractions]
    by_source: dict[str, list[int]] = {}
    for i, doc in enumerate(documents):
        by_source.setdefault(doc.source, []).append(i)
    for members in by_source.values():
        if heldout_fraction > 0 and not any(held[i] for i in members) and len({fractions[i] for i in members}) > 1:
            smallest = min(fractions[i] for i in members)
            for i in members:
                held[i] = fractions[i] == smallest
    out: dict[Split, list[Document]] = {s: [] for s in SPLITS}
    for doc, h in zip(documents, held, strict=True):
        out["heldout" if h else "train"].append(doc)
    for docs in out.values():
        docs.sort(key=lambda d: near_key(d.text))
    return out


def write_documents(path: Path, texts: Iterable[str]) -> None:
    """Write ``texts`` to ``path``, each followed by :data:`SEPARATOR`. Raises ValueError for a text holding the
    EOS marker (it would split the document when read back)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in texts:
            if EOS in text:
                raise ValueError(f"a document contains the separator marker {EOS!r}")
            f.write(text)
            f.write(SEPARATOR)


def read_documents(path: str | Path) -> list[str]:
    """The documents of a ``train.txt`` / ``heldout.txt`` written by :func:`write_documents`.

    Raises FileNotFoundError when the file is missing and ValueError when it does not end with the separator
    (a truncated file).
    """
    text = Path(path).read_text(encoding="utf-8")
    if not text:
        return []
    if not text.endswith(SEPARATOR):
        raise ValueError(f"{path}: does not end with the document separator (a line holding {EOS!r}); "
                         f"the file is truncated or was not written by `dsv41 data prepare`")
    return text[: -len(SEPARATOR)].split(SEPARATOR)


def text_stats(texts: Iterable[str]) -> dict[str, int]:
    """Tokenizer-free size of ``texts``: documents, UTF-8 bytes, characters, lines, whitespace-separated words."""
    stats = Counter(documents=0, bytes=0, characters=0, lines=0, words=0)
    for text in texts:
        stats.update(documents=1, bytes=len(text.encode("utf-8")), characters=len(text), lines=text.count("\n") + 1,
                     words=len(text.split()))
    return dict(stats)


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def licenses_markdown(sources: list[Source]) -> str:
    """LICENSES.md: per source, its note and origin, then the full text of each license file it came with."""
    parts = ["# Licenses of the corpus sources\n",
             "Each document of train.txt / heldout.txt comes from exactly one source below; manifest.json lists "
             "the counts per source.\n"]
    for source in sources:
        parts.append(f"\n## {source.name}\n\n- license: {source.license}\n- from: {source.origin}\n\n{source.note}\n")
        for path in source.license_files:
            body = path.read_text(encoding="utf-8", errors="replace").rstrip()
            parts.append(f"\n### {path.name} ({path})\n\n````text\n{body}\n````\n")
    return "".join(parts)


def prepare(out: str | Path, heldout_fraction: float = 0.02, min_chars: int = 32,
            log: Callable[[str], None] = print, progress: bool = True, from_dir: str | Path | None = None,
            download_dir: str | Path | None = None) -> dict:
    """Build the corpus into folder ``out`` (created if missing; the four files are overwritten).

    Reads the four package sources (:func:`~deepseek_v41.train.sources.collect_sources`: installed documentation
    where present, else ``.deb`` files fetched with ``apt-get download`` and unpacked into ``download_dir``,
    default ``out/downloads``, kept so a rerun reuses them; nothing is installed), or with ``from_dir`` only the
    text files of that folder (:func:`~deepseek_v41.train.sources.user_folder_source`, no package index or
    network needed). Converts, drops documents under ``min_chars`` characters and documents that are not UTF-8,
    deduplicates, splits and writes. Returns the manifest (also written to ``manifest.json``; its
    ``"downloaded"`` lists the fetched files with their sha256). Raises
    :class:`~deepseek_v41.train.fetch.DataError` (missing package lists, download failure, missing files) and
    ValueError for a bad fraction.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts: Counter = Counter()
    docs: list[Document] = []
    if from_dir is not None:
        sources, downloaded = [user_folder_source(from_dir, exclude=out)], []  # never read our own output
    else:
        sources, downloaded = collect_sources(Path(download_dir) if download_dir else out / "downloads", log)
    inputs = {s.name: s.inputs_sha256() for s in sources}
    total, done = sum(len(s.files) for s in sources), 0
    with Progress("dsv41 data prepare", total, unit="files", enabled=progress) as bar:  # stderr, see progress.py
        for source in sources:
            for doc in source.documents():
                done += 1
                bar(done, total, f"reading {source.name}")
                counts[source.name, "documents_read"] += 1
                if doc is None:
                    counts[source.name, "not_utf8"] += 1
                elif len(doc.text.strip()) < min_chars:
                    counts[source.name, "too_short"] += 1
                else:
                    docs.append(Document(doc.source, doc.name, doc.text.replace(EOS, ""), doc.group))
    kept, dropped = deduplicate(docs)
    counts.update(dropped)
    splits = split_documents(kept, heldout_fraction)
    for split in SPLITS:
        write_documents(out / f"{split}.txt", (d.text for d in splits[split]))
    (out / "LICENSES.md").write_text(licenses_markdown(sources), encoding="utf-8")
    manifest = {
        "format": f"UTF-8 documents, each followed by a line holding exactly {EOS} (separator "
                  f"{SEPARATOR!r}); read with deepseek_v41.train.data.read_documents",
        "separator": SEPARATOR,
        "split_rule": f"heldout when the first 64 bits of the near-duplicate key (sha256 of the group for "
                      f"grouped documents) as a fraction in [0, 1) are below {heldout_fraction}; a source "
                      f"with none held out gives its group of smallest fraction",
        "heldout_fraction": heldout_fraction,
        "min_chars": min_chars,
        "sources": {},
        "totals": {split: text_stats(d.text for d in splits[split]) for split in SPLITS},
        "downloaded": downloaded,
        "files": {},
    }
    for s in sources:
        entry = {"origin": s.origin, "license": s.license, "input_files": len(s.files),
                 "inputs_sha256": inputs[s.name]}
        for what in ("documents_read", "not_utf8", "too_short", "duplicates_exact", "duplicates_near"):
            entry[what] = counts[s.name, what]
        for split in SPLITS:
            entry[split] = text_stats(d.text for d in splits[split] if d.source == s.name)
        manifest["sources"][s.name] = entry
    for name in ("train.txt", "heldout.txt", "LICENSES.md"):
        manifest["files"][name] = {"bytes": (out / name).stat().st_size, "sha256": file_sha256(out / name)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest

