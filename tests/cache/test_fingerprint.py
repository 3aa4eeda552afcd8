"""The prefix-cache model fingerprint covers the weights' content, hashed once and remembered by file identity
(issue 22 item 5, SPEC.md §4.3)."""

import hashlib
import logging
import os
import shutil
import time

import pytest
import torch

import deepseek_v41.cache.fingerprint as fp
from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer

OLD = time.time() - 3600  # an mtime outside the racy window


@pytest.fixture(autouse=True)
def digest_home(tmp_path, monkeypatch):
    home = tmp_path / "digest-home"
    monkeypatch.setenv("DSV41_CACHE_HOME", str(home))
    return home / "weight-digests"


@pytest.fixture
def chunks_hashed(monkeypatch):
    """The (file name, offset) of every chunk read for hashing."""
    seen = []
    real = fp._hash_chunk
    monkeypatch.setattr(fp, "_hash_chunk", lambda file, offset, size: seen.append((file.name, offset))
                        or real(file, offset, size))
    return seen


def checkpoint(path, seed=0, max_shard_bytes=4 << 30):
    torch.manual_seed(seed)
    model = Transformer(tiny_config()).eval().to(torch.float32)
    model.save_pretrained(path, max_shard_bytes=max_shard_bytes)
    for f in path.rglob("*"):
        os.utime(f, (OLD, OLD))
    return model


def oracle(data: bytes, chunk: int) -> str:
    """The documented content digest, computed independently: sha256 over each chunk's sha256, then the size."""
    outer = hashlib.sha256()
    for i in range(0, max(len(data), 1), chunk):
        outer.update(hashlib.sha256(data[i:i + chunk]).digest())
    outer.update(f"size {len(data)}".encode())
    return outer.hexdigest()


def test_same_shape_other_weights_other_fingerprint(tmp_path):
    a = checkpoint(tmp_path / "a", seed=0)
    b = checkpoint(tmp_path / "b", seed=1)
    size = (tmp_path / "a" / "model.safetensors").stat().st_size
    assert size == (tmp_path / "b" / "model.safetensors").stat().st_size
    assert fp.model_fingerprint(a, tmp_path / "a") != fp.model_fingerprint(b, tmp_path / "b")
    # A copy of the same checkpoint elsewhere is the same model: it shares the cache.
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert fp.model_fingerprint(a, tmp_path / "copy") == fp.model_fingerprint(a, tmp_path / "a")
    # The load dtype changes the KV the model computes.
    fp32 = fp.model_fingerprint(a, tmp_path / "a")
    assert fp.model_fingerprint(a.to(torch.float64), tmp_path / "a") != fp32


def test_one_changed_byte_deep_in_a_shard_changes_it(tmp_path):
    model = checkpoint(tmp_path / "m", max_shard_bytes=200_000)
    before = fp.model_fingerprint(model, tmp_path / "m")
    shards = sorted((tmp_path / "m").glob("model-*.safetensors"))
    assert len(shards) > 1
    with shards[-1].open("r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(shards[-1], (OLD, OLD))  # even with the old mtime put back: the ctime moved
    assert fp.model_fingerprint(model, tmp_path / "m") != before


def test_a_restart_does_not_rehash(tmp_path, chunks_hashed, digest_home):
    model = checkpoint(tmp_path / "m")
    first = fp.model_fingerprint(model, tmp_path / "m")
    assert {name for name, _ in chunks_hashed} == {"config.json", "model.safetensors"}
    chunks_hashed.clear()
    assert fp.model_fingerprint(model, tmp_path / "m") == first
    assert chunks_hashed == []
    assert len(list(digest_home.iterdir())) == 2


def test_content_change_of_the_same_size_is_hashed_again(tmp_path, chunks_hashed):
    model = checkpoint(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    first = fp.model_fingerprint(model, tmp_path / "m")
    other = checkpoint(tmp_path / "other", seed=5)
    with weights.open("r+b") as f:  # rewrite in place: same inode, same size
        f.write((tmp_path / "other" / "model.safetensors").read_bytes())
    os.utime(weights, (OLD, OLD))
    chunks_hashed.clear()
    second = fp.model_fingerprint(other, tmp_path / "m")
    assert chunks_hashed == [("model.safetensors", 0)]
    assert second != first and second == fp.model_fingerprint(other, tmp_path / "other")


def test_a_file_written_just_now_is_not_remembered(tmp_path, chunks_hashed):
    model = checkpoint(tmp_path / "m")
    (tmp_path / "m" / "config.json").touch()  # modified within the racy window
    fp.model_fingerprint(model, tmp_path / "m")
    chunks_hashed.clear()
    fp.model_fingerprint(model, tmp_path / "m")
    assert chunks_hashed == [("config.json", 0)]


def test_chunked_digest_matches_the_documented_oracle(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "CHUNK_BYTES", 1 << 16)
    data = os.urandom(5 * (1 << 16) + 123)
    files = [tmp_path / "big", tmp_path / "empty", tmp_path / "exact"]
    files[0].write_bytes(data)
    files[1].write_bytes(b"")
    files[2].write_bytes(data[: 2 << 16])
    assert fp.file_digests(files) == [oracle(data, 1 << 16), oracle(b"", 1 << 16), oracle(data[: 2 << 16], 1 << 16)]


def test_unwritable_digest_home_still_fingerprints(tmp_path, monkeypatch, caplog, chunks_hashed):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("DSV41_CACHE_HOME", str(tmp_path / "file" / "home"))
    model = checkpoint(tmp_path / "m")
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.fingerprint"):
        first = fp.model_fingerprint(model, tmp_path / "m")
    assert first == fp.model_fingerprint(model, tmp_path / "m")
    assert any("hashed again" in r.getMessage() for r in caplog.records)


def test_in_memory_model_hashes_its_tensors():
    torch.manual_seed(0)
    a = Transformer(tiny_config()).eval()
    b = Transformer(tiny_config()).eval()
    assert fp.model_fingerprint(a) != fp.model_fingerprint(b)
    b.load_state_dict(a.state_dict())
    assert fp.model_fingerprint(a) == fp.model_fingerprint(b)
