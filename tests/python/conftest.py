"""Shared pytest configuration for fusible's Python tests (tests/python and its subfolders).

Fixtures and hooks provided here:

- ``devices``: parametrizes a test over the devices fusible can run on: ``"cpu"`` always, ``"cuda"``
  only when torch sees a GPU *and* fusible was built with its CUDA backend. Tests that take it run
  once per device (ids ``[cpu]`` / ``[cuda]``).
- ``@pytest.mark.cuda``: a test that needs a GPU and a CUDA build is skipped otherwise.
- ``rng_seed`` (autouse): torch, ``random`` and numpy are seeded before every test with the same
  value (``FUSIBLE_TEST_SEED``, default 0), so each test is reproducible on its own and independent
  of test order. Request the fixture to read the value. (Not named ``seed``, so that tests may use
  ``seed`` as a parameter or Hypothesis argument without overriding it.)
- Hypothesis profiles: ``fusible`` (default; no deadline, since the first call of a kernel or a
  compile can be slow) and ``fusible-thorough`` (10x the examples). Pick one with
  ``FUSIBLE_HYPOTHESIS_PROFILE``. Tests choose their own ``max_examples``; the thorough profile
  only matters for tests that do not.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings


def _cuda_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from fusible import _kernels
    except ImportError:  # the package itself failing to import is reported by the tests
        return False
    return _kernels.has_cuda()


CUDA_USABLE = _cuda_usable()
DEVICES = ["cpu", "cuda"] if CUDA_USABLE else ["cpu"]
_SKIP_CUDA_REASON = "needs a CUDA GPU and fusible built with its CUDA backend"

settings.register_profile(
    "fusible", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "fusible-thorough", parent=settings.get_profile("fusible"), max_examples=1000
)
settings.load_profile(os.environ.get("FUSIBLE_HYPOTHESIS_PROFILE", "fusible"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA_USABLE:
        return
    skip = pytest.mark.skip(reason=_SKIP_CUDA_REASON)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def devices(request: pytest.FixtureRequest) -> str:
    """One device per test instance: "cpu", and "cuda" where usable (see the module docstring)."""
    return request.param


@pytest.fixture(autouse=True)
def rng_seed() -> int:
    """Seeds torch (CPU and CUDA), ``random`` and numpy before each test; returns the seed."""
    value = int(os.environ.get("FUSIBLE_TEST_SEED", "0"))
    torch.manual_seed(value)  # also seeds every CUDA device
    random.seed(value)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(value)
    return value
