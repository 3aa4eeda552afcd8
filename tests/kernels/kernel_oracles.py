"""Helpers shared by the kernel tests: perturbed tiny models, call counters, greedy engine runs."""

from __future__ import annotations

import collections

import torch

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.model.transformer import Transformer


def perturbed_models(max_position_embeddings: int | None = None) -> dict[torch.dtype, Transformer]:
    """tiny_config models in eval mode with every weight moved off its init (unit norms, zero sinks) by seeded
    noise: ``{torch.float32: model, torch.bfloat16: the same weights in bf16}``, with the fast backend installed (as
    the engine's model runner installs it: their module calls under inference mode are the engine's)."""
    cfg = tiny_config()
    if max_position_embeddings is not None:
        cfg = cfg.replace(max_position_embeddings=max_position_embeddings)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    bf16 = Transformer(cfg).eval()
    bf16.load_state_dict(model.state_dict())
    models = {torch.float32: model, torch.bfloat16: bf16.bfloat16()}
    for m in models.values():
        fast.install(m)
    return models


def count_calls(monkeypatch, *names: str) -> collections.Counter:
    """Calls of ``kernels.<name>`` for each name, counted from now on (callers look the kernels up on the module at
    each call, so the spies see every call); each name starts at 0."""
    counts = collections.Counter(dict.fromkeys(names, 0))
    for name in names:
        def spy(*args, _fn=getattr(kernels, name), _name=name, **kw):
            counts[_name] += 1
            return _fn(*args, **kw)
        monkeypatch.setattr(kernels, name, spy)
    return counts


def greedy_run(model: Transformer, requests: list[dict], max_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of each request from a fresh LLM on ``model`` (max_model_len 256) and their log-probabilities
    [requests, max_tokens]."""
    from deepseek_v41.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in LLM(model, max_model_len=256).generate(requests, params)]
    logprobs = [[step[t].logprob for t, step in zip(o.token_ids, o.logprobs, strict=True)] for o in outs]
    return [o.token_ids for o in outs], torch.tensor(logprobs)
