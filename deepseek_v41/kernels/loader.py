"""Builds, caches and loads the fused CPU kernels' library; says where its kernels may run.

The library is the C files of ``csrc/`` (one per concept, sharing the header ``csrc/dsv41.h``), compiled together by
one call of the system C compiler on first use (about a second) into a cache folder and loaded through
:mod:`ctypes`. Each wrapper module declares the ctypes signatures of its own kernels beside its wrappers and hands
them to :func:`register`; they are set on the library when it loads (tests/kernels checks that they match the
header's prototypes and the library's exported symbols).

Environment: ``DSV41_CPU_KERNELS=0`` turns the kernels off; ``DSV41_KERNEL_CACHE`` is the folder for the built
library (default: ``deepseek_v41_kernels_<user>`` in the system temp folder, as torch inductor keeps its builds;
it must belong to the user and be writable by no one else); ``CC`` the compiler (``cc``). A build is kept per
source (every file of ``csrc/``), flags, compiler and machine: editing any of them builds anew.
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c11", "-pthread"]

Signature = tuple[list, type | None]  # (argtypes, restype) of one kernel, as ctypes takes them

_SIGNATURES: dict[str, Signature] = {"dsv41_init": ([], ctypes.c_int)}
_state: dict[str, object] = {"lib": None, "tried": False, "off": False}


def register(signatures: dict[str, Signature]) -> None:
    """Declares the ctypes signatures ``{name: (argtypes, restype)}`` of a wrapper module's kernels (each module
    calls this once, at import, with its ``SIGNATURES``); they are set on the library when it loads, or at once
    when it is loaded already. Raises ValueError for a kernel declared twice."""
    twice = sorted(set(signatures) & set(_SIGNATURES))
    if twice:
        raise ValueError(f"kernel signatures declared twice: {', '.join(twice)}")
    _SIGNATURES.update(signatures)
    if _state["lib"] is not None:
        _apply(_state["lib"], signatures)  # type: ignore[arg-type]


def signatures() -> dict[str, Signature]:
    """Every registered kernel's ``(argtypes, restype)`` by its C name (a copy)."""
    return dict(_SIGNATURES)


def sources() -> list[Path]:
    """The library's C files (``csrc/*.c``), in the order they are compiled."""
    return sorted(CSRC.glob("*.c"))


def cache_dir() -> Path:
    """Where the built library is kept (see the module docstring). Raises RuntimeError when the folder exists but
    belongs to another user or others may write to it (a library there could have been planted)."""
    if os.environ.get("DSV41_KERNEL_CACHE"):
        folder = Path(os.environ["DSV41_KERNEL_CACHE"]).expanduser()
    else:
        folder = Path(tempfile.gettempdir()) / f"deepseek_v41_kernels_{_user()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"kernel cache {folder} belongs to another user or is writable by others")
    return folder


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's bare uid)
        return str(os.getuid())


def source_key(cc: str, version: str) -> str:
    """The build's cache key: a hash of every file of ``csrc/`` (name and bytes), the flags, the compiler and its
    version, and the machine."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([cc, *CFLAGS, version, platform.machine(), platform.node()]).encode())
    return digest.hexdigest()[:16]


def _build() -> Path:
    """Compile ``csrc/*.c`` in one compiler call, once per sources, flags, compiler and machine; returns the shared
    library. Raises RuntimeError (with the compiler's message) when no compiler is found or the build fails."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    folder = cache_dir()
    target = folder / f"cpu_kernels-{source_key(cc, version)}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # build aside, then rename: parallel builds are safe
        built = Path(tmp) / target.name
        done = subprocess.run([cc, *CFLAGS, *map(str, sources()), "-o", str(built), "-lm"], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build the kernels of {CSRC}:\n{done.stderr[-2000:]}")
        os.replace(built, target)
    return target


def library() -> ctypes.CDLL | None:
    """The kernel library, built and loaded on first call; None when off (``DSV41_CPU_KERNELS=0``, or inside
    :func:`disabled`) or when it cannot be built (then a warning says why, once)."""
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get("DSV41_CPU_KERNELS", "1") != "0":
            _state["lib"] = _load()
    return None if _state["off"] else _state["lib"]  # type: ignore[return-value]


def _apply(lib: ctypes.CDLL, signatures: dict[str, Signature]) -> None:
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result


def _load() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
        _apply(lib, _SIGNATURES)
        if lib.dsv41_init() != 256:
            raise RuntimeError("dsv41_init did not run")
        return lib
    except (OSError, RuntimeError, AttributeError) as exc:  # AttributeError: a registered kernel the library lacks
        warnings.warn(f"deepseek_v41: fused CPU kernels unavailable, using the torch code ({exc})", stacklevel=3)
        return None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every caller takes its torch code (tests compare the two paths)."""
    before = _state["off"]
    _state["off"] = True
    try:
        yield
    finally:
        _state["off"] = before


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may take these tensors: the library is loaded, every tensor is on the CPU and
    contiguous, and no gradient is wanted through them."""
    if _state["off"] or (_state["lib"] is None and library() is None):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # noqa: SIM110 (a plain loop, not all(generator): this runs ~200 times a decode step)
        if not (t.is_cpu and t.is_contiguous()) or (grad and t.requires_grad):
            return False
    return True
