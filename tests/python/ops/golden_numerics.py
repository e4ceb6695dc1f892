"""Digests of outputs, gradients and updated parameters of a few training steps per recipe, on
CPU with fixed seeds: the numerics that memory-only changes (when tensors are freed, the order of
independent GEMMs, where a cast runs) must leave bit for bit as they were.

``golden_numerics.json`` holds the digests of the numerics from before the peak-memory work
(commit df87392): first recorded there; re-recorded at 7b8f1fd, whose digests equalled those,
when the parameters became drawn by :func:`_init` (torch's own initialisers draw differently
across releases, which made the file hold on one torch only). The ``blockwise`` cases
(Float8BlockScaling, added after that work) were recorded with the code of commit 2d81a10, before
issue 13's second round (``--write --only blockwise`` run on that commit's package: the other
cases were left as they were). Re-recorded deliberately for issue 18 (cheaper activation
formulas, cpp/src/common/activation_math.h: a few fp32 ulps move, so an occasional bf16 or FP8
rounding of a GELU output or gradient flips): 32 digests of 4 cases changed, all downstream of a
GELU (block/mxfp8 and block_checkpoint/mxfp8: step 0's fc1 weight gradient, then everything of
step 1 and the parameters; block_fp8w/mxfp8: step 0's fc1 weight gradient; gpt/mxfp8: the MLP's
fc1 weight gradient and the embeddings' gradients); the other 23 cases kept every digest. After
both branches met, the blockwise cases were re-recorded (``--write --only blockwise``) for the
same reason: 6 digests of block/blockwise and block_checkpoint/blockwise changed (fc1's weight
gradient and what follows it), and they matched the 2d81a10 digests with the old formulas.
Re-recorded deliberately for issue 17 (``--write --only blockwise``): the blockwise GEMM adds a
16-bit bias in its epilogue, before D's one rounding, where it was added after (two roundings),
so every blockwise case with a bias moved (the 27 other cases kept every digest).
test_peak_memory.py compares the current code's digests with them. Regenerate only when
numerics are meant to change:

    cd tests && PYTHONPATH=../python python3 python/ops/golden_numerics.py --write

Per CPU: torch's own CPU kernels in these models (the backward GEMMs without a recipe, the GPT
model's attention, embeddings and LM head) take code paths of the CPU's vector ISA with other
summation orders, so some of their bits depend on it; fusible's kernels give the same bits on
every ISA. ``golden_numerics.json`` was recorded where torch reports the CPU capability
``AVX512`` (:data:`BASE_CAPABILITY`); ``golden_numerics_isa.json`` holds, per other capability,
only the digests that differ there (``AVX2``: recorded at 5bfd7e4 on an AVX2-only AMD EPYC, 101
digests of 8 cases, every one in a no-recipe case or the GPT model, downstream of torch's
kernels). :func:`expected` merges them; on a capability with no record the digests known to
vary are left out and the rest compared. Record a new capability (after checking that the
base digests of the FP8 cases hold there) with ``--write-isa``.

torch's capability alone does not name the code path: an AMD EPYC (Zen 4) with AVX-512 and
AVX512-BF16 reports ``AVX512`` too, and torch's bf16 GEMMs give other bits there (session 20:
the no-recipe and GPT cases, 8 cases; every fusible-only FP8 case kept its base digests). So a
record may be keyed by :func:`cpu_key` -- the capability, the CPU vendor and whether it has
AVX512-BF16 -- which is looked up first; ``--write-isa`` writes that key (the ``AVX2`` record
predates it and is found by the capability).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fusible
from fusible import ops, recipe
from fusible.quantization import QuantizedTensor

GOLDEN = Path(__file__).with_name("golden_numerics.json")
GOLDEN_ISA = Path(__file__).with_name("golden_numerics_isa.json")
BASE_CAPABILITY = "AVX512"  # torch.backends.cpu.get_cpu_capability() where GOLDEN was recorded
BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
DT = torch.bfloat16
T, H, F = 64, 64, 128  # divisible by 32 (MXFP8)

RECIPES: dict[str, Callable[[], Any]] = {
    "none": lambda: None,
    "delayed": recipe.DelayedScaling,
    "current": recipe.Float8CurrentScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
    "blockwise": recipe.Float8BlockScaling,
}


def digest(t: torch.Tensor | None) -> str:
    if t is None:
        return "none"
    if isinstance(t, QuantizedTensor):
        t = t.dequantize()
    shape = tuple(t.shape)
    t = t.detach().contiguous().cpu().reshape(-1)
    h = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return f"{str(t.dtype)[6:]}{list(shape)}:{h.hexdigest()[:16]}"


def _block(norm: str = "LayerNorm", act: str = "gelu", weights_recipe: Any = None) -> Any:
    kw: dict[str, Any] = {"dtype": DT}
    norm_op = ops.LayerNorm(H, **kw) if norm == "LayerNorm" else ops.RMSNorm(H, **kw)
    glu = act == "swiglu"
    act_op = ops.SwiGLU() if glu else ops.GELU()
    with fusible.quantized_model_init(weights_recipe, enabled=weights_recipe is not None):
        return _init(ops.Sequential(norm_op, ops.Linear(H, 2 * F if glu else F, **kw), act_op,
                                    ops.Linear(F, H, **kw)))  # fmt: skip


def _init(model: Any) -> Any:
    """Parameters drawn here from a seeded generator, not by the modules' own initialisers: the
    digests must not depend on how a torch release implements ``kaiming_uniform_`` (torch 2.11
    and 2.13 draw different weights from the same seed). Norm weights around 1, matrices scaled
    by ``1/sqrt(fan_in)``, the rest small."""
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                v = v / p.shape[-1] ** 0.5
            elif name.endswith("weight") and "embed" not in name and "pos" not in name:
                v = 1.0 + 0.1 * v
            else:
                v = 0.1 * v
            p.copy_(v.to(p.dtype))
    return model


def _gpt() -> Any:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import gpt

    cfg = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "batch": 2, "vocab": 256}
    return _init(gpt.GPT(cfg, True, "cpu", DT)), cfg


def _train(
    model: torch.nn.Module,
    rec_factory: Callable[[], Any],
    *,
    steps: int = 2,
    x_grad: bool = True,
    microbatches: int = 1,
    checkpoint: bool = False,
    master: bool = False,
) -> dict[str, str]:
    """``steps`` SGD steps of ``model`` on seeded data; digests of each step's outputs, input
    gradient, parameter gradients, and of the parameters at the end."""
    rec = rec_factory()
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = (
        fusible.optim.MasterWeightOptimizer(torch.optim.SGD, params, lr=0.05)
        if master
        else torch.optim.SGD(params, lr=0.05)
    )
    out: dict[str, str] = {}
    g = torch.Generator().manual_seed(1234)
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        for m in range(microbatches):
            x = torch.randn(T, H, generator=g).to(DT).requires_grad_(x_grad)
            dy = torch.randn(T, H, generator=g).to(DT)
            kw = {} if microbatches == 1 else {"is_first_microbatch": m == 0}
            with fusible.autocast(enabled=rec is not None, recipe=rec):
                if checkpoint:
                    y = fusible.checkpoint(model, x, **kw)
                else:
                    y = model(x, **kw)
            y.backward(dy)
            out[f"{s}.{m}.y"] = digest(y)
            out[f"{s}.{m}.dx"] = digest(x.grad)
        for name, p in model.named_parameters():
            out[f"{s}.grad.{name}"] = digest(p.grad)
        opt.step()
    for name, p in model.named_parameters():
        out[f"param.{name}"] = digest(p)
    return out


def _train_gpt(rec_factory: Callable[[], Any]) -> dict[str, str]:
    model, cfg = _gpt()
    rec = rec_factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(99)
    out: dict[str, str] = {}
    for s in range(2):
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
        tgt = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
        opt.zero_grad(set_to_none=True)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            loss = model(idx, tgt)
        loss.backward()
        out[f"{s}.loss"] = digest(loss)
        for name, p in model.named_parameters():
            out[f"{s}.grad.{name}"] = digest(p.grad)
        opt.step()
    return out


def cases() -> dict[str, Callable[[], dict[str, str]]]:
    """name -> a function computing that case's digests (each builds its model from seed 0)."""
    out: dict[str, Callable[[], dict[str, str]]] = {}
    for r, f in RECIPES.items():
        out[f"block/{r}"] = lambda f=f: _train(_block(), f)
        out[f"block_rms_swiglu/{r}"] = lambda f=f: _train(_block("RMSNorm", "swiglu"), f)

        def frozen(f: Any = f) -> dict[str, str]:
            m = _block()
            m[1].weight.requires_grad_(False)  # fc1's weight frozen, no input gradient
            return _train(m, f, x_grad=False)

        out[f"block_frozen/{r}"] = frozen
        out[f"block_microbatch/{r}"] = lambda f=f: _train(_block(), f, microbatches=2)
        out[f"block_checkpoint/{r}"] = lambda f=f: _train(_block(), f, checkpoint=True)
        out[f"gpt/{r}"] = lambda f=f: _train_gpt(f)
        if r != "none":  # weights stored quantized (delayed: by current scaling)
            wf = RECIPES["current"] if r == "delayed" else f
            out[f"block_fp8w/{r}"] = lambda f=f, wf=wf: _train(_block(weights_recipe=wf()), f,
                                                               master=True)  # fmt: skip
    return out


def compute(name: str) -> dict[str, str]:
    """One case's digests, on one thread (torch's CPU reductions, e.g. the embedding backward,
    split work by thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        return cases()[name]()
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _base_record() -> dict[str, dict[str, str]]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}  # type: ignore[no-any-return]


@functools.cache
def _isa_records() -> dict[str, dict[str, dict[str, str]]]:
    return json.loads(GOLDEN_ISA.read_text()) if GOLDEN_ISA.exists() else {}  # type: ignore[no-any-return]


def cpu_key() -> str:
    """torch's CPU capability, then the CPU's vendor and ``avx512_bf16`` if it has that
    extension (Linux ``/proc/cpuinfo``; the capability alone elsewhere): what a record of the
    digests that differ on a kind of CPU is keyed by."""
    cap = torch.backends.cpu.get_cpu_capability()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return cap
    info = {}
    for line in lines:
        k, _, v = line.partition(":")
        info.setdefault(k.strip(), v.strip())
    bf16 = "avx512_bf16" in info.get("flags", "").split()
    return f"{cap} {info.get('vendor_id', '?')}" + (" avx512_bf16" if bf16 else "")


def expected(case: str, key: str | None = None) -> dict[str, str]:
    """The digests ``case`` must give on this CPU (``key``: a :func:`cpu_key`, or torch's
    capability alone; default this machine's): the base record, with the differing digests of
    the record under the key, else under its capability; the base record as it is on the base
    capability; on a capability with no record the base without the digests that vary by ISA."""
    base = _base_record()[case]
    key = cpu_key() if key is None else key
    cap = key.split()[0]
    records = _isa_records()
    if key in records:
        return {**base, **records[key].get(case, {})}
    if cap == BASE_CAPABILITY:
        return dict(base)
    if cap in records:
        return {**base, **records[cap].get(case, {})}
    varying = {k for rec in records.values() for k in rec.get(case, {})}
    return {k: v for k, v in base.items() if k not in varying}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help=f"write {GOLDEN.name}")
    ap.add_argument(
        "--write-isa",
        action="store_true",
        help=f"record in {GOLDEN_ISA.name} the digests that differ on this kind of CPU (cpu_key)",
    )
    ap.add_argument("--only", default=None, help="only the cases of this recipe (e.g. blockwise)")
    args = ap.parse_args()
    names = [n for n in cases() if args.only is None or n.endswith("/" + args.only)]
    result = {name: compute(name) for name in names}
    golden = _base_record()
    if args.write_isa:
        cap = cpu_key()
        records = dict(_isa_records())  # the cached record stays as read
        own = {n: {k: v for k, v in r.items() if golden[n].get(k) != v} for n, r in result.items()}
        records[cap] = {n: d for n, d in own.items() if d}
        GOLDEN_ISA.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN_ISA}: {sum(map(len, records[cap].values()))} digests for {cap}")
        return
    if args.write:
        # --only: those cases written (added or replaced), every other one kept as it is.
        merged = {**golden, **result} if args.only else result
        GOLDEN.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN} ({len(result)} of {len(merged)} cases computed)")
        return
    bad = []
    for n in result:
        want = expected(n) if n in golden else None
        if want is None or want != {k: v for k, v in result[n].items() if k in want}:
            bad.append(n)
    print("all equal" if not bad else f"differ: {bad}")


if __name__ == "__main__":
    main()
