"""The modules that register fast-path installers (:func:`deepseek_v41.kernels.fast.register`); imported by
:func:`deepseek_v41.kernels.fast.install`. One import per file of this package that serves model classes."""

from __future__ import annotations

from deepseek_v41.kernels.fast import attention, block, dense, moe  # noqa: F401
