"""``EngineArgs``: the engine's settings, with vLLM's names where they exist (vLLM's ``engine/arg_utils.py``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from deepseek_v41.cache.kv_cache_manager import CacheConfig
from deepseek_v41.disagg.config import KVTransferConfig


@dataclass
class EngineArgs:
    """Engine settings (vLLM's names where they exist).

    ``block_size``: tokens per KV page. ``num_kv_pages`` or ``kv_cache_memory_bytes`` size the global KV pool
    (default: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most 1 GiB but never less than
    one such sequence).
    ``window_slack_rows``: extra rows per window ring (SPEC.md §4.1). ``prefill_mode``: "ced" (default when the
    layout allows) or "exact".

    Prefix caching (SPEC.md §4.3): ``enable_prefix_caching`` shares the pages of common prefixes between requests
    (device tier); ``swa_pool_bytes`` sizes the in-memory SWA snapshot pool (default 10% of RAM; 0 disables
    snapshots); ``cache_dir`` keeps global KV pages on disk across restarts (``cache_max_bytes`` budget, 72 h TTL;
    default None: no persistence); ``replay`` is "bounded" (default) or "exact" for hits without a snapshot;
    ``redis_url`` shares the SWA snapshots and the global KV pages between engine processes (any ``cache_dir``).

    Speculative decoding (SPEC.md §4.4, DSPARK.md): ``speculative="dspark"`` (default None: off) drafts with the
    checkpoint's DSpark draft and verifies at most ``speculative_max_len`` drafts per step (default and maximum:
    the checkpoint's ``dspark_block_size``; needs ``window_slack_rows >= speculative_max_len``).
    ``speculative_cost_table``: None (default): the adaptive scheduler measures the engine's plain and speculative
    steps online and runs each decode step plain (no draft) or speculative, whichever gives more tokens per second
    (engine/spec_schedule.py); a list indexed by ℓ or a dict ℓ -> cost over 0..speculative_max_len: the relative
    cost of a step verifying ℓ drafts per sequence, every step speculates; ``"fixed"`` verifies
    ``speculative_max_len`` drafts every step.

    Images (a model with a vision tower): ``encoder_cache_size`` (vLLM's name and unit) is the encoder cache's
    budget in encoder tokens, i.e. aligner rows of ``hidden_size`` values in the model's dtype (default None:
    16 images of ``max_image_tokens`` each; 0 keeps nothing, every image is encoded each time it is prefilled).
    The cache keeps the rows of images by content hash, so an image seen again is not encoded again
    (engine/encoder_cache.py). ``ec_transfer_config`` (``--ec-transfer-config``, issue 29; None: off): the encoder
    cache's rows read from (``ec_consumer``) and / or written to (``ec_producer``) an EC connector shared with an
    encode server (deepseek_v41/disagg/ec_connector.py).

    Disaggregated serving (issue 29): ``kv_transfer_config`` (vLLM's name), a
    :class:`~deepseek_v41.disagg.config.KVTransferConfig`, its dict or its JSON: the server's role (kv_producer:
    every request prefill-only, pages written to the connector; kv_consumer: prefixes read from it; kv_both) and
    connector. Needs prefix caching and the CED prefill. None (default): a colocated engine.

    Structured outputs: ``structured_outputs_config`` (vLLM's name), a dict of
    :class:`~deepseek_v41.structured.StructuredOutputsConfig` fields: ``backend`` ("auto", "xgrammar",
    "guidance") and ``disable_any_whitespace`` (default True here, False in vLLM); None = the defaults.
    """

    prefill_mode: str | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    num_kv_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    window_slack_rows: int = 16
    seed: int = 0
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    cache_max_bytes: int = 16 * 1024**3
    swa_pool_bytes: int | None = None
    replay: str = "bounded"
    redis_url: str | None = None
    speculative: str | None = None
    speculative_max_len: int | None = None
    speculative_cost_table: dict[int, float] | list[float] | str | None = None
    structured_outputs_config: dict[str, Any] | None = None
    encoder_cache_size: int | None = None
    ec_transfer_config: dict[str, Any] | None = None
    kv_transfer_config: Any = None

    def __post_init__(self) -> None:
        if self.kv_transfer_config is not None and not isinstance(self.kv_transfer_config, KVTransferConfig):
            self.kv_transfer_config = KVTransferConfig.from_cli(self.kv_transfer_config)

    def cache_config(self, max_model_len: int) -> CacheConfig:
        """The cache settings of these arguments, for an engine of ``max_model_len`` tokens per sequence."""
        return CacheConfig(max_model_len, **{f.name: getattr(self, f.name) for f in fields(CacheConfig)
                                             if f.name != "max_model_len"})
