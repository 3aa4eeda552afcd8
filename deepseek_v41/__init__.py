"""DeepSeek-V4.1-Flash in PyTorch: the exact model and its inference system.

Start with :class:`deepseek_v41.config.ModelConfig` and :func:`deepseek_v41.plan.build_layer_plan`; the command
line is ``dsv41``.
"""

__version__ = "0.1.0"


def load_model(path, dtype=None, device="cpu", fake_quant=True):
    """Load a model directory; see :func:`deepseek_v41.model.checkpoint.load_model`."""
    import torch

    from deepseek_v41.model.checkpoint import load_model as _load

    return _load(path, dtype=dtype or torch.float32, device=device, fake_quant=fake_quant)
