"""One layer of the text model: (Engram) -> mHC attention site -> mHC FFN site (MODEL_REFERENCE.md §3.1, §3.13).

Its own module so that the DSpark draft (:class:`~deepseek_v41.model.dspark.DSparkBlock`) builds on it without
importing the whole :class:`~deepseek_v41.model.transformer.Transformer`, which holds the draft.
"""

from __future__ import annotations

import torch
from torch import nn

from deepseek_v41.config import ModelConfig
from deepseek_v41.model.attention import Attention
from deepseek_v41.model.engram import Engram
from deepseek_v41.model.hyper import collapse, expand, hc_mix
from deepseek_v41.model.moe import MoE
from deepseek_v41.model.norm import RMSNorm, upcast
from deepseek_v41.plan import LayerSpec


class Block(nn.Module):
    """One layer: (Engram) -> mHC attention site -> mHC FFN site, with the one-sub-layer-late ``pre``.

    ``forward(streams [B, T, hc, D], pre [B, T, hc], ctx, image_mask) -> (streams, pre_out)``; the attention
    input collapses the streams with the ``pre`` handed in by the previous block (one-hot on stream 0 for the
    first), the FFN input with this block's attention-site ``pre``; ``pre_out`` is the FFN site's ``pre``.
    """

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, n_experts: int | None = None, topk: int | None = None):
        super().__init__()
        self.spec = spec
        self.layer_id = spec.layer_id
        hc, D = cfg.hc_mult, cfg.hidden_size
        self.hc = hc
        self.norm_eps, self.hc_eps, self.hc_iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, spec)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn = MoE(D, cfg.moe_intermediate_size, n_experts or cfg.n_routed_experts,
                       topk or cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.swiglu_limit,
                       cfg.routed_scaling_factor, cfg.norm_topk_prob, cfg.vision_config is not None,
                       gate_temp=cfg.gate_temp)
        mix = (2 + hc) * hc
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, hc * D, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        self.engram = Engram(cfg, spec.layer_id) if spec.engram else None

    def mix(self, site: str, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mHC coefficients ``(pre, post, comb)`` of ``site`` ("attn" or "ffn") from the streams (or their
        upcast copy): :func:`~deepseek_v41.model.hyper.hc_mix` with this block's parameters."""
        return hc_mix(streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                      getattr(self, f"hc_{site}_scale"), self.hc, self.norm_eps, self.hc_eps, self.hc_iters)

    def attention_input(self, streams: torch.Tensor, pre: torch.Tensor, wide: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """The normalised attention input [B, T, D] (also what a kv source's compressor reads); ``wide``: the
        streams upcast, when the caller has them."""
        return self.attn_norm(collapse(streams, pre, wide))

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, ctx, image_mask: torch.Tensor | None = None,
                compress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        wide = upcast(streams)  # one fp32 copy of bf16 streams per site, shared by mix / collapse / expand
        a_pre, a_post, a_comb = self.mix("attn", wide)
        y = self.attn(self.attention_input(streams, pre, wide), ctx, compress=compress)
        streams = expand(streams, y, a_post, a_comb, wide)
        wide = upcast(streams)
        f_pre, f_post, f_comb = self.mix("ffn", wide)
        y = self.ffn(self.ffn_norm(collapse(streams, a_pre, wide)), image_mask)
        return expand(streams, y, f_post, f_comb, wide), f_pre
