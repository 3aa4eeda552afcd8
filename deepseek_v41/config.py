"""Model configuration: the official ``config.json`` keys as a dataclass, presets and validation.

Field names are the official ``text_config`` keys of DeepSeek-V4.1-Flash (MODEL_REFERENCE.md §2.1), plus the
top-level token ids, ``vision_config`` and ``quantization_config``, and ``gate_temp`` of the reference
``ModelArgs`` (absent from the release's JSON: 1.0 when absent, written only when not 1.0). Size keys default
to the official values; keys that switch a feature on mean "off" when absent: ``compress_ratios`` (no compression),
``kv_source_layer_ids`` / ``index_source_layer_ids`` (none), ``candidate_source_layer_id`` (-1: no candidate
pool), ``engram_layer_ids`` ([]), ``num_nextn_predict_layers`` (0: no DSpark draft), no ``vision_config`` (no
vision path), no ``quantization_config`` (each tensor used as stored, decided by its dtype).

Source: MODEL_REFERENCE.md §2 (config), §3.11 (layer modes), §3.16 (CED), ENGRAM.md §1, §4, DSPARK.md §1.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepseek_v41.engram_sizes import engram_table_sizes

MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
ALLOWED_COMPRESS_RATIOS = (0, 1, 2)
# Keys Hugging Face and the official release put in a config that carry no model math.
# Keys of the reference ``ModelArgs`` that the release's config.json leaves out, with their defaults: read when
# present, written only when they differ from the default (a default config keeps the release layout, and with it
# the prefix cache's digest of the config and the model cards' config).
ARGS_ONLY_DEFAULTS: dict[str, Any] = {"gate_temp": 1.0}
_METADATA_KEYS = {
    "architectures", "transformers_version", "dtype", "torch_dtype", "auto_map", "_name_or_path",
    "use_cache", "attention_bias", "attention_dropout", "initializer_range", "output_attentions",
    "output_hidden_states", "return_dict",
}


class ConfigError(ValueError):
    """A config that the model cannot run: ``problems`` holds one message per problem found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid model config:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class VisionConfig:
    """``vision_config`` of the release (MODEL_REFERENCE.md §2.1, §3.18): the ViT and aligner sizes."""

    model_type: str = "deepseek_v41_vision"
    num_hidden_layers: int = 32  # ViT blocks
    hidden_size: int = 1024  # ViT width
    num_attention_heads: int = 16  # bidirectional attention heads inside an image
    intermediate_size: int = 2816  # SwiGLU hidden width of the ViT MLP
    patch_size: int = 14  # pixels per patch side; a patch is 3*14*14 = 588 values
    rope_theta: float = 10000.0  # 2-D RoPE base of the ViT
    downsample_ratio: int = 3  # 3x3 patches merged into one LLM token by the aligner
    max_image_tokens: int = 1024  # LLM tokens per image at most
    min_pixels: int = 295936  # 544*544
    max_wh_ratio: float | None = None  # no aspect-ratio limit when None


@dataclass
class QuantizationConfig:
    """``quantization_config``: how the stored weights are quantized (MODEL_REFERENCE.md §4).

    Every field is optional; a tensor is dequantized by what it is (its dtype and whether a ``.scale`` tensor
    sits beside it), so this record documents the layout rather than steering the loader.
    """

    quant_method: str | None = None  # "fp8": dense weights FP8 E4M3 with block scales
    activation_scheme: str | None = None  # "dynamic": activations quantized per 32 at run time
    weight_block_size: tuple[int, int] | None = None  # (32, 32) in the release
    scale_fmt: str | None = None  # "ue8m0": power-of-two scales
    expert_dtype: str | None = None  # "fp4": routed experts packed E2M1 with 1x32 UE8M0 scales


@dataclass
class ModelConfig:
    """DeepSeek-V4.1 text model configuration; field names are the official ``text_config`` keys.

    Build it with :meth:`from_pretrained` (a model directory or a ``config.json``, the multimodal wrapper or a
    flat text config), :meth:`from_dict`, or :func:`preset`. Construction validates the whole config and raises
    :class:`ConfigError` listing every problem at once.
    """

    model_type: str = "deepseek_v41"
    # --- token ids (top level of the official wrapper)
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int | None = None  # every position of an image span carries this id; None without vision
    # --- backbone sizes
    vocab_size: int = 129280  # embedding and LM-head rows
    hidden_size: int = 5120  # residual width D
    num_hidden_layers: int = 40  # backbone blocks (DSpark draft blocks not included)
    num_attention_heads: int = 64  # query heads H
    num_key_value_heads: int = 1  # one shared latent per token (K = V, MQA)
    head_dim: int = 512  # query/key/value width per head
    qk_rope_head_dim: int = 64  # trailing dims that carry RoPE
    q_lora_rank: int = 1280  # query low-rank bottleneck (also the indexer query input)
    o_lora_rank: int = 1024  # rank of each grouped output projection
    o_groups: int = 8  # output groups (heads per group = H / o_groups)
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0  # SwiGLU clamp
    rms_norm_eps: float = 1e-20  # eps of every text RMSNorm and of the mHC rsqrt
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0  # RoPE base of window-only layers (no YaRN there)
    rope_scaling: dict[str, Any] | None = None  # YaRN of compressed layers; None = no YaRN
    # --- MoE
    moe_intermediate_size: int = 2304  # expert hidden width
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"  # selection with a correction bias, no group limit
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    # Router temperature: logits are divided by it before sqrt(softplus) (MODEL_REFERENCE.md §3.14, §9 item 3).
    # A reference ``ModelArgs`` key, absent from the release's config.json; mlx-lm's port reads and writes it.
    gate_temp: float = 1.0
    # --- attention: sliding window and CSA2
    sliding_window: int = 128  # window keys per query, own token included
    compress_ratios: list[int] = field(default_factory=list)  # per layer: 0 window-only, 1 or 2 compressed
    compress_rope_theta: float = 160000.0  # RoPE base of compressed layers
    kv_source_layer_ids: list[int] = field(default_factory=list)  # layers with their own compressor
    index_source_layer_ids: list[int] = field(default_factory=list)  # layers with their own indexer query
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512  # compressed entries selected per query
    candidate_source_layer_id: int = -1  # layer whose scores build the candidate pool; -1 = no pool
    candidate_topk_blocks: int = 2048  # blocks kept in the pool
    candidate_block_size: int = 8  # entries per candidate block
    # --- mHC
    hc_mult: int = 4  # residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # --- Engram
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_num_embeddings: list[int] = field(default_factory=list)  # table rows per Engram layer
    engram_max_ngram_size: int = 4  # n-grams of order 2..max
    engram_vocab_size: int = 16000000  # start of the prime search, not a table size
    engram_n_heads: int = 8  # hash heads per n-gram order
    engram_head_dim: int = 256  # width of one table row
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092  # distinct compressed token ids
    # --- DSpark draft
    num_nextn_predict_layers: int = 0  # draft blocks (mtp.*); 0 = no draft
    dspark_block_size: int = 5  # tokens drafted per draft forward
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=list)  # layers whose inputs feed the draft
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # --- sub-configs
    vision_config: VisionConfig | None = None
    quantization_config: QuantizationConfig | None = None

    def __post_init__(self) -> None:
        if not self.compress_ratios:
            self.compress_ratios = [0] * self.num_hidden_layers
        self.compress_ratios = [int(r) for r in self.compress_ratios]
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            setattr(self, name, [int(v) for v in getattr(self, name)])
        if isinstance(self.vision_config, dict):
            self.vision_config = _build(VisionConfig, self.vision_config, "vision_config")
        if isinstance(self.quantization_config, dict):
            self.quantization_config = _build(QuantizationConfig, self.quantization_config,
                                              "quantization_config")
        problems = validate(self)
        if problems:
            raise ConfigError(problems)

    # ------------------------------------------------------------------ derived values
    @property
    def layer_ratios(self) -> list[int]:
        """Compress ratio of each backbone layer (the first ``num_hidden_layers`` entries)."""
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def yarn(self) -> dict[str, float] | None:
        """YaRN parameters of compressed layers (``factor``, ``original_max_position_embeddings``,
        ``beta_fast``, ``beta_slow``), or None when ``rope_scaling`` is absent."""
        if not self.rope_scaling:
            return None
        s = self.rope_scaling
        return {
            "factor": float(s.get("factor", 1.0)),
            "original_max_position_embeddings": int(
                s.get("original_max_position_embeddings", self.max_position_embeddings)),
            "beta_fast": float(s.get("beta_fast", 32)),
            "beta_slow": float(s.get("beta_slow", 1)),
        }

    @property
    def has_vision(self) -> bool:
        return self.vision_config is not None

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``: the multimodal wrapper (``text_config`` with the token ids,
        ``vision_config`` and ``quantization_config`` at top level) or a flat text config.

        Raises ConfigError for unknown keys (a misspelt feature key would otherwise silently mean "off"),
        ill-typed values and every validation problem.
        """
        data = dict(data)
        if "text_config" in data:
            top = {k: v for k, v in data.items() if k != "text_config"}
            text = dict(data["text_config"])
            merged = {**text}
            for key, value in top.items():
                if key == "model_type":
                    continue
                merged.setdefault(key, value)
            # The wrapper says "deepseek_v41", its text_config "deepseek_v41_text": both name this model, and an
            # unknown name in either place is reported.
            types = [t for t in (top.get("model_type"), text.get("model_type")) if t is not None]
            merged["model_type"] = next((t for t in types if t not in MODEL_TYPES), "deepseek_v41")
            data = merged
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in known and k not in _METADATA_KEYS)
        if unknown:
            raise ConfigError([f"unknown config key {k!r}" for k in unknown]
                              + [f"known keys: {', '.join(sorted(known))}"])
        kwargs = {k: v for k, v in data.items() if k in known}
        type_problems = _type_problems(kwargs)
        if type_problems:
            raise ConfigError(type_problems)
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Load ``config.json`` from a model directory, or a JSON file given directly.

        Raises FileNotFoundError when there is no config, ConfigError when it is invalid.
        """
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError([f"{file} is not valid JSON: {exc}"]) from exc
        return cls.from_dict(data)

    def to_dict(self, torch_dtype: str | None = None) -> dict[str, Any]:
        """The official multimodal wrapper layout: token ids, ``text_config``, ``vision_config`` and
        ``quantization_config`` (the last two only when present). ``ModelArgs``-only keys (``gate_temp``) are
        written only when they differ from their default (:data:`ARGS_ONLY_DEFAULTS`). ``torch_dtype`` (e.g.
        ``"bfloat16"``: the dtype the weights are stored in, Hugging Face's key, read back by
        :func:`deepseek_v41.dtypes.config_dtype`) is written at the top level when given; it is metadata, not a
        field (the same model may be loaded in any dtype)."""
        top_keys = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id")
        text = {}
        for f in dataclasses.fields(self):
            if f.name in top_keys or f.name in ("model_type", "vision_config", "quantization_config"):
                continue
            text[f.name] = getattr(self, f.name)
        for key, default in ARGS_ONLY_DEFAULTS.items():
            if text[key] == default:
                del text[key]
        text["model_type"] = "deepseek_v41_text"
        out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41"}
        if torch_dtype is not None:
            out["torch_dtype"] = torch_dtype
        for key in top_keys:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["text_config"] = text
        if self.vision_config is not None:
            out["vision_config"] = dataclasses.asdict(self.vision_config)
        if self.quantization_config is not None:
            q = {k: v for k, v in dataclasses.asdict(self.quantization_config).items() if v is not None}
            if "weight_block_size" in q:
                q["weight_block_size"] = list(q["weight_block_size"])
            out["quantization_config"] = q
        return out

    def save(self, path: str | Path, torch_dtype: str | None = None) -> Path:
        """Write ``config.json`` (wrapper layout, with ``torch_dtype`` when given: see :meth:`to_dict`) into
        directory ``path``; returns the file path."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        file = path / "config.json"
        file.write_text(json.dumps(self.to_dict(torch_dtype), indent=2) + "\n")
        return file

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError([f"unknown {where} key {k!r} (known: {', '.join(sorted(known))})" for k in unknown])
    if cls is QuantizationConfig and data.get("weight_block_size") is not None:
        data = {**data, "weight_block_size": tuple(data["weight_block_size"])}
    return cls(**data)


def _type_problems(kwargs: dict[str, Any]) -> list[str]:
    """Reject values of the wrong JSON type before any arithmetic runs on them."""
    problems = []
    hints = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    for key, value in kwargs.items():
        hint = str(hints[key])
        if hint == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{key} must be an integer, got {value!r}")
        elif hint == "float" and (isinstance(value, bool) or not isinstance(value, int | float)):
            problems.append(f"{key} must be a number, got {value!r}")
        elif hint == "bool" and not isinstance(value, bool):
            problems.append(f"{key} must be true or false, got {value!r}")
        elif hint == "list[int]" and not (
            isinstance(value, list | tuple)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            problems.append(f"{key} must be a list of integers, got {value!r}")
    return problems


def latest_source(layer: int, sources: list[int], ratios: list[int]) -> int | None:
    """The latest layer ``j <= layer`` in ``sources`` with the same compress ratio as ``layer``, or None.

    This is the reuse rule of MODEL_REFERENCE.md §3.11: a compressed layer reads the entries and index keys of
    the latest kv source at or before it, and the top-k of the latest index source at or before it.
    """
    ratio = ratios[layer]
    candidates = [j for j in sources if j <= layer and ratios[j] == ratio]
    return max(candidates) if candidates else None


def validate(cfg: ModelConfig) -> list[str]:
    """Every problem of ``cfg`` as one message each (empty when the config is runnable)."""
    p: list[str] = []
    n = cfg.num_hidden_layers
    if cfg.model_type not in MODEL_TYPES:
        p.append(f"unknown model_type {cfg.model_type!r}; this package runs {' or '.join(MODEL_TYPES)}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts",
                 "num_experts_per_tok", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                 "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters",
                 "max_position_embeddings"):
        if getattr(cfg, name) <= 0:
            p.append(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.n_shared_experts < 0:
        p.append(f"n_shared_experts must be >= 0, got {cfg.n_shared_experts}")
    if cfg.num_key_value_heads != 1:
        p.append(f"num_key_value_heads must be 1 (one shared latent per token), got {cfg.num_key_value_heads}")
    if cfg.hidden_act != "silu":
        p.append(f"hidden_act must be 'silu', got {cfg.hidden_act!r}")
    if cfg.scoring_func != "sqrtsoftplus":
        p.append(f"scoring_func must be 'sqrtsoftplus', got {cfg.scoring_func!r}")
    if cfg.topk_method != "noaux_tc":
        p.append(f"topk_method must be 'noaux_tc', got {cfg.topk_method!r}")
    if cfg.rms_norm_eps < 0 or cfg.hc_eps < 0:
        p.append("rms_norm_eps and hc_eps must be >= 0")
    g = cfg.gate_temp
    if isinstance(g, bool) or not isinstance(g, int | float) or not (math.isfinite(g) and g > 0):
        p.append(f"gate_temp must be a finite number > 0 (the router divides its logits by it; 1.0 = no "
                 f"change), got {g!r}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts > 0:
        p.append(f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds n_routed_experts "
                 f"({cfg.n_routed_experts})")
    if cfg.o_groups > 0 and cfg.num_attention_heads % cfg.o_groups:
        p.append(f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of o_groups "
                 f"({cfg.o_groups})")
    rope = cfg.qk_rope_head_dim
    if rope < 0 or rope % 2:
        p.append(f"qk_rope_head_dim must be even and >= 0, got {rope}")
    if rope > cfg.head_dim or rope > cfg.index_head_dim:
        p.append(f"qk_rope_head_dim ({rope}) exceeds head_dim ({cfg.head_dim}) or index_head_dim "
                 f"({cfg.index_head_dim})")
    # Block sizes of the KV formats: FP4 main entries per 16, FP8 window rows and FP4 index keys per 32.
    if cfg.head_dim % 32:
        p.append(f"head_dim must be a multiple of 32 (FP8 window blocks of 32, FP4 blocks of 16), "
                 f"got {cfg.head_dim}")
    if cfg.index_head_dim % 32:
        p.append(f"index_head_dim must be a multiple of 32 (FP4 index-key blocks of 32), got {cfg.index_head_dim}")
    if cfg.rope_scaling is not None:
        kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
        if kind != "yarn":
            p.append(f"rope_scaling type must be 'yarn', got {kind!r}")
        elif float(cfg.rope_scaling.get("factor", 1.0)) < 1.0:
            p.append("rope_scaling.factor must be >= 1")
    p += _validate_layers(cfg, n)
    p += _validate_engram(cfg, n)
    p += _validate_dspark(cfg, n)
    p += _validate_tokens(cfg)
    if cfg.vision_config is not None and cfg.image_token_id is None:
        p.append("vision_config is set but image_token_id is missing")
    q = cfg.quantization_config
    if q is not None:
        if q.quant_method not in (None, "fp8"):
            p.append(f"quantization_config.quant_method must be 'fp8', got {q.quant_method!r}")
        if q.scale_fmt not in (None, "ue8m0"):
            p.append(f"quantization_config.scale_fmt must be 'ue8m0', got {q.scale_fmt!r}")
        if q.expert_dtype not in (None, "fp4", "fp8", "bf16"):
            p.append(f"quantization_config.expert_dtype must be 'fp4', 'fp8' or 'bf16', got {q.expert_dtype!r}")
        if q.weight_block_size is not None and (
                len(q.weight_block_size) != 2 or min(q.weight_block_size) <= 0):
            p.append(f"quantization_config.weight_block_size must be two positive integers, "
                     f"got {q.weight_block_size}")
    return p


def _validate_layers(cfg: ModelConfig, n: int) -> list[str]:
    p: list[str] = []
    allowed = (n, n + cfg.num_nextn_predict_layers)
    if len(cfg.compress_ratios) not in allowed:
        p.append(f"compress_ratios has {len(cfg.compress_ratios)} entries; expected num_hidden_layers ({n})"
                 + (f" or num_hidden_layers + num_nextn_predict_layers ({allowed[1]})"
                    if cfg.num_nextn_predict_layers else ""))
        return p
    bad = sorted({r for r in cfg.compress_ratios if r not in ALLOWED_COMPRESS_RATIOS})
    if bad:
        p.append(f"compress_ratios values must be in {ALLOWED_COMPRESS_RATIOS} (V4.1 compresses pairs or "
                 f"single tokens), got {bad}")
        return p
    if any(cfg.compress_ratios[n:]):
        p.append("compress_ratios entries of the DSpark draft layers must be 0 (draft layers are window-only)")
    ratios = cfg.layer_ratios
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        ids = getattr(cfg, name)
        if len(set(ids)) != len(ids):
            p.append(f"{name} has duplicates: {ids}")
        for j in ids:
            if not 0 <= j < n:
                p.append(f"{name} entry {j} is outside the layers 0..{n - 1}")
            elif ratios[j] == 0:
                p.append(f"{name} entry {j} has compress ratio 0; a source layer must be compressed")
    if p:
        return p
    for j in cfg.kv_source_layer_ids:
        if j not in cfg.index_source_layer_ids:
            p.append(f"kv source layer {j} is not an index source: its entries would have no index keys "
                     f"(add {j} to index_source_layer_ids)")
    for layer in range(n):
        if ratios[layer] == 0:
            continue
        if latest_source(layer, cfg.kv_source_layer_ids, ratios) is None:
            p.append(f"layer {layer} (compress ratio {ratios[layer]}) has no kv source of the same ratio at or "
                     f"before it (kv_source_layer_ids={cfg.kv_source_layer_ids})")
        if latest_source(layer, cfg.index_source_layer_ids, ratios) is None:
            p.append(f"layer {layer} (compress ratio {ratios[layer]}) has no index source of the same ratio at "
                     f"or before it (index_source_layer_ids={cfg.index_source_layer_ids})")
    c = cfg.candidate_source_layer_id
    if c != -1:
        if not 0 <= c < n:
            p.append(f"candidate_source_layer_id {c} is outside the layers 0..{n - 1} (-1 means no pool)")
        elif c not in cfg.index_source_layer_ids:
            p.append(f"candidate_source_layer_id {c} is not an index source (index_source_layer_ids="
                     f"{cfg.index_source_layer_ids})")
        smallest_pool = (cfg.candidate_topk_blocks - 1) * cfg.candidate_block_size + 1
        if smallest_pool < cfg.index_topk:
            # The newest block is always kept, even with one entry; a pool that can hold fewer than index_topk
            # visible entries would leave Reindex layers picking entries outside it (score -inf) in no defined
            # order.
            p.append(f"the candidate pool can hold as few as (candidate_topk_blocks - 1) x candidate_block_size"
                     f" + 1 = {smallest_pool} entries, fewer than index_topk ({cfg.index_topk})")
    return p


def _validate_engram(cfg: ModelConfig, n: int) -> list[str]:
    p: list[str] = []
    ids = cfg.engram_layer_ids
    if not ids:
        if cfg.engram_num_embeddings:
            p.append("engram_num_embeddings is set but engram_layer_ids is empty")
        return p
    if len(set(ids)) != len(ids):
        p.append(f"engram_layer_ids has duplicates: {ids}")
    encoder_end = n // 2
    for j in ids:
        if not 0 <= j < encoder_end:
            p.append(f"Engram layer {j} is outside the encoder (layers 0..{encoder_end - 1}); Engram acts on "
                     f"the encoder only")
    if len(cfg.engram_num_embeddings) != len(ids):
        p.append(f"engram_num_embeddings has {len(cfg.engram_num_embeddings)} entries for "
                 f"{len(ids)} Engram layers")
    for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
        if getattr(cfg, name) <= 0:
            p.append(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.engram_max_ngram_size < 2:
        p.append(f"engram_max_ngram_size must be >= 2 (n-grams of order 2..max), got {cfg.engram_max_ngram_size}")
    if not 0 <= cfg.engram_pad_token_id < cfg.vocab_size:
        p.append(f"engram_pad_token_id {cfg.engram_pad_token_id} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    if p:
        return p
    for layer, rows, want in zip(ids, cfg.engram_num_embeddings, engram_table_sizes(cfg), strict=True):
        if rows != sum(want):
            p.append(f"engram_num_embeddings for layer {layer} is {rows}, but the prime table sizes of that "
                     f"layer sum to {sum(want)} (ENGRAM.md §4)")
    return p


def _validate_dspark(cfg: ModelConfig, n: int) -> list[str]:
    p: list[str] = []
    if cfg.num_nextn_predict_layers < 0:
        return [f"num_nextn_predict_layers must be >= 0, got {cfg.num_nextn_predict_layers}"]
    if cfg.num_nextn_predict_layers == 0:
        return p
    for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts",
                 "dspark_num_experts_per_tok"):
        if getattr(cfg, name) <= 0:
            p.append(f"{name} must be positive when num_nextn_predict_layers > 0, got {getattr(cfg, name)}")
    if cfg.dspark_num_experts_per_tok > cfg.dspark_n_routed_experts:
        p.append(f"dspark_num_experts_per_tok ({cfg.dspark_num_experts_per_tok}) exceeds "
                 f"dspark_n_routed_experts ({cfg.dspark_n_routed_experts})")
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        p.append(f"dspark_noise_token_id {cfg.dspark_noise_token_id} is outside the vocabulary "
                 f"0..{cfg.vocab_size - 1}")
    targets = cfg.dspark_target_layer_ids
    if not targets:
        p.append("dspark_target_layer_ids is empty; the draft needs at least one target layer")
    if len(set(targets)) != len(targets):
        p.append(f"dspark_target_layer_ids has duplicates: {targets}")
    for j in targets:
        if not 0 <= j < n:
            p.append(f"dspark_target_layer_ids entry {j} is outside the layers 0..{n - 1}")
    return p


def _validate_tokens(cfg: ModelConfig) -> list[str]:
    p = []
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
        value = getattr(cfg, name)
        if value is not None and not 0 <= value < cfg.vocab_size:
            p.append(f"{name} {value} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    return p


# ---------------------------------------------------------------------------------------------- presets
def flash_config() -> ModelConfig:
    """The released DeepSeek-V4.1-Flash config, every key set explicitly (MODEL_REFERENCE.md §2.1)."""
    return ModelConfig(
        model_type="deepseek_v41", bos_token_id=0, eos_token_id=1, pad_token_id=2, image_token_id=129264,
        vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64,
        num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024,
        o_groups=8, hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-20, tie_word_embeddings=False,
        max_position_embeddings=1048576, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 65536},
        moe_intermediate_size=2304, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6,
        scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
        sliding_window=128, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        compress_rope_theta=160000.0, kv_source_layer_ids=[2, 8, 14, 20],
        index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], index_n_heads=32, index_head_dim=128,
        index_topk=512, candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4,
        engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256, engram_pad_token_id=2,
        engram_compressed_vocab_size=99092,
        num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=128799,
        dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256, dspark_n_routed_experts=128,
        dspark_num_experts_per_tok=3,
        vision_config=VisionConfig(),
        quantization_config=QuantizationConfig(quant_method="fp8", activation_scheme="dynamic",
                                               weight_block_size=(32, 32), scale_fmt="ue8m0",
                                               expert_dtype="fp4"),
    )


def tiny_config() -> ModelConfig:
    """A small config with every layer role present, for tests (about 1M parameters).

    Layers: 0 window-only, 1 window-only + Engram, 2 Full m=2, 3 Reuse m=2, 4 Full m=1 + candidate source + CED
    boundary, 5 Reuse m=1, 6 Reindex (inside the candidate pool), 7 Reuse after Reindex; one DSpark draft layer.
    """
    base = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=32, o_groups=2, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, sliding_window=16,
        rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 256},
        max_position_embeddings=1024,
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0], kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6],
        index_n_heads=2, index_head_dim=32, index_topk=8, candidate_source_layer_id=4, candidate_topk_blocks=3,
        candidate_block_size=4, hc_mult=4, hc_sinkhorn_iters=20,
        engram_layer_ids=[1], engram_max_ngram_size=3, engram_vocab_size=1000, engram_n_heads=2,
        engram_head_dim=32, engram_pad_token_id=2, engram_compressed_vocab_size=512,
        num_nextn_predict_layers=1, dspark_block_size=4, dspark_noise_token_id=511,
        dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=8, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
    )
    sizes = engram_table_sizes(_EngramSizes(**{k: base[k] for k in _EngramSizes.__dataclass_fields__}))
    return ModelConfig(**base, engram_num_embeddings=[sum(s) for s in sizes])


@dataclass
class _EngramSizes:
    """The keys the prime rule reads, so that a preset can size its tables before it is validated."""

    engram_layer_ids: list[int]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int


PRESETS = {"flash": flash_config, "tiny": tiny_config}


def preset(name: str) -> ModelConfig:
    """A named preset (``flash`` or ``tiny``). Raises ValueError naming the presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A preset name, a model directory or a ``config.json`` path."""
    if str(name_or_path) in PRESETS:
        return preset(str(name_or_path))
    return ModelConfig.from_pretrained(name_or_path)
