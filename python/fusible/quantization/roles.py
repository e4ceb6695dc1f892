"""Semantic quantizer roles.

A :class:`QuantizerRole` names what a quantizer is for, independently of where it sits in a list:

* ``bucket`` -- the kind of tensor: ``input``, ``weight``, ``output``, ``grad_output``,
  ``grad_input`` (the standard buckets), or any other lowercase identifier (``qkv``, ``s``, ...);
* ``scope`` -- the kind of op or module that owns the quantizer: ``linear``, ``layernorm_linear``,
  ``layernorm_mlp``, ``grouped_linear``, ``dpa`` or a user op's own scope;
* ``name`` (optional) -- the instance name of the owning op (``fc1``), when it was given one.

``str(role)`` is ``"bucket:scope"`` and ``role.qualified`` is ``"bucket:scope:name"`` (or
``"bucket:scope"`` for an unnamed role). :meth:`QuantizerRole.parse` accepts both forms.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

__all__ = [
    "BACKWARD_BUCKETS",
    "FORWARD_BUCKETS",
    "STANDARD_BUCKETS",
    "UNREAD_BUCKETS",
    "QuantizerRole",
    "as_role",
    "as_roles",
    "backward_roles",
    "forward_roles",
]

#: Buckets used by Linear-like ops, forward then backward.
FORWARD_BUCKETS: tuple[str, ...] = ("input", "weight", "output")
BACKWARD_BUCKETS: tuple[str, ...] = ("grad_output", "grad_input")
STANDARD_BUCKETS: tuple[str, ...] = FORWARD_BUCKETS + BACKWARD_BUCKETS
#: The Linear-like buckets kept for TransformerEngine's role list only: fusible's GEMMs write the
#: output and the input gradient in high precision (a following op quantizes with its own
#: ``input`` / the previous op's ``grad_output`` quantizer), so nothing reads these.
UNREAD_BUCKETS: frozenset[str] = frozenset({"output", "grad_input"})

_IDENT = re.compile(r"[a-z_][a-z0-9_]*\Z")


def _check_ident(field: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not _IDENT.match(value):
        raise ValueError(
            f"QuantizerRole: '{field}' must be a lowercase identifier ([a-z_][a-z0-9_]*)"
            f"{' or None' if optional else ''}, got {value!r}"
        )


@dataclass(frozen=True)
class QuantizerRole:
    """What a quantizer is for: ``bucket`` (tensor kind), ``scope`` (owner kind), ``name``.

    Immutable and hashable. ``str(role) == "bucket:scope"``; ``role.qualified`` adds ``":name"``
    when the role is named. Construction validates every field (lowercase identifiers) and raises
    ``ValueError`` naming the field.
    """

    bucket: str
    scope: str
    name: str | None = None

    def __post_init__(self) -> None:
        _check_ident("bucket", self.bucket)
        _check_ident("scope", self.scope)
        _check_ident("name", self.name, optional=True)

    def __str__(self) -> str:
        return f"{self.bucket}:{self.scope}"

    @property
    def qualified(self) -> str:
        """``"bucket:scope:name"`` for a named role, else ``"bucket:scope"``."""
        return (
            f"{self.bucket}:{self.scope}"
            if self.name is None
            else (f"{self.bucket}:{self.scope}:{self.name}")
        )

    @property
    def is_gradient(self) -> bool:
        """True for gradient buckets (``grad_*``), the tensors quantized in backward."""
        return self.bucket.startswith("grad_")

    @classmethod
    def parse(cls, text: str) -> QuantizerRole:
        """Parse ``"bucket:scope"`` or ``"bucket:scope:name"``; raise ``ValueError`` otherwise."""
        if not isinstance(text, str):
            raise ValueError(
                f"QuantizerRole.parse: expected a string 'bucket:scope[:name]', got {text!r}"
            )
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(
                f"QuantizerRole.parse: expected 'bucket:scope' or 'bucket:scope:name', got {text!r}"
            )
        try:
            return cls(*parts)
        except ValueError as e:
            raise ValueError(f"QuantizerRole.parse: malformed role {text!r}: {e}") from None

    def with_scope(self, scope: str) -> QuantizerRole:
        """The same role re-scoped (modules re-scope their inner ops' roles)."""
        return replace(self, scope=scope)

    def with_name(self, name: str | None) -> QuantizerRole:
        """The same role with another instance name (None removes it)."""
        return replace(self, name=name)

    def matches(self, pattern: str) -> bool:
        """fnmatch-style glob match against ``str(self)`` or ``self.qualified``."""
        from fnmatch import fnmatchcase

        return fnmatchcase(str(self), pattern) or fnmatchcase(self.qualified, pattern)


def as_role(role: QuantizerRole | str) -> QuantizerRole:
    """Coerce a role or its string form to a :class:`QuantizerRole` (ValueError if malformed)."""
    if isinstance(role, QuantizerRole):
        return role
    if isinstance(role, str):
        return QuantizerRole.parse(role)
    raise ValueError(f"expected a QuantizerRole or a 'bucket:scope[:name]' string, got {role!r}")


def as_roles(roles: Iterable[QuantizerRole | str]) -> tuple[QuantizerRole, ...]:
    """Coerce a sequence of roles / role strings (``ValueError`` names the bad index)."""
    if isinstance(roles, (str, QuantizerRole)):
        raise ValueError(f"expected a sequence of roles, got a single role {roles!r}")
    out = []
    for i, r in enumerate(roles):
        try:
            out.append(as_role(r))
        except ValueError as e:
            raise ValueError(f"roles[{i}]: {e}") from None
    return tuple(out)


def _roles(buckets: Sequence[str], scope: str, name: str | None) -> list[QuantizerRole]:
    return [QuantizerRole(b, scope, name) for b in buckets]


def forward_roles(scope: str = "linear", name: str | None = None) -> list[QuantizerRole]:
    """The forward roles of a Linear-like op, in slot order: ``input, weight, output``."""
    return _roles(FORWARD_BUCKETS, scope, name)


def backward_roles(scope: str = "linear", name: str | None = None) -> list[QuantizerRole]:
    """The backward roles of a Linear-like op, in slot order: ``grad_output, grad_input``."""
    return _roles(BACKWARD_BUCKETS, scope, name)
