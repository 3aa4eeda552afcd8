"""``dsv41 serve``'s media flags (vLLM's names where vLLM has them): parsed into the server's MediaConfig, bad
values refused before anything loads (exit 2 naming the flag)."""

import pytest
from serving_helpers import run_serve, serve_setting

from deepseek_v41.server.media import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_LIMIT_IMAGES, MediaConfig


@pytest.mark.parametrize(("flags", "message"), [
    (["--limit-mm-per-prompt", "3"], "--limit-mm-per-prompt must be a JSON object"),
    (["--limit-mm-per-prompt", "{image: 2}"], "--limit-mm-per-prompt must be a JSON object"),
    (["--limit-mm-per-prompt", '{"image": -1}'], "'image' must be an integer >= 0"),
    (["--limit-mm-per-prompt", '{"image": 1.5}'], "'image' must be an integer >= 0"),
    (["--limit-mm-per-prompt", '{"video": 1}'], "takes images only, so 'video' can only be 0"),
    (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be > 0"),
    (["--max-image-bytes", "0"], "--max-image-bytes"),
    (["--allowed-local-media-path", "/nonexistent/dir"], "is not a directory"),
])
def test_bad_media_flags_exit_2_naming_the_flag(model_dir, tmp_path, flags, message):
    result = run_serve(str(model_dir), "--cache-dir", str(tmp_path / "cache"), *flags)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "cache").exists()


def test_bad_fetch_timeout_in_the_environment_is_refused(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    result = run_serve(str(model_dir), "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 2 and "VLLM_IMAGE_FETCH_TIMEOUT must be a positive number" in result.output


@pytest.mark.parametrize(("env", "flags", "expected"), [
    ({}, [], MediaConfig()),
    ({"VLLM_IMAGE_FETCH_TIMEOUT": "7", "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"},
     ["--allowed-media-domains", "Images.Example.com,cdn.example.com", "--allowed-media-domains", "127.0.0.1",
      "--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--max-image-bytes", "5M"],
     MediaConfig(allowed_media_domains=["images.example.com", "cdn.example.com", "127.0.0.1"], limit_images=2,
                 fetch_timeout_s=7.0, max_image_bytes=5 * 2**20, allow_redirects=False)),
    ({"VLLM_IMAGE_FETCH_TIMEOUT": "7"}, ["--media-fetch-timeout", "1.5", "--allowed-media-domains", "*"],
     MediaConfig(allowed_media_domains=["*"], fetch_timeout_s=1.5)),
])
def test_media_flags_reach_the_server_config(model_dir, tmp_path, monkeypatch, env, flags, expected):
    for name in ("VLLM_IMAGE_FETCH_TIMEOUT", "VLLM_MEDIA_URL_ALLOW_REDIRECTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert serve_setting(monkeypatch, "media", str(model_dir), "--cache-dir", str(tmp_path / "cache"),
                         "--max-model-len", "64", *flags) == expected


def test_local_media_path_is_resolved(model_dir, tmp_path, monkeypatch):
    (tmp_path / "media").mkdir()
    monkeypatch.chdir(tmp_path)
    media = serve_setting(monkeypatch, "media", str(model_dir), "--cache-dir", str(tmp_path / "cache"),
                          "--max-model-len", "64", "--allowed-local-media-path", "media")
    assert media.allowed_local_media_path == str((tmp_path / "media").resolve())


def test_defaults_are_the_documented_ones():
    config = MediaConfig()
    assert config.allowed_media_domains == [] and config.allowed_local_media_path is None
    assert config.limit_images == DEFAULT_LIMIT_IMAGES == 16 and config.fetch_timeout_s == DEFAULT_FETCH_TIMEOUT_S == 5


def test_encoder_cache_size_reaches_the_engine(tmp_path, monkeypatch):
    from vision_helpers import save_tiny_vlm

    import deepseek_v41.cli.serve as serve_cli

    save_tiny_vlm(tmp_path / "vlm")
    seen = []

    def stop(engine, **kwargs):
        seen.append(engine)
        raise ValueError("stopped at the async engine")

    monkeypatch.setattr(serve_cli, "AsyncLLMEngine", stop)  # where `dsv41 serve` looks it up
    result = run_serve(str(tmp_path / "vlm"), "--cache-dir", str(tmp_path / "cache"), "--max-model-len", "64",
                       "--encoder-cache-size", "300")
    assert "stopped at the async engine" in str(result.exception), (result.output, result.exception)
    assert seen[0].args.encoder_cache_size == 300
    assert run_serve(str(tmp_path / "vlm"), "--encoder-cache-size", "-1").exit_code == 2
