"""The memory floor of the decode measures of ``bench/engine.py`` (issue 25): the bytes a decode step reads
(:func:`deepseek_v41.analysis.decode_bytes.decode_step_bytes`, from the loaded model) over the host's copy
bandwidth measured in the same process, as a time per step no implementation can go below and the tokens/s
ceiling that follows."""

from __future__ import annotations

import statistics
import time

# measure -> (batch, context) of the decode step it times
DECODE_MEASURES = {"decode_b1_tok_s": (1, 1024), "decode_b8_tok_s": (8, 1024), "decode_ms_1k": (1, 1024),
                   "decode_ms_16k": (1, 16384)}
COPY_BYTES = 256 << 20  # much larger than any L3, so the copy streams from memory


def copy_bandwidth(nbytes: int = COPY_BYTES, repeat: int = 7) -> float:
    """The host's memory bandwidth in GB/s: the median over ``repeat`` timed ``torch`` copies of an ``nbytes``
    buffer (after one untimed copy) of the bytes each copy moves, read plus written (2 x ``nbytes``), with the
    process's torch threads."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e9


def floors(model, keys, bandwidth_gb_s: float) -> dict[str, dict]:
    """For each decode measure in ``keys``: its step's bytes by part (``decode_step_bytes``), the routed experts'
    format, the bandwidth, ``floor_ms`` (total bytes / bandwidth) and ``floor`` in the measure's own unit
    (tokens/s ceiling = batch / floor, or ms per step)."""
    from deepseek_v41.analysis.decode_bytes import decode_step_bytes, expert_format

    out = {}
    for key in keys:
        if key not in DECODE_MEASURES:
            continue
        batch, context = DECODE_MEASURES[key]
        parts = decode_step_bytes(model, batch, context)
        floor_ms = parts["total"] / (bandwidth_gb_s * 1e9) * 1e3
        out[key] = {"batch": batch, "context": context, "bytes": parts, "experts": expert_format(model, batch),
                    "bandwidth_gb_s": bandwidth_gb_s,
                    "floor_ms": floor_ms, "floor": floor_ms if key.startswith("decode_ms") else batch * 1e3 / floor_ms}
    return out


def times_floor(key: str, value: float, floor: float) -> float:
    """How many times the measured step time is above the floor (>= 1; 1 = at the floor)."""
    return value / floor if key.startswith("decode_ms") else floor / value


def breakdown(info: dict[str, dict]) -> list[str]:
    """Lines that print each decode measure's bytes per step by part, and how the floor follows."""
    lines = [f"memory floor = bytes a decode step reads / copy bandwidth (median of timed {COPY_BYTES >> 20} MB torch "
             "copies, bytes read + written, measured in each measure's process after its timings)"]
    for key, f in info.items():
        parts = ", ".join(f"{name} {v / 1e6:.2f}" for name, v in f["bytes"].items() if name != "total")
        lines.append(f"  {key}: batch {f['batch']}, {f['context']} context: {f['bytes']['total'] / 1e6:.2f} MB "
                     f"({parts}; MB) / {f['bandwidth_gb_s']:.1f} GB/s = {f['floor_ms']:.2f} ms/step")
    if any(f["batch"] > 1 for f in info.values()):
        lines.append("  routed experts in the format the engine reads (" + next(iter(info.values()))["experts"]
                     + "); at batch B each MoE layer reads the expected distinct experts of B*k draws among E: "
                     "E * (1 - (1 - k/E)^B); KV counts every compressed entry (an upper bound) + the window rows")
    lines.append("  prefill is bound by compute, not memory: it has no memory floor here")
    return lines
