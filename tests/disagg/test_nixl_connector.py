"""NixlConnector (issue 29): pages moved DRAM to DRAM by NIXL's UCX backend between two processes on 127.0.0.1.

The producer runs in a child process (PRODUCER below) and puts pages whose bytes are a function of their hash
(``page_for``); the consumer, here, NIXL-READs them and must get exactly ``page_for(hash)`` back — an oracle
independent of the transfer. The tests that need nixl are slow tests (`make test-slow` installs the ``nixl``
extra): skipped when nixl is not installed, failed under CI=true; each starts torch in a child (4-8 s here)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from optional_deps import require

from deepseek_v41.cache.store import PageCodec
from deepseek_v41.disagg import nixl_connector
from deepseek_v41.disagg.nixl_connector import NixlPages, parse_peer

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "f" * 64
LAYOUT = {"3.main_codes": ((4, 24), "uint8"), "3.main_scales": ((4, 2), "uint8"), "3.extra": ((2, 3), "float64")}
HASHES = [f"{i:02x}" * 32 for i in range(1, 7)]  # 64-hex block hashes, as the prefix cache's chain makes them


def page_for(block_hash: str) -> dict[str, torch.Tensor]:
    """The page stored under ``block_hash``: random bytes seeded by the hash (float64 values for the float part)."""
    gen = torch.Generator().manual_seed(int(block_hash[:8], 16))
    page = {}
    for name, (shape, dtype) in LAYOUT.items():
        page[name] = (torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8) if dtype == "uint8"
                      else torch.randn(shape, generator=gen, dtype=torch.float64))
    return page


PRODUCER = """
import json, sys
from tests.disagg.test_nixl_connector import FINGERPRINT, LAYOUT, page_for
from deepseek_v41.cache.store import PageCodec
from deepseek_v41.disagg.nixl_connector import NixlPages
args = json.loads(sys.argv[1])
codec = PageCodec(FINGERPRINT, LAYOUT)
pages = NixlPages(codec, {"side_channel_port": args["port"], "buffer_bytes": args["slots"] * codec.size("0" * 128)},
                  "kv_producer")
for h in args["hashes"]:
    assert pages.put(h, page_for(h))
if args.get("corrupt"):
    offset, _ = pages._index[args["corrupt"]]
    pages._buffer[offset + 100] ^= 0xFF  # one flipped payload byte
print("READY", json.dumps(pages.kv_transfer_params), flush=True)
sys.stdin.readline()  # the test closes stdin to stop it
pages.close()
"""


def start_producer(port: int, hashes: list[str], slots: int, corrupt: str = "") -> tuple[subprocess.Popen, dict]:
    """The producer child and its kv_transfer_params (remote_host, remote_port, remote_engine_id)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, json.dumps({"port": port, "hashes": hashes,
                                                                         "slots": slots, "corrupt": corrupt})],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    for line in proc.stdout:  # nixl may print its own lines first
        if line.startswith("READY "):
            return proc, json.loads(line[6:])
        if time.monotonic() > deadline:
            break
    proc.kill()
    proc.wait(10)
    pytest.fail(f"the producer did not start (exit {proc.poll()})")


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            return proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


@pytest.fixture
def codec():
    return PageCodec(FINGERPRINT, LAYOUT)


def assert_page(got: dict[str, torch.Tensor] | None, block_hash: str) -> None:
    want = page_for(block_hash)
    assert got is not None and set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_bad_config_is_a_clear_error(codec):
    with pytest.raises(ValueError, match="role 'prefill' is not one of kv_producer, kv_consumer, kv_both"):
        NixlPages(codec, {}, "prefill")
    with pytest.raises(ValueError, match="keys among"):
        NixlPages(codec, {"url": "redis://x"}, "kv_consumer")
    with pytest.raises(ValueError, match="side_channel_port must be an int in 0..65535"):
        NixlPages(codec, {"side_channel_port": "5600"}, "kv_producer")
    with pytest.raises(ValueError, match="buffer_bytes must be a positive int"):
        NixlPages(codec, {"buffer_bytes": 0}, "kv_producer")
    with pytest.raises(ValueError, match=f"holds no page: one page of this layout takes {codec.size('0' * 128)}"):
        NixlPages(codec, {"buffer_bytes": 100}, "kv_producer")
    with pytest.raises(ValueError, match="backends must be a non-empty list"):
        NixlPages(codec, {"backends": "UCX"}, "kv_consumer")
    with pytest.raises(ValueError, match="peers must be a list"):
        NixlPages(codec, {"peers": "127.0.0.1:5600"}, "kv_consumer")
    with pytest.raises(ValueError, match="must be 'host:port' with a port in 1..65535"):
        NixlPages(codec, {"peers": ["127.0.0.1:0"]}, "kv_consumer")
    assert parse_peer("10.0.0.2:5600") == ("10.0.0.2", 5600) and parse_peer("[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError, match="must be a string 'host:port'"):
        parse_peer("localhost")


def test_missing_nixl_says_how_to_install(codec, monkeypatch):
    monkeypatch.setattr(nixl_connector, "_NIXL_IMPORT_ERROR", ImportError("No module named 'nixl'"))
    with pytest.raises(ImportError, match=r"pip install -e '.\[nixl\]'"):
        NixlPages(codec, {}, "kv_consumer")


@pytest.mark.slow
def test_buffer_is_lru_and_roles_are_kept(codec):
    require("nixl")
    slot = codec.size("0" * 128)
    with NixlPages(codec, {"side_channel_port": 0, "buffer_bytes": 3 * slot + slot // 2}, "kv_both") as both:
        for h in HASHES[:3]:
            assert both.put(h, page_for(h))
        assert_page(both.get(HASHES[0]), HASHES[0])  # now the most recently used
        assert both.put(HASHES[3], page_for(HASHES[3]))  # evicts HASHES[1], the least recently used
        assert both.get(HASHES[1]) is None
        for h in (HASHES[0], HASHES[2], HASHES[3]):
            assert_page(both.get(h), h)
        stats = both.stats
        assert (stats["pages_written"], stats["evictions"], stats["local_hits"]) == (4, 1, 4)
        assert stats["written_bytes"] == 4 * codec.size(HASHES[0])
        assert stats["bytes_used"] == 3 * codec.size(HASHES[0])
        assert stats["pages_read"] == stats["read_bytes"] == 0  # nothing came over NIXL
        assert both.put("not-hex", page_for(HASHES[0])) is False
        with pytest.raises(ValueError, match="differ from the layout"):
            both.put(HASHES[4], {"x": torch.zeros(1)})
        assert both.flush() is True
    with pytest.raises(ValueError, match=r"backends \['NO_SUCH'\] are not available in this nixl; it has"):
        NixlPages(codec, {"backends": ["NO_SUCH"]}, "kv_consumer")
    with NixlPages(codec, {}, "kv_consumer") as consumer:
        assert consumer.put(HASHES[0], page_for(HASHES[0])) is False  # a consumer serves nothing
        assert consumer.side_channel_port == 0 and consumer.get(HASHES[0]) is None


@pytest.mark.slow
def test_side_channel_answers_json_and_a_stale_index_is_a_miss(codec):
    require("nixl")
    extra = {"side_channel_port": 0, "buffer_bytes": codec.size("0" * 128)}  # one slot
    with NixlPages(codec, extra, "kv_producer") as producer:
        producer.put(HASHES[0], page_for(HASHES[0]))
        with socket.create_connection(("127.0.0.1", producer.side_channel_port), timeout=10) as sock:
            reader = sock.makefile("rb")
            for line in (b"not json\n", b'{"op": "lookup", "block_hashes": ["../etc"]}\n', b'{"op": "pickle"}\n'):
                sock.sendall(line)
                assert "error" in json.loads(reader.readline())
            sock.sendall(b'{"op": "lookup", "block_hashes": ["%s", "%s"]}\n' % (HASHES[0].encode(),
                                                                               HASHES[1].encode()))
            assert json.loads(reader.readline())["pages"] == {HASHES[0]: [0, codec.size(HASHES[0])]}
            sock.sendall(b'{"op": "metadata"}\n')
            meta = json.loads(reader.readline())
            assert meta["fingerprint"] == FINGERPRINT and meta["agent_name"] == producer.agent_name
        with NixlPages(codec, {"peers": [f"127.0.0.1:{producer.side_channel_port}"]}, "kv_consumer") as consumer:
            assert_page(consumer.get(HASHES[0]), HASHES[0])
            stale = producer._lookup([HASHES[0]])
            producer.put(HASHES[1], page_for(HASHES[1]))  # evicts HASHES[0]: its slot now holds HASHES[1]
            producer._lookup = lambda hashes: stale  # a consumer that looked up just before the eviction
            assert consumer.get(HASHES[0]) is None  # the bytes name another hash: a miss, never used
            assert consumer.stats["rejected"] == 1 and consumer.stats["pages_read"] == 1


@pytest.mark.slow
def test_consumer_reads_producer_pages_across_processes(codec):
    require("nixl")
    # 4 slots for 6 pages: the first two are evicted; HASHES[3] gets a flipped byte.
    proc, params = start_producer(0, HASHES, slots=4, corrupt=HASHES[3])
    try:
        assert params["remote_host"] == "127.0.0.1" and params["remote_engine_id"].startswith("dsv41-kv_producer-")
        peer = f"{params['remote_host']}:{params['remote_port']}"
        with NixlPages(codec, {"peers": [peer]}, "kv_consumer") as consumer:
            for h in (HASHES[2], HASHES[4], HASHES[5]):
                assert_page(consumer.get(h), h)
            assert consumer.get(HASHES[0]) is None and consumer.get(HASHES[1]) is None  # evicted
            assert consumer.get("ab" * 32) is None  # never written
            assert consumer.get(HASHES[3]) is None  # corrupt: a miss, never used
            stats = consumer.stats
            assert stats["pages_read"] == 3 and stats["read_bytes"] == 3 * codec.size(HASHES[0])
            assert stats["rejected"] == 1 and stats["misses"] == 4 and stats["peer_errors"] == 0
            assert stats["read_seconds"] > 0
        # A decode server that learns the producer from a prefill response's kv_transfer_params.
        with NixlPages(codec, {}, "kv_consumer") as consumer:
            assert consumer.get(HASHES[5]) is None
            consumer.add_peer(params["remote_host"], params["remote_port"])
            assert_page(consumer.get(HASHES[5]), HASHES[5])
    finally:
        assert stop(proc) == 0


@pytest.mark.slow
def test_killed_producer_is_a_miss_and_a_restarted_one_rejoins(codec):
    require("nixl")
    proc, params = start_producer(0, HASHES[:2], slots=4)
    port = params["remote_port"]
    try:
        with NixlPages(codec, {"peers": [f"127.0.0.1:{port}"]}, "kv_consumer") as consumer:
            assert_page(consumer.get(HASHES[0]), HASHES[0])
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            start = time.monotonic()
            assert consumer.get(HASHES[1]) is None
            assert time.monotonic() - start < 5 and consumer.stats["peer_errors"] == 1
            proc, params = start_producer(port, HASHES[1:3], slots=4)  # the same port, a new agent
            time.sleep(nixl_connector.RETRY_SECONDS)
            assert_page(consumer.get(HASHES[1]), HASHES[1])
            assert consumer.stats["pages_read"] == 2
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_peer_named_by_a_request_is_forgotten_at_its_first_failure(codec):
    """A decode request may name the producer to pull from (kv_transfer_params remote_host / remote_port); a silent
    or dead address costs one side-channel timeout, once, and is never tried again by later lookups."""
    require("nixl")
    consumer = NixlPages(codec, {"side_channel_port": 0}, "kv_consumer")
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(ValueError, match="remote_port an integer"):
            consumer.add_peer("127.0.0.1", str(silent.getsockname()[1]))
        consumer.add_peer("127.0.0.1", silent.getsockname()[1])
        assert consumer.stats["peers"] == 1
        started = time.monotonic()
        assert consumer.get("ab" * 32) is None
        assert time.monotonic() - started < nixl_connector.SIDE_CHANNEL_TIMEOUT + 1
        assert consumer.stats["peers"] == 0  # forgotten
        started = time.monotonic()
        assert consumer.get("cd" * 32) is None and time.monotonic() - started < 0.5
    consumer.close()
