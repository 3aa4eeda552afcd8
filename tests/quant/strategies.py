"""Hypothesis strategies for codec inputs: float32 [rows, n] arrays of many magnitudes (tiny to huge)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays


def any_floats(n: int, special: bool = False) -> st.SearchStrategy[np.ndarray]:
    """Arbitrary float32 values (subnormals, near-max, and with ``special`` NaN / ±inf), 1-3 rows of
    ``n``."""
    elements = st.floats(width=32, allow_nan=special, allow_infinity=special, allow_subnormal=True)
    return st.integers(1, 3).flatmap(lambda rows: arrays(np.float32, (rows, n), elements=elements))


@st.composite
def scaled_normal(draw: st.DrawFn, n: int) -> np.ndarray:
    """Gaussian values times 2**k (k from -145 to 100), each element spread by a further 2**[-12, 12]."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = draw(st.integers(1, 3))
    exponent = draw(st.integers(-145, 100)) + rng.integers(-12, 13, size=(rows, n))
    return (rng.standard_normal((rows, n)) * np.exp2(exponent.astype(np.float64))).astype(np.float32)


def codec_inputs(n: int) -> st.SearchStrategy[np.ndarray]:
    return st.one_of(scaled_normal(n), any_floats(n), any_floats(n, special=True))
