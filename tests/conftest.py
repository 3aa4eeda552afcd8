"""Root conftest (tests/ is on sys.path for `from optional_deps import require`): a throwaway
``redis-server`` (Debian's package) on a free port, for the cache and engine tests."""

import contextlib
import os
import shutil
import socket
import subprocess
import time

import pytest
from optional_deps import require


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _redis_process(workdir, maxmemory: str):
    """A fresh redis-server on a free 127.0.0.1 port without persistence: yields (process, url), killed after.

    Skips when the client or the binary is missing, but fails under CI=true (``.ci/run`` installs both)."""
    client = require("redis")
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; .ci/run installs it")
        pytest.skip(message)
    for _ in range(3):  # another process may take the free port before the server binds it
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--daemonize", "no", "--maxmemory", maxmemory,
             "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10.0
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.Redis.from_url(url, socket_connect_timeout=0.2).ping()
                break
            except client.ConnectionError:
                time.sleep(0.02)
        else:
            proc.kill()
            proc.wait()
            continue
        try:
            yield proc, url
        finally:
            proc.kill()
            proc.wait(timeout=10)
        return
    pytest.fail("redis-server did not start on a free port in 3 tries")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """``redis://127.0.0.1:<port>/0`` of a server shared by the session (:func:`_redis_process`)."""
    with _redis_process(tmp_path_factory.mktemp("redis"), "256mb") as (_, url):
        yield url


@pytest.fixture
def redis_server(tmp_path):
    """(process, url) of a redis-server of this test alone (one the test may stop with SIGSTOP); killed after."""
    with _redis_process(tmp_path, "64mb") as server:
        yield server


@pytest.fixture(scope="module")
def kernel_library():
    """The fused CPU kernels' library, for tests of what only the kernels do (their FP4 expert copies, a kernel's
    own results). Turned off on purpose (``DSV41_CPU_KERNELS=0``: the torch fallback under test) skips them; a
    library that could not be built skips them too, but fails them under CI=true, where it must build."""
    from deepseek_v41 import kernels

    lib = kernels.library()
    if lib is None:
        if os.environ.get("DSV41_CPU_KERNELS", "1") == "0":
            pytest.skip("the fused CPU kernels are turned off (DSV41_CPU_KERNELS=0)")
        message = "the fused CPU kernels could not be built"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must build them")
        pytest.skip(message)
    return lib
