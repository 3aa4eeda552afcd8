"""The EC connector (issue 29): an image's aligner rows in one checksummed file per image, in the page format of
the persistent prefix cache (deepseek_v41/cache/store.py); a bad, partial, other-model or other-shape file is a
miss, never used."""

import os

import pytest
import torch

from deepseek_v41.cache.store import PageCodec
from deepseek_v41.disagg.config import ECTransferConfig
from deepseek_v41.disagg.ec_connector import (
    EC_FORMAT_VERSION,
    SharedStorageECConnector,
    build_ec_connector,
    ec_directory,
)

FP, D = "ab" * 32, 8
H1, H2 = "1" * 64, "2" * 64


def rows(n, seed=0, dtype=torch.float64):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def connector(path, fingerprint=FP, dtype=torch.float64, max_bytes=1 << 20):
    return SharedStorageECConnector(path, fingerprint, D, dtype, max_bytes)


def test_rows_round_trip_byte_exact_and_counted(tmp_path):
    writer, reader = connector(tmp_path), connector(tmp_path)  # two processes sharing the directory
    r = rows(5)
    assert writer.put(H1, r) and writer.put(H1, r)  # the second put only marks it recently used
    assert writer.stats["images_written"] == 1
    assert writer.stats["written_bytes"] == writer.file_bytes(H1, 5) == os.path.getsize(tmp_path / f"{H1}.page")
    assert writer.file_bytes(H1, 5) > 5 * D * 8  # rows plus the header
    got = reader.get(H1, 5)
    assert got.dtype == torch.float64 and torch.equal(got, r)
    assert reader.get(H2, 5) is None
    s = reader.stats
    assert (s["hits"], s["misses"], s["read_bytes"]) == (1, 1, writer.file_bytes(H1, 5)) and s["read_seconds"] > 0
    bf16 = connector(tmp_path / "bf16", dtype=torch.bfloat16)
    assert bf16.put(H1, rows(3, dtype=torch.bfloat16)) and torch.equal(bf16.get(H1, 3), rows(3, dtype=torch.bfloat16))


def test_file_is_the_page_format_of_the_prefix_cache_store(tmp_path):
    c = connector(tmp_path)
    c.put(H1, rows(4))
    data = (tmp_path / f"{H1}.page").read_bytes()
    codec = PageCodec(FP, {"rows": ((4, D), "float64")}, EC_FORMAT_VERSION)
    page, kind = codec.decode(H1, data)
    assert kind == "" and torch.equal(page["rows"], rows(4))
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))  # renamed into place


@pytest.mark.parametrize("damage", ["truncated", "flipped", "other fingerprint", "other shape", "other dtype",
                                    "symlink", "empty"])
def test_bad_file_is_a_miss_and_is_quarantined(tmp_path, damage):
    c = connector(tmp_path)
    path = tmp_path / f"{H1}.page"
    r = rows(4)
    if damage == "other fingerprint":
        connector(tmp_path, fingerprint="cd" * 32).put(H1, r)
    elif damage == "other shape":
        c.put(H1, rows(3))  # a file of 3 rows read as the 4 rows the grid says
    elif damage == "other dtype":
        connector(tmp_path, dtype=torch.float32).put(H1, r.float())
    elif damage == "symlink":
        c.put(H2, r)
        os.symlink(tmp_path / f"{H2}.page", path)
    else:
        c.put(H1, r)
        data = bytearray(path.read_bytes())
        if damage == "truncated":
            data = data[:-3]
        elif damage == "flipped":
            data[-1] ^= 1
        else:
            data = b""
        path.write_bytes(bytes(data))
    assert c.get(H1, 4) is None
    assert c.stats["misses"] == 1 and c.stats["rejected"] == 1
    assert not path.exists() and (tmp_path / "quarantine").is_dir()
    assert c.put(H1, r) and torch.equal(c.get(H1, 4), r)  # a good write heals the directory


def test_bad_arguments_are_value_errors(tmp_path):
    c = connector(tmp_path)
    with pytest.raises(ValueError, match=r"rows must be \[n, 8\] torch.float64"):
        c.put(H1, rows(4).float())
    with pytest.raises(ValueError, match=r"rows must be"):
        c.put(H1, torch.zeros(4, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_rows must be a positive int"):
        c.get(H1, 0)
    assert c.get("../etc/passwd", 4) is None and not c.put("not hex", rows(1))  # names never reach the disk


def test_budget_evicts_least_recently_used(tmp_path):
    size = connector(tmp_path / "probe").file_bytes(H1, 4)
    c = connector(tmp_path, max_bytes=2 * size)
    hashes = [f"{i}" * 64 for i in range(1, 4)]
    for i, h in enumerate(hashes):
        assert c.put(h, rows(4, i))
    assert c.get(hashes[0], 4) is None and torch.equal(c.get(hashes[2], 4), rows(4, 2))
    assert c.stats["evictions"] == 1


def test_build_ec_connector_directory_and_config(tmp_path):
    cfg = {"ec_connector": "SharedStorageConnector", "ec_role": "ec_consumer",
           "ec_connector_extra_config": {"shared_storage_path": str(tmp_path), "max_bytes": 12345}}
    c = build_ec_connector(cfg, FP, D, torch.float32)
    assert c.directory == tmp_path / f"{FP[:16]}-ec" == ec_directory(ECTransferConfig.from_cli(cfg), FP)
    assert c.store.max_bytes == 12345 and c.dtype == torch.float32
    with pytest.raises(ValueError, match="max_bytes in ec_connector_extra_config must be a positive integer"):
        build_ec_connector({**cfg, "ec_connector_extra_config": {"shared_storage_path": "x", "max_bytes": -1}},
                           FP, D, torch.float32)
    with pytest.raises(ValueError, match="ec_role"):
        build_ec_connector({**cfg, "ec_role": "kv_producer"}, FP, D, torch.float32)
