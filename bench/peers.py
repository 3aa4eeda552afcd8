"""Peer side of the engine benchmark (issue 10): the same measurements as ``bench/engine.py``, for mlx-lm and
Hugging Face transformers, each peer in its own processes (one per measurement family, so peaks do not mix).

**mlx** runs mlx-lm's ``deepseek_v41`` port on the *same* bench-8m weights: the official-format directory written
by ``engine.make_model_dir`` goes through mlx-lm's own ``load_model`` (its ``sanitize`` keeps FP8 weights packed
as mxfp8 and the routed experts as mxfp4; nothing needs adapting), on the CPU device. Batch 1 uses mlx-lm's
``generate_step`` (prefill in 2048-token chunks, then greedy decode with ``async_eval`` pipelining) and the model's
own cache (``make_prompt_cache`` -> ``Model.make_cache``). mlx-lm's batched generator cannot batch this model (its
``LayerCache`` has no ``merge``), so batch 8 runs the same loop on a ``[8, T]`` input with one shared cache:
the 8 prompts have equal length, so no padding is needed. Its fp32 logits match ours (``load_model`` of the same
directory) to float noise with fake-quant off, and to a few 1e-3 with it on (a quantized value near a rounding
boundary can flip; tests/model/test_mlx_parity.py).

**transformers** runs ``DeepseekV4ForCausalLM`` (there is no V4.1 there) at the closest config, random weights
(``torch.manual_seed(0)``, the library's init), eager attention (the only one V4 has), a manual greedy loop
with ``DynamicCache(config=...)`` as ``cache`` (it holds V4's sliding / CSA / HCA layer caches), ``logits_to_keep=1``:

==========================================  ==============================================  =======================
ours (bench-8m)                             transformers DeepseekV4Config                   differs
==========================================  ==============================================  =======================
vocab 8192, hidden 256, 8 layers            vocab_size, hidden_size, num_hidden_layers      --
4 heads x 64, 1 kv head, rope dim 16        num_attention_heads, head_dim,                  --
                                            num_key_value_heads, qk_rope_head_dim (legacy
                                            key -> partial_rotary_factor 0.25)
q_lora_rank 128, o_groups 2 x o_lora 128    q_lora_rank, o_groups, o_lora_rank              --
16 routed top-2 + 1 shared, inter 256,      n_routed_experts, num_experts_per_tok,          --
sqrtsoftplus, scale 1.5, swiglu limit 10    n_shared_experts, moe_intermediate_size, ...
no hash-routed layers                       mlp_layer_types = ["moe"] * 8                   (V4 default: 3 hash)
compress_ratios [0,2,2,2,1,1,1,1]           layer_types [sliding, HCA x3, CSA x4],          m=2 layers have no
                                            compress_rates {HCA: 2, CSA: 1}                 indexer (HCA is dense)
kv / index sources [1,3,4] / [1,3,4,6]      (none: every layer has its own compressor)      no Reuse / Reindex
candidate source 4, 32 blocks of 8          (none)                                          no candidate pool
indexer 4 x 32, top-k 64, window 128        index_n_heads, index_head_dim, index_topk,      --
                                            sliding_window
hc_mult 4, sinkhorn 20, eps 1e-6            hc_mult, hc_sinkhorn_iters, hc_eps              --
rms eps 1e-20, rope 1e4 / compress 1.6e5,   rms_norm_eps, rope_theta, compress_rope_theta,  yarn on compressed
yarn x8 (orig 4096), max pos 32768          rope_parameters, max_position_embeddings        layers only
FP8 weights, FP4 routed experts, fake-      (plain fp32 / bf16 weights, no fake-quant)      not quantized
quantized KV / index keys
==========================================  ==============================================  =======================

Measured exactly as in ``bench/engine.py`` (median of ``--repeat`` runs after a warm-up, the same random token ids
in [3, 8192) from ``random.Random(seed)``, the same seeds): ``prefill_1k_tok_s`` / ``prefill_8k_tok_s`` (time to
the first token's logits), ``decode_b1_tok_s`` / ``decode_b8_tok_s`` (64 greedy steps after 1K prompts; the first
of ``repeat + 1`` runs is the warm-up), ``decode_ms_1k`` / ``decode_ms_16k`` / ``decode_16k_over_1k`` (32 steps,
no warm-up, as in engine.py), ``prefill_8k_peak_rss_gb`` (ru_maxrss after loading the model and one 8K prefill,
minus ru_maxrss right after importing the peer library, before the model is built or loaded: engine.py's base).
transformers prefills the prompt in one forward (its ``generate`` default) except in ``long``, where it feeds
2048-token chunks through the cache (as mlx-lm does) because one 16K eager forward needs more memory than this
machine has; only decode time is measured there. A prefill in ``long`` that runs past ``--long-budget-s`` (checked
between chunks) is abandoned and its numbers are null. Notes (``note: ...``) go to stderr; the last stdout line is
one JSON object with engine.py's keys for the families run.

    python bench/peers.py --peer mlx|transformers [--dtype fp32|bf16] [--repeat 3] [--threads N]
                          [--only prefill,decode,long,rss] [--model-dir DIR] [--long-budget-s 300]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engine import FAMILIES, make_model_dir, parse_families  # noqa: E402  (bench/engine.py: stdlib-only at import)

REQUIRES = {"mlx": ("mlx", "mlx_lm"), "transformers": ("torch", "transformers")}
CHUNK = 2048  # prefill chunk in ``long`` (mlx-lm's default prefill_step_size)


class OverBudget(Exception):
    pass


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


class MlxPeer:
    """mlx-lm's deepseek_v41 on the saved bench-8m directory, CPU."""

    batched = True

    def __init__(self):
        import mlx.core as mx

        mx.set_default_device(mx.cpu)  # before mlx_lm.generate makes its stream on the default device
        import mlx_lm.models.deepseek_v41  # noqa: F401  (the port must exist)
        from mlx_lm.generate import generate_step, generation_stream
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model

        self.mx, self.generate_step, self.stream = mx, generate_step, generation_stream
        self.make_cache, self.load_model = make_prompt_cache, load_model

    def load(self, model_dir: Path, dtype: str) -> None:
        from mlx.utils import tree_flatten

        mx = self.mx
        self.model, _ = self.load_model(Path(model_dir))
        if dtype == "bf16":  # as mlx_lm.convert casts: floats not kept in fp32 by the port's cast_predicate
            keep = getattr(self.model, "cast_predicate", lambda key: True)
            self.model.load_weights([(k, v.astype(mx.bfloat16)) for k, v in tree_flatten(self.model.parameters())
                                     if mx.issubdtype(v.dtype, mx.floating) and keep(k)], strict=False)
            mx.eval(self.model.parameters())

    def generate(self, prompts: list[list[int]], steps: int, chunk: int | None = None,
                 budget_s: float | None = None) -> tuple[float, float, float]:
        """(start, first token, last token) times of a greedy run of ``steps`` tokens after the first."""
        mx = self.mx
        start = time.perf_counter()

        def progress(done: int, total: int) -> None:
            if budget_s is not None and time.perf_counter() - start > budget_s:
                raise OverBudget

        if len(prompts) == 1:
            first = last = None
            gen = self.generate_step(mx.array(prompts[0]), self.model, max_tokens=steps + 1,
                                     prompt_cache=self.make_cache(self.model), prompt_progress_callback=progress)
            try:
                for _ in gen:
                    last = time.perf_counter()
                    first = first or last
            finally:
                gen.close()
                mx.synchronize(self.stream)  # the pipelined next step may still be running
            return start, first, last
        return self._batched(prompts, steps, start)

    def _batched(self, prompts: list[list[int]], steps: int, start: float) -> tuple[float, float, float]:
        """generate_step's loop on a [B, T] input (equal-length prompts share one cache)."""
        mx, model = self.mx, self.model
        cache = self.make_cache(model)
        x = mx.array(prompts)

        def step(tokens):
            return mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)

        with mx.stream(self.stream):
            while x.shape[1] > 1:
                n = min(CHUNK, x.shape[1] - 1)
                model(x[:, :n], cache=cache)
                mx.eval([c.state for c in cache])
                x = x[:, n:]
                mx.clear_cache()
            y = step(x)
            mx.async_eval(y)
            mx.eval(y)
            first = last = time.perf_counter()
            for _ in range(steps):
                next_y = step(y[:, None])
                mx.async_eval(next_y)
                y.tolist()
                y = next_y
            y.tolist()
            last = time.perf_counter()
        return start, first, last


def hf_config() -> dict:
    """bench-8m in DeepseekV4Config's keys (see the table in the module docstring)."""
    return dict(
        vocab_size=8192, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=128, moe_intermediate_size=256,
        n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, scoring_func="sqrtsoftplus",
        norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, mlp_layer_types=["moe"] * 8,
        layer_types=["sliding_attention"] + ["heavily_compressed_attention"] * 3
        + ["compressed_sparse_attention"] * 4,
        compress_rates={"heavily_compressed_attention": 2, "compressed_sparse_attention": 1},
        sliding_window=128, index_n_heads=4, index_head_dim=32, index_topk=64, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, rms_norm_eps=1e-20, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096},
        max_position_embeddings=32768, num_nextn_predict_layers=0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )


class TransformersPeer:
    """transformers' DeepseekV4ForCausalLM at the closest config, random weights, eager attention."""

    batched = True

    def __init__(self):
        import torch
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache

        self.torch, self.config_cls, self.model_cls, self.cache_cls = (torch, DeepseekV4Config,
                                                                      DeepseekV4ForCausalLM, DynamicCache)

    def load(self, model_dir: Path | None, dtype: str) -> None:
        torch = self.torch
        torch.manual_seed(0)
        config = self.config_cls(**hf_config(), attn_implementation="eager")
        self.model = self.model_cls(config).eval()
        if dtype == "bf16":  # all but the modules the library keeps in fp32
            keep = self.model._keep_in_fp32_modules_strict
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if not any(k in name for k in keep):
                        p.data = p.data.to(torch.bfloat16)

    def generate(self, prompts: list[list[int]], steps: int, chunk: int | None = None,
                 budget_s: float | None = None) -> tuple[float, float, float]:
        torch, model = self.torch, self.model
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            start = time.perf_counter()
            cache = self.cache_cls(config=model.config)
            for s in range(0, ids.shape[1], chunk or ids.shape[1]):
                logits = model(ids[:, s:s + (chunk or ids.shape[1])], cache=cache, use_cache=True,
                               logits_to_keep=1).logits
                if budget_s is not None and time.perf_counter() - start > budget_s:
                    raise OverBudget
            y = logits[:, -1].argmax(-1, keepdim=True)
            y.tolist()
            first = time.perf_counter()
            for _ in range(steps):
                y = model(y, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, True)
                y.tolist()
            last = time.perf_counter()
        return start, first, last


PEERS = {"mlx": MlxPeer, "transformers": TransformersPeer}


def measure(peer_name: str, model_dir: Path | None, what: str, dtype: str, repeat: int,
            budget_s: float) -> dict[str, float | None]:
    """One family of measurements in this process (definitions as in engine.measure)."""
    import resource

    peer = PEERS[peer_name]()  # the imports
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peer.load(model_dir, dtype)
    out: dict[str, float | None] = {}
    if what == "prefill":
        for n, key in ((1024, "prefill_1k_tok_s"), (8192, "prefill_8k_tok_s")):
            peer.generate([_ids(n, 0)], 0)  # warm-up
            times = []
            for r in range(repeat):
                start, first, _ = peer.generate([_ids(n, r + 1)], 0)
                times.append(first - start)
            out[key] = n / statistics.median(times)
    elif what == "decode":
        steps = 64
        for batch, key in ((1, "decode_b1_tok_s"), (8, "decode_b8_tok_s")):
            if batch > 1 and not peer.batched:
                _note(f"{peer_name} has no batched decode: {key} is null")
                out[key] = None
                continue
            rates = []
            for r in range(repeat + 1):
                _, first, last = peer.generate([_ids(1024, 100 * r + b) for b in range(batch)], steps)
                rates.append(batch * steps / (last - first))
            out[key] = statistics.median(rates[1:])
    elif what == "long":
        steps = 32
        per_token: dict[int, float | None] = {}
        for n in (1024, 16384):
            times = []
            for r in range(repeat):
                try:
                    _, first, last = peer.generate([_ids(n, r)], steps, chunk=CHUNK, budget_s=budget_s)
                except OverBudget:
                    _note(f"{peer_name}: the {n}-token prefill ran past --long-budget-s {budget_s:g}: skipped")
                    break
                times.append((last - first) / steps)
            per_token[n] = statistics.median(times) if times else None
        ms = {n: None if t is None else t * 1e3 for n, t in per_token.items()}
        out["decode_ms_1k"], out["decode_ms_16k"] = ms[1024], ms[16384]
        out["decode_16k_over_1k"] = None if None in ms.values() else ms[16384] / ms[1024]
    elif what == "rss":
        peer.generate([_ids(8192, 0)], 0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["prefill_8k_peak_rss_gb"] = (peak - base) * 1024 / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", choices=sorted(PEERS), required=True)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads [default: the library's]")
    parser.add_argument("--only", default=",".join(FAMILIES))
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved bench model (mlx)")
    parser.add_argument("--long-budget-s", type=float, default=300.0, help="time-box of one prefill in 'long'")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    families = parse_families(parser, args.only)
    if args.child:
        try:
            if args.threads and args.peer == "transformers":
                import torch

                torch.set_num_threads(args.threads)
            result = measure(args.peer, args.model_dir, args.child, args.dtype, args.repeat, args.long_budget_s)
        except ImportError as exc:
            print(f"peers.py: {args.peer} peer unavailable: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(result))
        return 0
    if missing := [m for m in REQUIRES[args.peer] if importlib.util.find_spec(m) is None]:
        print(f"peers.py: {args.peer} peer needs {', '.join(missing)} (not installed)", file=sys.stderr)
        return 2
    if args.model_dir is None and args.peer == "mlx":  # a temporary bench model, removed afterwards
        with tempfile.TemporaryDirectory(prefix="dsv41-bench8m-") as tmp:
            return _run_families(args, families, make_model_dir(Path(tmp)))
    return _run_families(args, families, args.model_dir)


def _run_families(args: argparse.Namespace, families: list[str], model_dir: Path | None) -> int:
    """Each family in its own child process; print the table and the JSON line (see :func:`main`)."""
    env = dict(os.environ)
    if args.threads:
        env.update({k: str(args.threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    results: dict[str, float | None] = {}
    notes: list[str] = []
    for what in families:
        command = [sys.executable, __file__, "--child", what, "--peer", args.peer, "--dtype", args.dtype,
                   "--repeat", str(args.repeat), "--long-budget-s", str(args.long_budget_s)]
        command += (["--model-dir", str(model_dir)] if model_dir else []) + (
            ["--threads", str(args.threads)] if args.threads else [])
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            print(lines[-1] if done.returncode == 2 and lines else done.stderr, file=sys.stderr)
            return done.returncode
        notes += [line[len("note: "):] for line in done.stderr.splitlines() if line.startswith("note: ")]
        results.update(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"peer {args.peer}, bench-8m, {args.dtype}, threads={args.threads or 'default'}, median of {args.repeat}")
    for key, value in results.items():
        print(f"{key:<28}{'null' if value is None else f'{value:.2f}':>12}")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
