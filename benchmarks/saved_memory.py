"""Bytes autograd keeps for backward, per recipe: the MLP block LayerNorm(H) -> Linear(H, F) ->
GELU -> Linear(F, H) (bf16) at T tokens, counted with ``torch.autograd.graph.saved_tensors_hooks``
(each distinct storage once, parameters and their quantized data excluded). A memory measurement,
not a timing: it runs on CPU (the same ops save the same tensors on CUDA).

    python benchmarks/saved_memory.py [--tokens 4096] [--hidden 256] [--ffn 1024] [--device cpu]
                                      [--out DIR]   (writes saved_memory_<gpu|cpu>.json there)
"""

from __future__ import annotations

from typing import Any

import torch

import fusible
from _common import all_recipes, environment, print_table, shape_parser, write_json
from fusible import ops
from fusible.quantization.quantizers import QuantizedTensor, qdata_tensors

RECIPES: dict[str, Any] = all_recipes("bf16 (no recipe)")


def param_storages(model: torch.nn.Module) -> set[int]:
    """Storage addresses of the parameters (a quantized weight: the tensors it holds)."""
    out = set()
    for p in model.parameters():
        ts = list(qdata_tensors(p.qdata).values()) if isinstance(p, QuantizedTensor) else [p]
        out.update(t.untyped_storage().data_ptr() for t in ts)
    return out


def saved_bytes(
    model: torch.nn.Module, x: torch.Tensor, rec: Any, *, backward: bool = True, **kw: Any
) -> int:
    """Bytes of the distinct non-parameter storages one forward saves for backward (the
    backward is run too unless ``backward=False``, so delayed-scaling state moves as in
    training). Shared with tests/python/ops/test_saved_memory.py."""
    seen: dict[int, int] = {}
    params = param_storages(model)

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = model(x, **kw)
    if backward:
        y.float().sum().backward()
    return sum(seen.values())


def main() -> None:
    ap = shape_parser(__doc__, tokens=4096, hidden=256, ffn=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    h, f, dev = args.hidden, args.ffn, args.device
    kw: dict[str, Any] = {"device": dev, "dtype": torch.bfloat16}
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.LayerNorm(h, **kw), ops.Linear(h, f, **kw), ops.GELU(), ops.Linear(f, h, **kw)
    )
    x = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    print(f"saved for backward: LayerNorm({h}) -> Linear({h}, {f}) -> GELU -> Linear({f}, {h}), "
          f"bf16, {args.tokens} tokens, {dev}")  # fmt: skip
    rows: list[dict[str, Any]] = []
    for name, rec in RECIPES.items():
        n = saved_bytes(model, x, rec)
        rows.append({"recipe": name, "bytes": n, "MiB": n / 2**20, "vs bf16": n / rows[0]["bytes"]
                     if rows else 1.0})  # fmt: skip
    print_table(rows, ["recipe", "bytes", "MiB", "vs bf16"])
    if args.out:
        shape = {"tokens": args.tokens, "hidden": h, "ffn": f, "device": dev}
        payload = {"env": environment(), "shape": shape, "rows": rows}
        print(f"wrote {write_json('saved_memory', payload, args.out)}")


if __name__ == "__main__":
    main()
