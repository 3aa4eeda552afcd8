"""The kernel library: its build from csrc/ (one compiler call, a cache folder others may not
write to), ``kernels.disabled()``, and the ctypes signatures declared beside the wrappers against the header's
prototypes and the library's exported symbols.
"""

import ctypes
import os
import re
import shutil
import stat
import subprocess

import pytest
import torch

from deepseek_v41 import kernels
from deepseek_v41.kernels import loader


# ---------------------------------------------------------------------------------------------- the library
def test_the_library_builds_and_loads(library, tmp_path, monkeypatch):
    assert library.dsv41_init() == 256
    assert kernels.usable(torch.zeros(4)) and not kernels.usable(torch.zeros(4, 4).t())
    with torch.enable_grad():
        assert not kernels.usable(torch.zeros(4, requires_grad=True))
    # A fresh build from the source into an empty cache folder loads and runs too.
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path / "cache"))
    built = kernels._build()
    assert built.parent == tmp_path / "cache" and built.is_file()
    assert ctypes.CDLL(str(built)).dsv41_init() == 256
    mtime = built.stat().st_mtime_ns
    assert kernels._build() == built and built.stat().st_mtime_ns == mtime  # cached: not rebuilt
    # A cache folder others may write to is refused (a library there could have been planted).
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path / "open"))
    with pytest.raises(RuntimeError, match="writable by others"):
        kernels.cache_dir()
    assert stat.S_IMODE(os.stat(built.parent).st_mode) & (stat.S_IWGRP | stat.S_IWOTH) == 0


def test_disabled_restores_the_previous_state_after_an_exception(library):
    x = torch.randn(2, 64)
    with pytest.raises(ZeroDivisionError), kernels.disabled():
        assert kernels.library() is None and not kernels.usable(x)
        with kernels.disabled():
            pass
        assert kernels.library() is None  # the inner block restored "off", not "on"
        _ = 1 / 0
    assert kernels.library() is library and kernels.usable(x)
    with pytest.raises(ValueError), kernels.disabled(), kernels.disabled():
        raise ValueError
    assert kernels.library() is library


# ----------------------------------------------------------------------- the C side and the signatures agree
C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "long": ctypes.c_long, "float": ctypes.c_float}


def header_prototypes() -> dict[str, tuple[list, object]]:
    """The entry points csrc/dsv41.h declares, as ctypes would take them: ``{name: (argtypes, restype)}``, any
    pointer a ``c_void_p``."""
    header = (loader.CSRC / "dsv41.h").read_text()
    found = {}
    for result, name, params in re.findall(r"^(int|void|int64_t|long) (dsv41_\w+)\((.*?)\);", header, re.M | re.S):
        args = []
        for param in " ".join(params.split()).split(","):
            param = param.strip()
            if param == "void":
                continue
            args.append(ctypes.c_void_p if "*" in param else C_TYPES[param.rsplit(" ", 1)[0].removeprefix("const ")])
        found[name] = (args, None if result == "void" else C_TYPES[result])
    return found


def test_every_entry_point_has_the_signature_of_its_prototype():
    """Each ``dsv41_*`` prototype of the header has one ctypes signature (declared beside its wrapper) with its
    argument count and types and its result type, and each signature a prototype; each C file defines only the
    entry points the header declares."""
    prototypes, signatures = header_prototypes(), loader.signatures()
    assert len(prototypes) >= 34 and set(prototypes) == set(signatures)
    for name, (args, result) in prototypes.items():
        assert signatures[name] == (args, result), name
    defined = set()
    for source in loader.sources():
        defined |= set(re.findall(r"^(?:int|void|int64_t|long) (dsv41_\w+)\(", source.read_text(), re.M))
    assert defined == set(prototypes)


def test_the_library_exports_the_registered_entry_points_alone(library):
    """The built library's exported functions are the registered ``dsv41_*`` kernels, no more (the helpers one
    file calls from another are hidden), no fewer. Reads the symbols with ``nm -D``; skips without it, except
    under CI=true."""
    nm = shutil.which("nm")
    if nm is None:
        message = "no nm (binutils) to list the library's symbols with"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    listed = subprocess.run([nm, "-D", "--defined-only", library._name], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in listed.stdout.splitlines() if line.strip()}
    assert exported == set(loader.signatures())


def test_a_change_to_any_source_file_builds_anew(tmp_path, monkeypatch):
    """The cache key covers every C file and header of csrc/: one edited file means a new build."""
    copy = tmp_path / "csrc"
    shutil.copytree(loader.CSRC, copy)
    monkeypatch.setattr(loader, "CSRC", copy)
    keys = {None: loader.source_key("cc", "v")}
    for path in sorted(copy.iterdir()):
        before = path.read_bytes()
        path.write_bytes(before + b"\n/* edited */\n")
        keys[path.name] = loader.source_key("cc", "v")
        path.write_bytes(before)
    assert {p.name for p in copy.iterdir()} >= {"dsv41.h", "codecs.c", "pool.c", "moe.c", "topk.c"}
    assert len(set(keys.values())) == len(keys) and loader.source_key("cc", "v") == keys[None]
    # The build looks its library up by that key (a file of that name is taken as built: no compiler call).
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path / "cache"))
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    cached = loader.cache_dir() / f"cpu_kernels-{loader.source_key(cc, version)}.so"
    cached.write_bytes(b"")
    assert loader._build() == cached
