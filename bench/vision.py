"""Vision benchmark: image encode time by grid size, and the TTFT of an image request with and without an
encoder-cache hit (issue 27; VISION_DESIGN.md decision 5).

Two tables, from one process and one model:

1. **Encode**: for each image size (``--sizes``, pixels ``WxH``), the preprocessing time (Pillow resize + pad +
   normalise + patchify: :func:`deepseek_v41.engine.multimodal.process_images`) and the vision tower + aligner time
   (:func:`deepseek_v41.model.vision.encode_images`, one image) with the grid it gets (ViT patches, LLM tokens,
   prompt positions of the span). Medians over ``--rounds``, after one warm-up.
2. **TTFT**: one greedy token for a chat prompt holding one image (``--ttft-size``), wall time of ``LLM.generate``
   (preprocessing, the encode when needed, the prefill and the first token), with the prefix cache **off** so every
   request prefills its whole prompt; three arms take turns each round (the order rotated): *image, cache miss* (a
   new image each round: one pixel changed, so a new content hash), *image, cache hit* (the same image every round,
   encoded once before the rounds: its aligner rows come from the encoder cache) and *text only* (a text prompt of
   the same length: the cost without any vision work). The encoder cache's hit / miss counters over the rounds are
   printed too, so the arms are seen to do what they say.

``--model`` defaults to ``checkpoints/v41-tiny-vl`` (the tiny trained VLM). When that default is missing, the
benchmark says so and runs a random-weight VLM of the same shapes instead (``checkpoints/v41-tiny`` plus a vision
tower of width 96, 3 layers, 4 heads, 64 image tokens): timings depend on shapes, not on weights. A ``--model``
given and missing is an error.

    python bench/vision.py [--model checkpoints/v41-tiny-vl] [--sizes 42x42 126x126 252x252] [--rounds 5]
        [--ttft-size 252x84] [--dtype float32] [--device cpu] [--save-json vision.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "checkpoints" / "v41-tiny-vl"
FALLBACK_TEXT_MODEL = ROOT / "checkpoints" / "v41-tiny"
DEFAULT_SIZES = ["42x42", "126x42", "126x126", "252x126", "252x252"]
PROMPT = "Transcribe the text."
ARMS = ("image, cache miss", "image, cache hit", "text only")


def parse_size(text: str) -> tuple[int, int]:
    """``"WxH"`` -> (W, H) pixels, both >= 1; ValueError otherwise."""
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"{text!r} is not an image size WxH in pixels (e.g. 252x84)")
    return int(match[1]), int(match[2])


def render(size: tuple[int, int], text: str, seed: int):
    """A white image of ``size`` with ``text`` drawn in black (Pillow's default font) and a seeded pixel of noise."""
    import random

    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((4, max(0, size[1] // 2 - 6)), text, fill="black")
    rng = random.Random(seed)
    image.putpixel((rng.randrange(size[0]), rng.randrange(size[1])), (rng.randrange(256),) * 3)
    return image


def load(model: Path | None, dtype: str, device: str):
    """(LLM with the prefix cache off, what was loaded). ``model`` None: the random-weight fallback VLM."""
    import torch

    from deepseek_v41.config import ModelConfig, VisionConfig
    from deepseek_v41.engine import LLM
    from deepseek_v41.model.transformer import Transformer

    args = dict(dtype=dtype, device=device, max_num_seqs=2, enable_prefix_caching=False)
    if model is not None:
        return LLM(model, **args), str(model)
    vision = VisionConfig(num_hidden_layers=3, hidden_size=96, num_attention_heads=4, intermediate_size=192,
                          max_image_tokens=64, min_pixels=42 * 42)
    config = ModelConfig.from_pretrained(FALLBACK_TEXT_MODEL).replace(vision_config=vision)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:  # a folder, so LLM loads it as a checkpoint (tokenizer, Engram map)
        Transformer(config).save_pretrained(folder)
        shutil.copy(FALLBACK_TEXT_MODEL / "tokenizer.json", folder)
        llm = LLM(folder, **args)
    return llm, f"random VLM ({FALLBACK_TEXT_MODEL.name} + ViT 96x3)"


def time_encode(llm, sizes: list[tuple[int, int]], rounds: int) -> list[dict]:
    """Table 1 (module docstring): per size, the grid and the median preprocess / encode milliseconds."""
    import torch

    from deepseek_v41.engine.multimodal import process_images
    from deepseek_v41.model.vision import encode_images

    model, vision = llm.engine.model, llm.engine.config.vision_config
    rows = []
    for size in sizes:
        image = render(size, "HELLO", 0)
        prep, enc = [], []
        for r in range(rounds + 1):  # round 0 warms up
            start = time.perf_counter()
            (processed,) = process_images([image], vision)
            middle = time.perf_counter()
            with torch.inference_mode():
                (encoded,) = encode_images(model, [processed])
            if encoded.is_cuda:
                torch.cuda.synchronize()
            end = time.perf_counter()
            if r:
                prep.append((middle - start) * 1e3)
                enc.append((end - middle) * 1e3)
        g = processed.grid
        rows.append({"size": f"{size[0]}x{size[1]}", "vit_patches": g.n_vit_h * g.n_vit_w,
                     "llm_grid": f"{g.n_llm_w}x{g.n_llm_h}", "span": g.span_length,
                     "preprocess_ms": statistics.median(prep), "encode_ms": statistics.median(enc)})
    return rows


def time_ttft(llm, size: tuple[int, int], rounds: int) -> tuple[dict, dict]:
    """Table 2 (module docstring): per arm the prompt positions and the wall-time TTFTs of every round, and the
    encoder cache's hits / misses over the rounds."""
    from deepseek_v41.chat import render_messages
    from deepseek_v41.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt, _ = render_messages([{"role": "user", "content": [{"type": "image_pil", "image_pil": render(size, "x", 0)},
                                                              {"type": "text", "text": PROMPT}]}])
    _, ids, _ = llm.prompt_inputs({"prompt": prompt, "multi_modal_data": {"image": [render(size, "x", 0)]}},
                                  add_special_tokens=False)
    vision = llm.engine.config.vision_config
    from deepseek_v41.engine.multimodal import process_images

    span = process_images([render(size, "x", 0)], vision)[0].grid.span_length
    text_ids = [i for i in ids if i != llm.engine.config.image_token_id]
    filler = text_ids[1:2] or [3]
    text_prompt = text_ids[:1] + filler * (len(ids) - 1 + span - len(text_ids)) + text_ids[1:]
    same = render(size, "HELLO", 0)

    def run(arm: str, r: int) -> tuple[float, int]:
        if arm == "text only":
            request = {"prompt_token_ids": text_prompt}
        else:
            image = same if arm == "image, cache hit" else render(size, "HELLO", 1000 + r)
            request = {"prompt": prompt, "multi_modal_data": {"image": [image]}}
        start = time.perf_counter()
        (out,) = llm.generate(request, params, use_tqdm=False, add_special_tokens=False)
        return (time.perf_counter() - start) * 1e3, len(out.prompt_token_ids)

    for arm in ARMS:  # warm-up; it also puts the "hit" image into the encoder cache
        run(arm, -1)
    before = dict(llm.stats["encoder_cache"])
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    positions: dict[str, int] = {}
    for r in range(rounds):
        order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
        for arm in order:
            ms, n = run(arm, r)
            times[arm].append(ms)
            positions[arm] = n
    after = llm.stats["encoder_cache"]
    counters = {key: after[key] - before[key] for key in ("hits", "misses")}
    return {arm: {"prompt_positions": positions[arm], "ttft_ms": times[arm]} for arm in ARMS}, counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help=f"a VLM folder (default {DEFAULT_MODEL})")
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="image sizes WxH (pixels) to encode")
    parser.add_argument("--ttft-size", default="252x84", help="image size WxH of the TTFT requests")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (medians are printed)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--save-json", type=Path, default=None, help="also write the numbers as JSON here")
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes]
        ttft_size = parse_size(args.ttft_size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"error: --rounds {args.rounds}: must be >= 1", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        if (DEFAULT_MODEL / "config.json").is_file():
            model = DEFAULT_MODEL
        else:
            print(f"note: {DEFAULT_MODEL} is missing; timing a random-weight VLM of the same shapes instead "
                  f"(timings depend on shapes, not weights)", file=sys.stderr)
    elif not (model / "config.json").is_file():
        print(f"error: no model at {model} (config.json missing)", file=sys.stderr)
        return 2
    import torch

    llm, what = load(model, args.dtype, args.device)
    if llm.engine.config.vision_config is None:
        print(f"error: {model} has no vision tower (no vision_config in its config.json)", file=sys.stderr)
        return 2
    vision = llm.engine.config.vision_config
    print(f"model {what}: ViT width {vision.hidden_size} x {vision.num_hidden_layers} layers, patch "
          f"{vision.patch_size}, max {vision.max_image_tokens} image tokens; {args.dtype} on {args.device}, torch "
          f"threads {torch.get_num_threads()}; medians of {args.rounds} rounds")
    encode = time_encode(llm, sizes, args.rounds)
    print(f"\n{'image px':>9} {'ViT patches':>11} {'LLM grid':>8} {'span':>5} {'preprocess ms':>13} "
          f"{'encode ms':>9}")
    for row in encode:
        print(f"{row['size']:>9} {row['vit_patches']:>11} {row['llm_grid']:>8} {row['span']:>5} "
              f"{row['preprocess_ms']:>13.2f} {row['encode_ms']:>9.2f}")
    ttft, counters = time_ttft(llm, ttft_size, args.rounds)
    print(f"\nTTFT (wall, 1 greedy token, prefix cache off) of a chat prompt with one {args.ttft_size} image")
    print(f"{'arm':<18} {'positions':>9} {'TTFT ms':>8} {'range ms':>15}")
    for arm, row in ttft.items():
        ms = row["ttft_ms"]
        print(f"{arm:<18} {row['prompt_positions']:>9} {statistics.median(ms):>8.1f} "
              f"{f'{min(ms):.1f}-{max(ms):.1f}':>15}")
    print(f"encoder cache over the rounds: hits {counters['hits']}, misses {counters['misses']} (expected "
          f"{args.rounds} each: one per round of the hit and the miss arm)")
    if args.save_json:
        args.save_json.write_text(json.dumps({"model": what, "dtype": args.dtype, "device": args.device,
                                              "rounds": args.rounds, "encode": encode, "ttft": ttft,
                                              "ttft_size": args.ttft_size, "encoder_cache": counters}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
