"""Whole engine runs with and without the kernels: the same greedy tokens (fp32), and close
logits (bf16).
"""


import torch
from kernel_cases import assert_close_to_scale

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels.fast.block import collapse
from deepseek_v41.model.norm import upcast


# --------------------------------------------------------------------------------------------- the engine
def test_engine_generates_the_same_greedy_tokens_with_and_without_the_kernels(calls):
    from deepseek_v41.engine import LLM, SamplingParams
    from deepseek_v41.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny_config().replace(max_position_embeddings=8192)).eval().float()
    g = torch.Generator().manual_seed(12)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (40, 37)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run():
        outs = [o.outputs[0] for o in LLM(model, max_model_len=256).generate(prompts, params)]
        logprobs = [[step[t].logprob for t, step in zip(o.token_ids, o.logprobs, strict=True)] for o in outs]
        return [o.token_ids for o in outs], torch.tensor(logprobs)

    tokens, logprobs = run()
    used = dict(calls)
    with kernels.disabled():
        want_tokens, want_logprobs = run()
    assert dict(calls) == used  # nothing more ran with the kernels off
    for name in ("window_step", "fp4_scatter", "fp4_gather", "rope", "rms_norm", "hc_mix", "hc_collapse",
                 "hc_expand", "fp4_quantize"):
        assert used.get(name, 0) > 0, name
    assert used.get("linear", 0) > 0  # GroupedLinear (wo_a); plain fp32 projections stay on ATen
    assert tokens == want_tokens and all(len(t) == 12 for t in tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-4)


def test_bf16_engine_logits_are_close_with_and_without_the_kernels(calls):
    """A bf16 model's greedy decode with the kernels, then without them forced along the same tokens (bf16 rounds
    differently in the two, and the tokens of a random model part after a few steps otherwise): each forward's
    logits are close. Measured over 8 random models: at most 0.19 of the largest logit, 0.09 on average relative
    to the logits' norm (the discrete routing and top-k picks amplify bf16's rounding); a wrong group in the
    GEMV kernel gives > 1. The unit tests above pin the precision of each kernel."""
    from deepseek_v41.engine import LLM, SamplingParams
    from deepseek_v41.model.transformer import Transformer

    torch.manual_seed(1)
    model = Transformer(tiny_config().replace(max_position_embeddings=8192)).eval().bfloat16()
    g = torch.Generator().manual_seed(14)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (20, 13)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(force: list[torch.Tensor] | None = None):
        """Tokens and the last position's logits of each forward; ``force``: each forward's tokens to pick."""
        logits = []
        llm = LLM(model, max_model_len=256)  # installs the fast backend (nothing with the kernels off)
        head = model.lm_head  # the installed LM head, or the reference one

        def spy(streams, pre):
            out = head(upcast(model.norm(collapse(streams, pre))))  # Transformer.logits with that head
            logits.append(out[:, -1].clone())
            if force is not None:
                out = out.clone()
                out[torch.arange(out.shape[0]), -1, force[len(logits) - 1]] = 1e4
            return out

        model.logits = spy
        try:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            del model.logits
        return tokens, logits

    tokens, logits = run()
    used = dict(calls)
    with kernels.disabled():
        want_tokens, want_logits = run(force=[step.argmax(-1) for step in logits])
    assert dict(calls) == used  # nothing ran with the kernels off
    for name in ("linear", "attend_few", "gate", "swiglu", "moe_bf16", "index_scores", "rms_norm", "hc_mix",
                 "hc_collapse", "hc_expand", "window_step", "fp4_gather", "fp4_scatter", "rope"):
        assert used.get(name, 0) > 0, name
    # Forwards: each prompt's prefill (its first token), then 5 batched decode steps.
    assert want_tokens == tokens and len(logits) == len(want_logits) == 2 + 5
    norms = []
    for got, want in zip(logits, want_logits, strict=True):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert_close_to_scale(got, want, 0.3)
        norms.append(((got - want).norm() / want.norm()).item())
    assert sum(norms) / len(norms) <= 0.15, norms
