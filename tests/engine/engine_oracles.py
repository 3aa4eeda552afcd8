"""Oracles and comparison helpers for the engine tests: a tiny model, the exact-forward argmax loop, the
project's comparison rule, and teacher-forced engine logits."""

import contextlib

import torch

from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer


def tiny_model(dtype=torch.float64, seed=0, **changes):
    cfg = tiny_config().replace(max_position_embeddings=8192, **changes)
    torch.manual_seed(seed)
    return Transformer(cfg).eval().to(dtype)


@torch.no_grad()
def argmax_loop(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """The oracle: greedy decoding by re-running the exact forward over the whole sequence each step.
    Returns the tokens and each step's logits."""
    seq, logits = list(prompt), []
    for _ in range(steps):
        row = model(torch.tensor([seq]))[0, -1]
        logits.append(row)
        seq.append(int(row.argmax()))
    return seq[len(prompt):], logits


def assert_comparison_rule(tokens: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor],
                           logits_of, tol: float = 1e-4) -> None:
    """The project's rule for "identical tokens": greedy tokens equal up to the first step where the reference's
    top-2 logit margin is below 1e-4; from there on, logits agree within ``tol``.

    ``logits_of(step)`` returns the engine's logits at that step (for the steps after a near-tie).
    """
    for step, (tok, ref, row) in enumerate(zip(tokens, ref_tokens, ref_logits, strict=False)):
        top2 = torch.topk(row.double(), 2).values
        if (top2[0] - top2[1]).item() < 1e-4:
            for later in range(step, len(ref_logits)):
                assert (logits_of(later) - ref_logits[later]).abs().max().item() < tol, later
            return
        assert tok == ref, f"step {step}: engine {tok}, exact forward {ref}"


def engine_logits(engine, prompt: list[int], forced: list[int], multi_modal_data: dict | None = None,
                  own_threads: bool = False) -> list[torch.Tensor]:
    """Drive ``engine`` over ``prompt`` (in its own chunking; with ``multi_modal_data``, the engine's encode stage
    too) and then decode ``forced`` tokens one by one (teacher forcing); returns the logits after the prompt and
    after each forced token but the last. ``own_threads``: run on the threads an engine step would take
    (``step_threads``: the cores other processes leave free) instead of torch's defaults."""
    from deepseek_v41.engine.model_runner import step_threads

    threads = step_threads(engine.runner.device) if own_threads else contextlib.nullcontext()
    with torch.no_grad(), threads:
        return _engine_logits(engine, prompt, forced, multi_modal_data)


def _engine_logits(engine, prompt: list[int], forced: list[int], multi_modal_data: dict | None
                   ) -> list[torch.Tensor]:
    from deepseek_v41.engine import SamplingParams

    engine.add_request("forced", prompt, SamplingParams(temperature=0, max_tokens=len(forced) + 1, ignore_eos=True),
                       multi_modal_data=multi_modal_data)
    seq = engine.requests["forced"][0]
    n = len(seq.prompt_token_ids)  # (image placeholders expanded)
    out = []
    while seq.num_computed < n:
        plan = engine.scheduler.schedule()
        for s, start, end in plan.prefills:
            logits = engine.runner.prefill(s, start, end)
            s.num_computed = end
            if logits is not None:
                out.append(logits)
        if plan.decodes:  # the last prompt token of a chunked prefill may run as a one-token decode
            out.append(engine.runner.decode(plan.decodes)[0])
            seq.num_computed += 1
        if engine.vision is not None:
            engine.vision.release()
    for token in forced[:-1]:
        seq.detokenizer.output_token_ids.append(token)
        engine.scheduler.blocks.grow(seq.block_table, seq.num_computed + 1)
        out.append(engine.runner.decode([seq])[0])
        seq.num_computed += 1
    engine.abort_request("forced")
    engine.release("forced")
    return out
