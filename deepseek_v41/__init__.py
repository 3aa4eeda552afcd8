"""DeepSeek-V4.1-Flash in PyTorch: the exact model and its inference system.

Start with :class:`deepseek_v41.config.ModelConfig` and :func:`deepseek_v41.plan.build_layer_plan`; the command
line is ``dsv41``.
"""

import os as _os

__version__ = "0.1.0"

# torch's intra-op threads on Linux are libgomp's, which spin ~300,000 times after each parallel op before they
# sleep: milliseconds on CPUs with a slow `pause`, holding the cores that a decode step's fused kernels then run on
# (the first decode steps after a prefill took twice as long: bench/README.md). 10,000 spins keep the wake-ups
# cheap beside ATen's large ops. libgomp reads this when it loads, so it takes effect when torch is imported after
# this package (the CLI, `from deepseek_v41 ... import`); an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
# GOMP_SPINCOUNT_SET is the value set here (None when the environment's own was kept).
GOMP_SPINCOUNT_SET = None
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    GOMP_SPINCOUNT_SET = _os.environ["GOMP_SPINCOUNT"] = "10000"


def load_model(path, dtype=None, device="cpu", fake_quant=True):
    """Load a model directory; see :func:`deepseek_v41.model.checkpoint.load_model`."""
    import torch

    from deepseek_v41.model.checkpoint import load_model as _load

    return _load(path, dtype=dtype or torch.float32, device=device, fake_quant=fake_quant)


_ENGINE_NAMES = ("LLM", "SamplingParams", "StructuredOutputsParams", "EngineArgs", "LLMEngine", "RequestOutput",
                 "CompletionOutput")
__all__ = ["load_model", *_ENGINE_NAMES]


def __getattr__(name):
    """``from deepseek_v41 import LLM, SamplingParams, StructuredOutputsParams`` (as ``from vllm import LLM,
    SamplingParams``): the engine's names are imported on first use, so ``import deepseek_v41`` alone imports no
    torch. Raises AttributeError for any other missing name."""
    if name in _ENGINE_NAMES:
        from deepseek_v41 import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'deepseek_v41' has no attribute {name!r}")
