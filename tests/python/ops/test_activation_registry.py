"""The activation registry (ops.basic.activation.ACTIVATIONS): one row a kind of the core library's
table, each row's op computing its torch reference."""

from __future__ import annotations

import pytest
import torch

from fusible import _kernels as K
from fusible.ops import Sequential
from fusible.ops.basic.activation import ACTIVATIONS, KERNEL_ONLY_KINDS


def test_registry_is_the_kernels_table():
    assert tuple(ACTIVATIONS) + KERNEL_ONLY_KINDS == K.ACTIVATIONS
    assert {k for k, a in ACTIVATIONS.items() if a.gated} == K.GATED_ACTIVATIONS


@pytest.mark.parametrize("kind", list(ACTIVATIONS))
def test_op_computes_its_reference(kind):
    a = ACTIVATIONS[kind]
    op = a.make()
    assert op.kind == kind and op.glu == a.gated
    x = torch.randn(16, 64, dtype=torch.float32)
    torch.testing.assert_close(
        Sequential(op)(x), a.reference(x.double()).float(), rtol=2e-5, atol=1e-6
    )
