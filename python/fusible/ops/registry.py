"""The fusion registry: fusion patterns are data, registered in one place.

A rule says: "for adjacent basic ops of these types, if the predicate accepts, run them as this
FusedOperation". Rules are tried at each position in order: user rules (newest first) before the
built-in ones, so user fusions take precedence. A predicate returns ``None`` to accept, or a short
reason to reject, which ``Sequential.explain()`` shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fusible.ops.op import BasicOperation, FusedOperation

__all__ = [
    "FusionRule",
    "fusion_disabled",
    "fusion_enabled",
    "register_fusion",
    "rules",
    "unregister_fusion",
]

Predicate = Callable[[Sequence[BasicOperation], Any], "str | None"]


@dataclass(frozen=True)
class FusionRule:
    """Pattern of adjacent op types -> fused op factory, for the forward and/or backward plan."""

    name: str
    pattern: tuple[type[BasicOperation], ...]
    factory: Callable[[list[BasicOperation]], FusedOperation]
    forward: bool
    backward: bool
    predicate: Predicate | None = None
    user: bool = False

    def __post_init__(self) -> None:
        if not self.pattern or not all(
            isinstance(t, type) and issubclass(t, BasicOperation) for t in self.pattern
        ):
            raise TypeError(
                f"FusionRule '{self.name}': pattern must be a non-empty tuple of BasicOperation "
                f"subclasses, got {self.pattern!r}"
            )
        if not (self.forward or self.backward):
            raise ValueError(f"FusionRule '{self.name}': must apply to forward and/or backward")

    def matches_types(self, ops: Sequence[BasicOperation]) -> bool:
        return len(ops) == len(self.pattern) and all(
            isinstance(op, t) for op, t in zip(ops, self.pattern, strict=True)
        )

    def check(self, ops: Sequence[BasicOperation], recipe: Any) -> str | None:
        """None if the rule applies to ``ops`` under ``recipe``, else why not."""
        return None if self.predicate is None else self.predicate(ops, recipe)


_BUILTIN: list[FusionRule] = []
_USER: list[FusionRule] = []
_VERSION = [0]  # bumped on every change, so fuser plan caches notice
_DISABLED = [0]  # nesting depth of fusion_disabled()


@contextlib.contextmanager
def fusion_disabled() -> Iterator[None]:
    """Within this context every op runs unfused and no op quantizes its output for the next
    (no quantizer hand-off): the reference path that fused numerics are tested against."""
    _DISABLED[0] += 1
    try:
        yield
    finally:
        _DISABLED[0] -= 1


def fusion_enabled() -> bool:
    return _DISABLED[0] == 0


def register_fusion(
    pattern: Sequence[type[BasicOperation]],
    factory: Callable[[list[BasicOperation]], FusedOperation],
    *,
    name: str | None = None,
    predicate: Predicate | None = None,
    forward: bool = True,
    backward: bool = False,
    builtin: bool = False,
) -> FusionRule:
    """Register a fusion of adjacent ops of types ``pattern`` into ``factory(ops)``.

    ``predicate(ops, recipe)`` returns None to accept or a reason string to reject. User rules
    take precedence over built-in ones, newest first. Returns the rule (for ``unregister_fusion``).
    """
    rule_name = name or getattr(factory, "name", None) or getattr(factory, "__name__", "fusion")
    if not isinstance(rule_name, str) or not rule_name:
        raise TypeError(f"register_fusion: name must be a non-empty string, got {rule_name!r}")
    where = f"register_fusion: rule '{rule_name}'"
    if isinstance(pattern, type) or not isinstance(pattern, Sequence) or isinstance(pattern, str):
        raise TypeError(
            f"{where}: pattern must be a non-empty tuple of BasicOperation subclasses, got "
            f"{pattern!r} ({type(pattern).__name__})"
        )
    if not callable(factory):
        raise TypeError(
            f"{where}: factory must be callable (a FusedOperation subclass, or a function "
            f"ops -> FusedOperation), got {factory!r} ({type(factory).__name__})"
        )
    if predicate is not None and not callable(predicate):
        raise TypeError(
            f"{where}: predicate must be None or callable (ops, recipe) -> None | reason, got "
            f"{predicate!r} ({type(predicate).__name__})"
        )
    for arg, value in (("forward", forward), ("backward", backward), ("builtin", builtin)):
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {arg} must be a bool, got {value!r}")
    rule = FusionRule(
        name=rule_name,
        pattern=tuple(pattern),
        factory=factory,
        forward=forward,
        backward=backward,
        predicate=predicate,
        user=not builtin,
    )
    if builtin:
        _BUILTIN.append(rule)
    else:
        _USER.insert(0, rule)
    _VERSION[0] += 1
    return rule


def unregister_fusion(rule: FusionRule) -> None:
    for table in (_USER, _BUILTIN):
        if rule in table:
            table.remove(rule)
            _VERSION[0] += 1
            return
    raise ValueError(f"unregister_fusion: rule '{rule.name}' is not registered")


def rules(forward: bool) -> list[FusionRule]:
    """Rules for one plan, in the order the fuser tries them."""
    if not fusion_enabled():
        return []
    return [r for r in (*_USER, *_BUILTIN) if (r.forward if forward else r.backward)]


def version() -> tuple[int, bool]:
    """Changes whenever the rules the fuser would use change (plan caches key on it)."""
    return _VERSION[0], fusion_enabled()
