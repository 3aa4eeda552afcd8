"""The kernel library: its build from csrc/ (one compiler call, a cache folder others may not
write to), ``kernels.disabled()``, and the ctypes signatures declared beside the wrappers against the header's
prototypes and the library's exported symbols.
"""

import ctypes
import os
import stat

import pytest
import torch

from deepseek_v41 import kernels


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
