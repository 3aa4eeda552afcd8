"""``dsv41 report``: the paper's numbers computed from the code (SPEC.md §1.5, §5).

:func:`build_report` returns a nested dict (the ``--json`` output); :func:`print_report` renders it as tables;
:func:`plot_report` writes the plots. Sections: ``kv``, ``params``, ``memory``, ``flops`` and, for a model with a
vision tower, ``vision`` (its parameters by part and FLOPs per image, :mod:`deepseek_v41.analysis.vision`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepseek_v41.analysis.flops import DECODE_CONTEXTS, flops_runs, flops_section
from deepseek_v41.analysis.kv import generations_bytes_per_token
from deepseek_v41.analysis.params import build_on_meta, count_params, loaded_bytes
from deepseek_v41.analysis.vision import vision_section
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.layout import KVLayout
from deepseek_v41.config import ModelConfig
from deepseek_v41.plan import build_layer_plan
from deepseek_v41.progress import ProgressCallback


def kv_section(cfg: ModelConfig) -> dict[str, Any]:
    """KV bytes of ``cfg`` (units: bytes) and the generations table.

    ``persistent_bytes_per_token`` follows SPEC.md §4.3: the persistent store keeps global KV only; V4 kept
    window KV worth about as much as its global KV, so its persistent footprint is 2 x its global KV.
    """
    layout = KVLayout.from_config(cfg)
    generations = generations_bytes_per_token(cfg)
    v4 = generations["deepseek-v4-flash"]
    persistent = layout.global_bytes_per_token
    return {
        "main_entry_bytes": layout.main_entry_bytes,
        "index_entry_bytes": layout.index_entry_bytes,
        "window_row_bytes": layout.window_row_bytes,
        "entries_per_token": float(layout.entries_per_token),
        "global_bytes_per_token": layout.global_bytes_per_token,
        "window_bytes_per_sequence": layout.window_bytes_per_sequence,
        "dspark_window_bytes_per_sequence": layout.dspark_window_bytes_per_sequence,
        "persistent_bytes_per_token": persistent,
        "persistent_bytes_per_token_v4": 2 * v4,
        "persistent_ratio_vs_v4": persistent / (2 * v4),
        "generations": generations,
    }


def params_section(model) -> tuple[dict[str, int], dict[str, int]]:
    """Parameter counts (``params``) and loaded sizes in bytes (``memory``) of a model built on ``meta``."""
    return count_params(model), {"loaded_bytes_bf16": loaded_bytes(model, 2),
                                 "loaded_bytes_fp32": loaded_bytes(model, 4)}


def build_report(cfg: ModelConfig, name: str = "", flops: bool = True,
                 progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Everything ``dsv41 report`` prints, as a JSON-ready dict (``flops=False`` skips the FLOPs runs).

    ``progress(done, total, what)`` is called with increasing ``done`` before each step (building the model on
    meta, then each FLOPs run: together most of the command's time) and once at the end.
    """
    def report_step(done: int, total: int, what: str = "") -> None:
        if progress is not None:
            progress(done, total, what)

    plan = build_layer_plan(cfg)
    report_step(0, 1, "building the model on meta")
    model = build_on_meta(cfg)
    vision_run = flops and cfg.vision_config is not None
    total = 1 + (len(flops_runs(model)) if flops else 0) + vision_run  # the build, then each FLOPs run
    report_step(1, total, "counting parameters and KV bytes")
    params, memory = params_section(model)
    kv = kv_section(cfg)
    # The engine's own pool tensors, built on meta: the allocated global KV per token is a reading, not a formula.
    kv["allocated_bytes_per_token"] = PagedKVCache(cfg, 1025, 16, 1, 16, "meta").allocated_bytes_per_token
    report = {
        "config": name,
        "layers": {"num_hidden_layers": cfg.num_hidden_layers, "ced": plan.ced, "ced_reason": plan.ced_reason,
                   "roles": {s.layer_id: s.role.value for s in plan.layers}},
        "kv": kv,
        "params": params,
        "memory": memory,
    }
    if cfg.vision_config is not None and not flops:
        report["vision"] = vision_section(cfg, flops=False)
    if flops:
        report["flops"] = flops_section(model, progress=lambda done, _, what="": report_step(
            1 + done, total, what and f"FLOPs, {what}"))
    if vision_run:
        report_step(total - 1, total, "FLOPs, vision tower per image")
        report["vision"] = vision_section(cfg, flops=True)
    report_step(total, total)
    return report


def print_report(report: dict[str, Any]) -> None:
    """Human-readable tables of ``report`` on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    kv = report["kv"]
    console.print(f"[bold]DeepSeek-V4.1 report[/bold] — config {report['config']}, "
                  f"{report['layers']['num_hidden_layers']} layers, {report['layers']['ced_reason']}")
    table = Table(title="KV cache layout (bytes)")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("main compressed entry (FP4 + E4M3 / 16)", kv["main_entry_bytes"]),
        ("index key entry (FP4 + UE8M0 / 32)", kv["index_entry_bytes"]),
        ("window row (FP8 + UE8M0 / 32)", kv["window_row_bytes"]),
        ("compressed entries per token", kv["entries_per_token"]),
        ("global KV per token", kv["global_bytes_per_token"]),
        ("global KV per token, measured on the engine's pool tensors", kv["allocated_bytes_per_token"]),
        ("window KV per sequence (backbone)", kv["window_bytes_per_sequence"]),
        ("window KV per sequence (DSpark draft)", kv["dspark_window_bytes_per_sequence"]),
        ("persistent bytes per token (global KV only)", kv["persistent_bytes_per_token"]),
        ("persistent ratio vs V4 (global + window)", f"1/{1 / kv['persistent_ratio_vs_v4']:.1f}"),
    ]
    for label, value in rows:
        table.add_row(label, f"{value:,}" if isinstance(value, int | float) else str(value))
    console.print(table)
    gens = Table(title="Global KV bytes per token by generation")
    gens.add_column("model")
    gens.add_column("bytes / token", justify="right")
    gens.add_column("x V4.1", justify="right")
    ours = kv["generations"]["deepseek-v4.1-flash"]
    for model, value in kv["generations"].items():
        gens.add_row(model, f"{value:,.2f}", f"{value / ours:,.1f}")
    console.print(gens)
    params = Table(title="Parameters (counted from the modules built on meta)")
    params.add_column("group")
    params.add_column("parameters", justify="right")
    for key, label in (("backbone", "backbone"), ("engram", "Engram tables"), ("dspark", "DSpark draft"),
                       ("vision", "vision tower + aligner"), ("total", "total stored"),
                       ("active_prefill", "active per prefill token (CED)"),
                       ("active_decode", "active per decode token")):
        params.add_row(label, _human(report["params"][key]))
    for key, label in (("loaded_bytes_bf16", "memory as loaded, bf16 (Engram tables FP8)"),
                       ("loaded_bytes_fp32", "memory as loaded, fp32 (Engram tables FP8)")):
        params.add_row(label, _human(report["memory"][key], "B"))
    console.print(params)
    if "flops" in report:
        flops = report["flops"]
        table = Table(title="FLOPs per token (matmuls of the real modules on meta; BF16 1, FP8 0.5, FP4 0.25)")
        table.add_column("")
        table.add_column("weighted", justify="right")
        table.add_column("unweighted", justify="right")
        for label, value in flops["decode_per_token"].items():
            unweighted = flops["decode_per_token_unweighted"][label]
            table.add_row(f"decode at {label} context", _human(value), _human(unweighted))
        for mode, value in flops["prefill_per_token"].items():
            table.add_row(f"prefill, {flops['prefill_prompt_tokens']:,}-token prompt, {mode}", _human(value),
                          _human(flops["prefill_per_token_unweighted"][mode]))
        console.print(table)
        growth = next(v for k, v in flops.items() if k.startswith("decode_growth_"))
        console.print(f"decode FLOPs growth from the shortest to the longest context: {growth:+.1%} (weighted)")
    if report.get("vision"):
        _print_vision(console, report["vision"])


def _print_vision(console, vision: dict[str, Any]) -> None:
    """The ``vision`` block: parameters by part, then FLOPs per image by grid."""
    from rich.table import Table

    params = Table(title="Vision tower parameters (counted from the modules built on meta)")
    params.add_column("part")
    params.add_column("parameters", justify="right")
    for key, label in (("patch_embed", "patch embedding"), ("blocks", "ViT blocks"), ("per_block", "  one block"),
                       ("norm", "final norm"), ("aligner", "aligner (3x3 merge MLP)"),
                       ("delimiters", "image_start / newline / end"), ("total", "total")):
        params.add_row(label, f"{vision['params'][key]:,}")
    console.print(params)
    if "flops_per_image" not in vision:
        return
    table = Table(title="Vision FLOPs per image (matmuls of the real modules on meta, BF16)")
    table.add_column("")
    grids = vision["flops_per_image"]
    for name, entry in grids.items():
        table.add_column(f"{name}\n{'x'.join(map(str, entry['vit_grid']))} patches", justify="right")
    table.add_row("LLM tokens", *("x".join(map(str, e["llm_grid"])) for e in grids.values()))
    table.add_row("span positions", *(f"{e['span_tokens']:,}" for e in grids.values()))
    for label, keys in (("patch embedding", ("patch_embed",)), ("ViT qkv + wo", ("qkv", "wo")),
                        ("ViT attention core", ("attention_core",)), ("ViT MLP", ("mlp",)),
                        ("aligner", ("aligner",)), ("total", ("total",))):
        table.add_row(label, *(_human(sum(e["flops"][k] for k in keys)) for e in grids.values()))
    console.print(table)


def _human(value: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:,.2f}{suffix}{unit}"
    return f"{value:,}{unit}"


def plot_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the report's plots as PNG files into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gens = report["kv"]["generations"]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(list(gens), list(gens.values()), color=["#999", "#777", "#557", "#c33"])
    ax.set_yscale("log")
    ax.set_ylabel("global KV bytes per token (log scale)")
    ax.set_title("KV cache per token by DeepSeek generation")
    for bar, value in zip(bars, gens.values(), strict=True):
        ax.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    fig.tight_layout()
    paths = [out / "kv_bytes_by_generation.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    if "flops" in report:
        flops = report["flops"]
        labels = list(flops["decode_per_token"])
        x = [DECODE_CONTEXTS.get(label, i) for i, label in enumerate(labels)]
        fig, ax = plt.subplots(figsize=(7, 4))
        weighted = [flops["decode_per_token"][k] / 1e9 for k in labels]
        ax.plot(x, weighted, "o-", label="weighted (BF16 1, FP8 .5, FP4 .25)")
        ax.plot(x, [flops["decode_per_token_unweighted"][k] / 1e9 for k in labels], "s--", label="unweighted")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, labels)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode GFLOPs per token")
        ax.set_title("Decode FLOPs per token against context")
        ax.legend()
        fig.tight_layout()
        paths.append(out / "decode_flops_by_context.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
