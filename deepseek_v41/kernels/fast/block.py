"""Fast versions of a block's mHC hyper-connections and of the text model's LM head (issue 24).

:func:`hc_mix`, :func:`collapse` and :func:`expand` are :mod:`deepseek_v41.model.hyper`'s functions with the fused
kernels (:func:`kernels.hc_mix` / ``hc_collapse`` / ``hc_expand``) for fp32 / bf16 CPU tensors under
``torch.inference_mode`` (any row count: their tokens are split over the kernels' pool); otherwise they run the
reference. The kernels add in another order than ATen and skip the bf16 roundings between the steps they fuse,
so they agree with the reference to rounding (tests/kernels). bf16 streams go into the kernels as they are, so a
block shares no fp32 copy of them (:func:`_wide`); collapse fuses the sub-layer's RMSNorm when that is a plain
:class:`~deepseek_v41.model.norm.RMSNorm` (checked once, at install).

Installed on a :class:`~deepseek_v41.model.block.Block` (and the draft's
:class:`~deepseek_v41.model.dspark.DSparkBlock`, whose forward is the block's): ``forward`` and
``attention_input``; on the :class:`~deepseek_v41.disagg.encoder_only.EncoderBoundary` of an encoder-only prefill
model, ``attention_input``. :func:`lm_head` is the
:class:`~deepseek_v41.model.transformer.Transformer`'s (installed with its ``run_layers`` by
:mod:`~deepseek_v41.kernels.fast.decode`): the GEMV kernel for a few tokens of a plain
:class:`~deepseek_v41.model.linear.LMHead` (:func:`~deepseek_v41.kernels.fast.dense.few_token_gemv`; a
vocab-parallel head is called as a module).
"""

from __future__ import annotations

import torch

from deepseek_v41 import kernels
from deepseek_v41.disagg.encoder_only import EncoderBoundary
from deepseek_v41.kernels.fast.dense import few_token_gemv
from deepseek_v41.kernels.fast.registry import fused, global_hooks, override, plain, register
from deepseek_v41.model import hyper
from deepseek_v41.model.block import Block
from deepseek_v41.model.dspark import DSparkBlock
from deepseek_v41.model.linear import LMHead
from deepseek_v41.model.norm import RMSNorm, cast, upcast
from deepseek_v41.model.transformer import Transformer


# ------------------------------------------------------------------------------------------------ mHC
def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`deepseek_v41.model.hyper.hc_mix`; fp32 / bf16 streams (bf16 widened inside the kernel) with up to
    ``kernels.MAX_HC`` streams take the kernel under inference mode."""
    if hc <= kernels.MAX_HC and fused(streams, fn, base, scale):
        return kernels.hc_mix(streams, upcast(fn), upcast(base), upcast(scale), hc, norm_eps, hc_eps, iters)
    return hyper.hc_mix(streams, fn, base, scale, hc, norm_eps, hc_eps, iters)


def collapse_norm(streams: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  wide: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for ``RMSNorm(collapse(streams, weights))`` with the norm's weight [D] and eps, for tensors
    :func:`~deepseek_v41.kernels.fast.fused` takes: [B, T, D] in the streams' dtype (bf16 read and written as it
    is when the weight is bf16 too; else on the upcast streams, ``wide`` when the caller has them)."""
    if norm_weight.dtype == streams.dtype and streams.shape[-1] <= kernels.ROW_ON_STACK:  # bf16 read as it is
        return kernels.hc_collapse(streams, upcast(weights), norm_weight, eps)
    wide = upcast(streams) if wide is None else wide
    return cast(kernels.hc_collapse(wide, upcast(weights), upcast(norm_weight), eps), streams.dtype)


def collapse(streams: torch.Tensor, weights: torch.Tensor, wide: torch.Tensor | None = None,
             norm: RMSNorm | None = None) -> torch.Tensor:
    """:func:`deepseek_v41.model.hyper.collapse`, then ``norm`` when given (the sub-layer input). With a plain
    :class:`RMSNorm` (no hook, no global hook: checked here, per call) and tensors the kernels take, one fused
    kernel (:func:`collapse_norm`); a hooked or subclassed norm is called as a module."""
    if norm is not None and plain(norm, RMSNorm) and not global_hooks():
        weight = norm._parameters["weight"]  # (not norm.weight: Module.__getattr__ costs ~1 µs a lookup)
        if fused(streams, weights, weight):
            return collapse_norm(streams, weights, weight, norm.eps, wide)
    out = hyper.collapse(streams, weights, wide)
    return out if norm is None else norm(out)


def expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
           wide: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`deepseek_v41.model.hyper.expand`; fp32 / bf16 tensors take the kernel under inference mode (bf16
    streams and y read as they are when both bf16)."""
    if fused(streams, y, post, comb):
        if y.dtype == streams.dtype and streams.shape[-1] <= kernels.ROW_ON_STACK:  # bf16 read as it is
            return kernels.hc_expand(streams, y, upcast(post), upcast(comb))
        wide = upcast(streams) if wide is None else wide
        return cast(kernels.hc_expand(wide, upcast(y), upcast(post), upcast(comb)), streams.dtype)
    return hyper.expand(streams, y, post, comb, wide)


def _wide(streams: torch.Tensor) -> torch.Tensor | None:
    """One fp32 copy of bf16 streams per site, shared by the torch code of mix / collapse / expand; None where
    the mHC kernels read the bf16 streams as they are (each function still widens them if its torch code runs)."""
    if (streams.dtype == torch.bfloat16 and streams.shape[-2] <= kernels.MAX_HC
            and streams.shape[-1] <= kernels.ROW_ON_STACK and fused(streams)):
        return None
    return upcast(streams)


# ------------------------------------------------------------------------------------------------ Block
def install_block(m: Block) -> bool:
    """Replace ``forward`` and ``attention_input`` of a block: the mixing, the collapses (fused with the norm when
    ``attn_norm`` / ``ffn_norm`` is a plain :class:`RMSNorm`: decided here, once) and the expansions take the
    kernels; the attention, the MoE and a norm that is not plain run as modules (with their own fast versions)."""
    m.__dict__["_fast_norms"] = (plain(m._modules["attn_norm"], RMSNorm), plain(m._modules["ffn_norm"], RMSNorm))
    override(m, "forward", _block_forward)
    override(m, "attention_input", _attention_input)
    return True


register(Block)(install_block)
register(DSparkBlock)(install_block)  # the draft's stages: a Block with more parameters, the same forward


@register(EncoderBoundary)
def install_encoder_boundary(m: EncoderBoundary) -> bool:
    """What an encoder-only prefill model keeps of the first decoder layer (issue 29) runs only
    ``attention_input``: the block's fused collapse + norm, so that its compressor reads the same bits as in the
    full model."""
    m.__dict__["_fast_norms"] = (plain(m._modules["attn_norm"], RMSNorm), False)
    override(m, "attention_input", _attention_input)
    return True


def _site_input(block: Block, name: str, fuse: bool, streams: torch.Tensor, weights: torch.Tensor,
                wide: torch.Tensor | None) -> torch.Tensor:
    """``block.<name>(collapse(streams, weights))``: the fused kernel when ``fuse`` (the norm was plain at
    install) and the tensors take it, else the reference collapse and the norm module."""
    norm = block._modules[name]
    if fuse:
        weight = norm._parameters["weight"]
        if fused(streams, weights, weight):
            return collapse_norm(streams, weights, weight, norm.eps, wide)
    return norm(hyper.collapse(streams, weights, wide))


def _mix(block: Block, site: str, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = block._parameters
    return hc_mix(streams, p[f"hc_{site}_fn"], p[f"hc_{site}_base"], p[f"hc_{site}_scale"], block.hc, block.norm_eps,
                  block.hc_eps, block.hc_iters)


def _attention_input(self: Block, streams: torch.Tensor, pre: torch.Tensor, wide: torch.Tensor | None = None
                     ) -> torch.Tensor:
    return _site_input(self, "attn_norm", self.__dict__["_fast_norms"][0], streams, pre, wide)


def _block_forward(self: Block, streams: torch.Tensor, pre: torch.Tensor, ctx,
                   image_mask: torch.Tensor | None = None, compress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    modules = self._modules  # (not self.attn etc.: Module.__getattr__ costs ~1 µs a lookup)
    attn_plain, ffn_plain = self.__dict__["_fast_norms"]
    wide = _wide(streams)
    a_pre, a_post, a_comb = _mix(self, "attn", streams if wide is None else wide)
    y = modules["attn"](_site_input(self, "attn_norm", attn_plain, streams, pre, wide), ctx, compress=compress)
    streams = expand(streams, y, a_post, a_comb, wide)
    wide = _wide(streams)
    f_pre, f_post, f_comb = _mix(self, "ffn", streams if wide is None else wide)
    y = modules["ffn"](_site_input(self, "ffn_norm", ffn_plain, streams, a_pre, wide), image_mask)
    return expand(streams, y, f_post, f_comb, wide), f_pre


# ------------------------------------------------------------------------------------------- Transformer
_ONE_HOT: dict = {}  # (hc, dtype, device) -> the first block's ``pre`` of one token [hc]: 1, 0, ..., 0


def embed_streams(self: Transformer, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                  images: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``Transformer.embed_streams`` of text tokens through a plain ``nn.Embedding`` (no ``max_norm``): the same
    values in three torch ops instead of five (rows by ``index_select``, one copy into the hc streams, ``pre`` a
    copy of a kept one-hot row; a decode step's embedding cost ~0.1 ms, issue 25). Images, a hooked or other
    embedding module, a global module hook, or gradients (``padding_idx`` shapes the embedding's) run the
    reference."""
    embed = self._modules["embed"]
    if (images or torch.is_grad_enabled() or not plain(embed, torch.nn.Embedding) or embed.max_norm is not None
            or global_hooks()):
        return Transformer.embed_streams(self, input_ids, token_types, images)
    weight = embed._parameters["weight"]
    (B, T), D, hc = input_ids.shape, weight.shape[1], self.config.hc_mult
    streams = weight.index_select(0, input_ids.reshape(-1)).view(B, T, 1, D).expand(B, T, hc, D).contiguous()
    dtype = upcast(weight).dtype
    key = (hc, dtype, weight.device)
    one_hot = _ONE_HOT.get(key)
    if one_hot is None:
        one_hot = _ONE_HOT[key] = torch.zeros(hc, dtype=dtype, device=weight.device)
        one_hot[0] = 1.0
    return streams, one_hot.expand(B, T, hc).contiguous()


def lm_head(self: Transformer, x: torch.Tensor) -> torch.Tensor:
    """``Transformer.lm_head``: the GEMV kernel for a few tokens of a plain head (see the module docstring)."""
    head = self._modules["head"]
    if plain(head, LMHead):  # a vocab-parallel head (issue 28) or a hooked one is called as a module
        weight = head._parameters["weight"]
        if few_token_gemv(x, weight):
            return kernels.linear(x, weight)
    return Transformer.lm_head(self, x)
