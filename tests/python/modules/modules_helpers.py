"""Shared pieces of the module tests: the ops tests' recipes and error measures, from
tests/python/ops/ops_helpers.py (pytest does not put that folder on the import path of this one:
it is appended here)."""

from __future__ import annotations

import sys
from pathlib import Path

_OPS_TESTS = str(Path(__file__).resolve().parents[1] / "ops")
if _OPS_TESTS not in sys.path:
    sys.path.append(_OPS_TESTS)

from ops_helpers import E4M3, E5M2, RECIPES, rel_err, tol  # noqa: E402

__all__ = ["E4M3", "E5M2", "RECIPES", "rel_err", "tol"]
