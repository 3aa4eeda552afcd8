"""DeepSeek-V4.1-Flash in PyTorch: the exact model and its inference system.

Start with :class:`deepseek_v41.config.ModelConfig` and :func:`deepseek_v41.plan.build_layer_plan`; the command
line is ``dsv41``.
"""

__version__ = "0.1.0"
