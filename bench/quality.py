"""Quality of the two approximations the serving system makes, measured on held-out text (SPEC.md §4.2, §4.3).

1. **CED prefill against exact prefill**: for every held-out position t (in windows of ``--context`` tokens),
   the next-token distribution after a CED prefill of tokens [0, t] against the exact forward's: mean KL(exact ||
   CED) in nats, and the perplexity of both over the same tokens.
2. **Bounded replay against a cold run**: prompts = a held-out prefix of L tokens + a short suffix; a cold CED
   run against a hit that reuses the prefix's pages and replays only the last window (no snapshot): KL of the
   first generated token's distribution and greedy token agreement over ``--tokens`` steps.

    python bench/quality.py --model checkpoints/v41-tiny/ --data path/to/heldout.txt [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-tiny"


def ced_vs_exact(model, stream, context: int, windows: int) -> dict[str, float]:
    """Mean KL(exact || CED) per token (nats) and both perplexities over ``windows`` windows of ``context``."""
    import torch

    from deepseek_v41.train.evaluate import ced_logits

    kl_sum, nll_exact, nll_ced, count = 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            ids = torch.from_numpy(stream[w * context: (w + 1) * context + 1]).long()
            if len(ids) < context + 1:
                break
            exact = torch.log_softmax(model(ids[None, :-1])[0].double(), -1)
            ced = torch.log_softmax(ced_logits(model, ids[:-1]).double(), -1)
            targets = ids[1:]
            kl_sum += float((exact.exp() * (exact - ced)).sum(-1).sum())
            nll_exact -= float(exact.gather(-1, targets[:, None]).sum())
            nll_ced -= float(ced.gather(-1, targets[:, None]).sum())
            count += len(targets)
    return {"kl_nats_per_token": kl_sum / count, "perplexity_exact": math.exp(nll_exact / count),
            "perplexity_ced": math.exp(nll_ced / count), "tokens": count}


def replay_vs_cold(model_dir: Path, stream, lengths: list[int], tokens: int, suffix: list[int]) -> list[dict]:
    """Per prefix length: KL of the first token's distribution and greedy agreement, bounded replay vs cold."""
    import torch

    from deepseek_v41.engine import LLM, SamplingParams

    rows = []
    for n in lengths:
        prefix = stream[:n].tolist()
        prompt = prefix + suffix
        # fp32 as the README's table (LLM's default dtype is the checkpoint's, bf16 for the bundled one)
        common = dict(dtype="float32", max_model_len=n + len(suffix) + tokens + 16, max_num_batched_tokens=2048)
        cold_llm = LLM(model_dir, enable_prefix_caching=False, **common)
        # every token's logprob at every step: the KL below is over the whole vocabulary
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                logprobs=cold_llm.engine.config.vocab_size)
        cold = cold_llm.generate({"prompt_token_ids": prompt}, params)[0]
        with tempfile.TemporaryDirectory() as cache:
            LLM(model_dir, cache_dir=cache, swa_pool_bytes=0, **common).generate(
                {"prompt_token_ids": prefix}, SamplingParams(max_tokens=1))
            hit = LLM(model_dir, cache_dir=cache, swa_pool_bytes=0, **common).generate(
                {"prompt_token_ids": prompt}, params)[0]
        a, b = cold.outputs[0], hit.outputs[0]
        agree = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), tokens)
        kls = []
        for step in range(min(agree + 1, tokens)):  # same context up to and including the first divergence
            ids = sorted(a.logprobs[step])
            p = torch.tensor([a.logprobs[step][t].logprob for t in ids], dtype=torch.float64)
            q = torch.tensor([b.logprobs[step][t].logprob for t in ids], dtype=torch.float64)
            kls.append(float((p.exp() * (p - q)).sum()))
        rows.append({"prefix_tokens": n, "cached": hit.num_cached_tokens, "replayed": hit.num_replayed_tokens,
                     "first_token_kl": kls[0], "mean_kl_same_context": sum(kls) / len(kls),
                     "greedy_tokens_equal_before_divergence": agree,
                     "token_agreement": sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True)) / tokens})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--data", type=Path, required=True, help="held-out text (heldout.txt)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: no model at {args.model}", file=sys.stderr)
        return 2
    import torch
    from tokenizers import Tokenizer

    from deepseek_v41 import load_model
    from deepseek_v41.train.data import read_documents
    from deepseek_v41.train.tokenizer import encode_documents

    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    stream = encode_documents(tokenizer, read_documents(args.data))
    model = load_model(args.model)
    result = {"ced_vs_exact": ced_vs_exact(model, stream, args.context, args.windows),
              "bounded_replay_vs_cold": replay_vs_cold(args.model, stream, args.lengths, args.tokens,
                                                       stream[-9:-1].tolist())}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        c = result["ced_vs_exact"]
        print(f"CED vs exact prefill over {c['tokens']} held-out tokens: KL {c['kl_nats_per_token']:.2e} nats/token, "
              f"perplexity {c['perplexity_exact']:.3f} (exact) vs {c['perplexity_ced']:.3f} (CED)")
        for row in result["bounded_replay_vs_cold"]:
            print(f"bounded replay, {row['prefix_tokens']}-token prefix (cached {row['cached']}, replayed "
                  f"{row['replayed']}): first-token KL {row['first_token_kl']:.2e}, mean KL while the contexts agree "
                  f"{row['mean_kl_same_context']:.2e} nats, greedy equal for "
                  f"{row['greedy_tokens_equal_before_divergence']} tokens, agreement {row['token_agreement']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
