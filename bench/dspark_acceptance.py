"""DSpark draft acceptance in the engine: mean accepted length and acceptance per draft position, greedy.

Runs greedy requests on held-out prompts through ``LLM(speculative="dspark", speculative_cost_table="fixed")`` (every
step verifies the whole block, so every position is measured) at each batch size, and prints from the engine's
``spec_decode_*`` counters (vLLM's SpecDecodingStats):

- the mean accepted length: accepted drafts + the bonus token per verify step;
- the acceptance per position j as vLLM reports it: accepted / verified drafts at position j (every step
  verifies every position here, so this is the share of steps whose prefix survives through draft j);
- the conditional acceptance per position: P(draft j accepted | drafts 1..j-1 accepted), what DSPARK.md §3.4's
  confidence estimates;
- whether the greedy tokens equal plain decoding's (``--check``).

``--block-size`` runs the checkpoint's draft at another ``dspark_block_size`` (a temporary model folder with the
config changed and the other files linked): the draft's weights do not depend on the block size.

    python bench/dspark_acceptance.py --model checkpoints/v41-tiny --text data/heldout.txt
        [--prompts 16] [--prompt-tokens 128] [--max-tokens 64] [--batch-sizes 1 8] [--block-size 5] [--json out]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-tiny"


def heldout_prompts(tokenizer, text: Path, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids: evenly spaced slices of the tokenized ``text``."""
    ids = tokenizer.encode(text.read_text(encoding="utf-8"), add_special_tokens=False).ids
    if len(ids) < length * count:
        raise ValueError(f"{text} has {len(ids)} tokens, fewer than {count} prompts of {length}")
    step = (len(ids) - length) // count
    return [ids[i * step: i * step + length] for i in range(count)]


def with_block_size(model: Path, block_size: int, workdir: Path) -> Path:
    """A model folder in ``workdir`` that links every file of ``model`` but has ``dspark_block_size`` =
    ``block_size`` in its config.json."""
    out = workdir / f"{model.name}-k{block_size}"
    out.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        if item.is_file() and item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((model / "config.json").read_text())
    (config.get("text_config") or config)["dspark_block_size"] = block_size
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def measure(model: Path, prompts: list[list[int]], batch: int, max_tokens: int, dtype: str, speculative: bool,
            temperature: float = 0.0):
    """Outputs of ``prompts`` run ``batch`` at a time (greedy, or sampled at ``temperature`` with seeds 0..N-1),
    and the engine's spec counters over them."""
    from deepseek_v41.engine import LLM, SamplingParams

    args = {"speculative": "dspark", "speculative_cost_table": "fixed"} if speculative else {}
    llm = LLM(model, dtype=dtype, max_num_seqs=max(8, batch), **args)
    before = dict(llm.stats)
    tokens = []
    for i in range(0, len(prompts), batch):
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i + j)
                  for j in range(len(prompts[i:i + batch]))]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
    stats = llm.stats
    if not speculative:
        return tokens, None
    accepted = [a - b for a, b in zip(stats["spec_decode_num_accepted_tokens_per_pos"],
                                      before["spec_decode_num_accepted_tokens_per_pos"], strict=True)]
    verified = [a - b for a, b in zip(stats["spec_decode_num_verified_tokens_per_pos"],
                                      before["spec_decode_num_verified_tokens_per_pos"], strict=True)]
    drafts = stats["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    reached = [drafts, *accepted[:-1]]
    return tokens, {"drafts": drafts, "mean_accepted_length": 1 + sum(accepted) / max(1, drafts),
                    "acceptance_per_position": [a / v if v else 0.0 for a, v in zip(accepted, verified, strict=True)],
                    "conditional_acceptance_per_position": [a / r if r else 0.0
                                                            for a, r in zip(accepted, reached, strict=True)],
                    "accepted_per_position": accepted, "verified_per_position": verified}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, required=True, help="held-out text to take prompts from")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--block-size", type=int, default=None, help="run the draft at this dspark_block_size")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampled")
    parser.add_argument("--check", action="store_true", help="also compare with plain greedy decoding")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: no model at {args.model} (config.json missing)", file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    prompts = heldout_prompts(tokenizer, args.text, args.prompts, args.prompt_tokens)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model if args.block_size is None else with_block_size(args.model, args.block_size, Path(tmp))
        block = json.loads((model / "config.json").read_text())
        block = (block.get("text_config") or block)["dspark_block_size"]
        mode = "greedy" if args.temperature <= 0 else f"temperature {args.temperature}"
        print(f"model {args.model}, dspark_block_size {block}, {len(prompts)} held-out prompts of "
              f"{args.prompt_tokens} tokens, {args.max_tokens} tokens each ({mode}), full block verified")
        check = args.check and args.temperature <= 0
        plain = measure(model, prompts, 8, args.max_tokens, args.dtype, False)[0] if check else None
        for batch in args.batch_sizes:
            tokens, stats = measure(model, prompts, batch, args.max_tokens, args.dtype, True, args.temperature)
            same = None if plain is None else sum(t == p for t, p in zip(tokens, plain, strict=True))
            per = " ".join(f"{a:.3f}" for a in stats["acceptance_per_position"])
            cond = " ".join(f"{a:.3f}" for a in stats["conditional_acceptance_per_position"])
            print(f"batch {batch}: mean accepted length {stats['mean_accepted_length']:.3f} over "
                  f"{stats['drafts']} steps; acceptance per position [{per}], conditional [{cond}]"
                  + ("" if same is None else f"; {same}/{len(tokens)} outputs equal plain greedy"), flush=True)
            results.append({"batch": batch, "block_size": block, "temperature": args.temperature, **stats,
                            "equal_plain": same})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
