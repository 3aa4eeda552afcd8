"""deepseek_v41 caps libgomp's spinning on import (torch's OpenMP workers otherwise hold the cores for
milliseconds after each parallel op, slowing the decode kernels that follow); an explicit setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = ("import os, deepseek_v41, torch; "
         "print(os.environ.get('GOMP_SPINCOUNT'), deepseek_v41.GOMP_SPINCOUNT_SET, torch.get_num_threads())")


def probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          check=True)
    return done.stdout.split()


@pytest.mark.parametrize(("env", "want"), [({}, ["10000", "10000"]), ({"GOMP_SPINCOUNT": "7"}, ["7", "None"]),
                                           ({"OMP_WAIT_POLICY": "PASSIVE"}, ["None", "None"])])
def test_spin_count_is_set_on_import_unless_the_environment_says(env, want):
    got = probe(**env)
    assert got[:2] == want
    assert int(got[2]) >= 1  # torch loads and runs with it
