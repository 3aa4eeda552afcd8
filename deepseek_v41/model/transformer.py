"""The whole text model: embedding, the blocks (:mod:`deepseek_v41.model.block`), the CED stacks, the head
(MODEL_REFERENCE.md §3.1, §3.13, §3.15, §3.16).

``Transformer(config)(input_ids, image_mask=None) -> logits [B, T, vocab]`` is the exact forward of every
position (training and evaluation), with the reference fake-quant of the KV on by default
(``model.fake_quant = False`` turns it off). The engine composes the same pieces (:meth:`embed_streams`,
:meth:`run_layers`, :meth:`logits`) with its own KV context to run CED and chunked prefill.
"""

from __future__ import annotations

import torch
from torch import nn

from deepseek_v41.config import ModelConfig
from deepseek_v41.model.block import Block
from deepseek_v41.model.context import DenseContext
from deepseek_v41.model.dspark import DSparkDraft
from deepseek_v41.model.engram import EngramHasher
from deepseek_v41.model.hyper import collapse
from deepseek_v41.model.linear import LMHead
from deepseek_v41.model.norm import RMSNorm, upcast
from deepseek_v41.model.save import named_weights, save_pretrained
from deepseek_v41.model.vision import add_vision, embed_images, image_token_mask, window_key_limit
from deepseek_v41.plan import build_layer_plan


class Transformer(nn.Module):
    """The DeepSeek-V4.1 text model. Parameter names are the official checkpoint names (MODEL_REFERENCE.md §8)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.plan = build_layer_plan(config)
        self._fake_quant = True
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, spec) for spec in self.plan.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        if config.vision_config is not None:
            add_vision(self, config)  # vision.*, aligner.*, image_start / newline / end (MODEL_REFERENCE.md §8)
        self.hasher = None
        if config.engram_layer_ids:
            self.hasher = EngramHasher(config)
        self.mtp = None
        if config.num_nextn_predict_layers:
            self.mtp = DSparkDraft(config)  # mtp.*: the DSpark draft; it shares embed and head (DSPARK.md §1)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random init for training from scratch: normal(0, initializer_range) matrices, unit norms, zero biases,
        sinks and mHC bases, unit mHC scales."""
        std = 0.02
        for name, p in named_weights(self):
            if p.device.type == "meta":
                continue
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or leaf.endswith("_scale"):
                p.fill_(1.0)
            elif leaf in ("bias", "bias_vl", "attn_sink") or leaf.endswith("_base"):
                p.zero_()
            elif p.dim() >= 2 and p.is_floating_point():
                p.normal_(0.0, std)

    @property
    def fake_quant(self) -> bool:
        """Whether the exact forward (and the DSpark draft) apply the reference KV fake-quant."""
        return self._fake_quant

    @fake_quant.setter
    def fake_quant(self, value: bool) -> None:
        self._fake_quant = bool(value)
        if getattr(self, "mtp", None) is not None:
            self.mtp.fake_quant = bool(value)

    def save_pretrained(self, path, quantization: str = "none", max_shard_bytes: int = 4 * 1024**3,
                        dtype: torch.dtype | None = None):
        """Write config.json + safetensors under the official names; see
        :func:`deepseek_v41.model.save.save_pretrained`."""
        return save_pretrained(self, path, quantization, max_shard_bytes, dtype)

    # ------------------------------------------------------------------ pieces the engine composes
    def embed_streams(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                      images: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings repeated into the hc streams [B, T, hc, D] and the first block's one-hot ``pre``.

        With ``images`` (preprocessed, see :mod:`deepseek_v41.model.image_processor`) and ``token_types``
        [B, T], image spans get the aligner's rows and the learned delimiters (MODEL_REFERENCE.md §3.18).
        """
        h = self.embed(input_ids)
        if images:
            h, _ = embed_images(self, h, token_types, images)
        B, T, D = h.shape
        hc = self.config.hc_mult
        streams = h[:, :, None, :].expand(B, T, hc, D).contiguous()
        pre = torch.zeros(B, T, hc, dtype=upcast(h).dtype, device=h.device)
        pre[..., 0] = 1.0
        return streams, pre

    def run_layers(self, layers: range, streams: torch.Tensor, pre: torch.Tensor, ctx,
                   image_mask: torch.Tensor | None = None, engram_rows: dict[int, torch.Tensor] | None = None,
                   taps: dict[int, torch.Tensor] | None = None,
                   skip_compress: set[int] | frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``layers`` in order. ``engram_rows[layer]`` [B, T, columns] feeds Engram layers; ``taps``, when
        given, receives each layer's input residual streams (DSpark target features); layers in
        ``skip_compress`` do not run their compressor (CED: it already ran over every token)."""
        for j in layers:
            block = self.layers[j]
            if block.engram is not None:
                streams = block.engram(streams, engram_rows[j], image_mask)
            if taps is not None:
                taps[j] = streams
            streams, pre = block(streams, pre, ctx, image_mask, compress=j not in skip_compress)
        return streams, pre

    def key_limit(self, token_types: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
        """The contexts' ``key_limit`` [B, T] for a forward at ``positions`` [B, T] whose span roles are
        ``token_types`` [B, T] (:func:`~deepseek_v41.model.vision.window_key_limit`: bidirectional attention
        inside image spans), or None when it holds no image position (then attention is exactly the text code)."""
        if token_types is None:
            return None
        types = token_types.to(positions.device)
        if types.device.type != "meta" and not bool(image_token_mask(types).any()):
            return None
        return window_key_limit(types, positions, self.config.sliding_window)

    # ------------------------------------------------------------------ CED (MODEL_REFERENCE.md §3.16)
    def ced_encode(self, streams: torch.Tensor, pre: torch.Tensor, ctx,
                   engram_rows: dict[int, torch.Tensor] | None = None,
                   taps: dict[int, torch.Tensor] | None = None,
                   image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The CED encoder over every position of streams [B, T, hc, D]: the encoder layers
        (``plan.encoder_layers``), then the first decoder layer's compressor over the same positions (so the
        compressed entries the decoder reads cover the whole prompt). Returns the encoder's output (streams, pre),
        which the decoder reads from its start (:meth:`deepseek_v41.plan.LayerPlan.decoder_start`) on. The one
        home of the CED order: the engine's chunked prefill and the evaluation's exact CED both call it.
        ``image_mask`` [B, T] bool: image positions (``bias_vl`` routing, masked out of Engram), as in
        :meth:`run_layers`. Raises ValueError without a CED layout (``plan.ced_reason`` says why)."""
        plan = self.plan
        if not plan.ced:
            raise ValueError(f"CED needs the CED layout; this model has {plan.ced_reason}")
        streams, pre = self.run_layers(plan.encoder_layers, streams, pre, ctx, image_mask, engram_rows, taps)
        boundary = self.layers[plan.decoder_layers[0]]
        boundary.attn.compress(boundary.attention_input(streams, pre), ctx)
        return streams, pre

    def ced_decode(self, streams: torch.Tensor, pre: torch.Tensor, ctx,
                   engram_rows: dict[int, torch.Tensor] | None = None,
                   taps: dict[int, torch.Tensor] | None = None,
                   image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The CED decoder: the decoder layers over the positions of ``ctx`` (from the decoder start on), without
        the first decoder layer's compressor, which :meth:`ced_encode` ran over every position. ``image_mask``
        [B, T] bool of these positions, as in :meth:`run_layers`."""
        plan = self.plan
        return self.run_layers(plan.decoder_layers, streams, pre, ctx, image_mask, engram_rows, taps,
                               skip_compress={plan.decoder_layers[0]})

    def logits(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Final collapse, norm and LM head: [B, T, hc, D] -> logits [B, T, vocab], fp32 (float64 for float64)."""
        return self.lm_head(upcast(self.norm(collapse(streams, pre))))

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on the final normalised hidden x [B, T, D] fp32 (float64 stays): logits [B, T, vocab] in x's
        dtype (the head weight widened to it; a vocab-parallel head gathers the full vocabulary)."""
        return self.head(x)

    def forward(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None, images: list | None = None) -> torch.Tensor:
        """Exact forward: input_ids [B, T] long -> logits [B, T, V] fp32.

        ``image_mask`` [B, T] bool marks image tokens (routed with ``bias_vl``, masked out of Engram); with
        ``token_types`` [B, T] (image span roles, -1 = text) and ``images`` the vision path fills the spans, the
        mask is derived from the types and attention is bidirectional inside each span (:meth:`key_limit`).
        Raises ValueError for ids outside the vocabulary, a mask of the wrong shape or a span cut by the end.
        """
        if token_types is not None:
            image_mask = image_token_mask(token_types.to(input_ids.device))
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if image_mask is not None and image_mask.shape != input_ids.shape:
            raise ValueError(f"image_mask shape {tuple(image_mask.shape)} differs from input_ids "
                             f"{tuple(input_ids.shape)}")
        if input_ids.device.type != "meta" and input_ids.numel() and (
                int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        ctx = DenseContext(B, T, input_ids.device, self.fake_quant, self.key_limit(token_types, positions))
        rows = self.hasher(input_ids, image_mask) if self.hasher is not None else None
        streams, pre = self.embed_streams(input_ids, token_types, images)
        streams, pre = self.run_layers(range(len(self.layers)), streams, pre, ctx, image_mask, rows)
        return self.logits(streams, pre)
