"""GPT-style training-step benchmark: ``--layers`` pre-norm transformer layers, each

    x = x + proj(attention(LayerNormLinear(h, 3h)(x)))   # causal scaled_dot_product_attention
    x = x + LayerNormMLP(h, 4h)(x)                       # LayerNorm -> fc1 -> GELU (tanh) -> fc2

between a token + position embedding and a final LayerNorm + LM head (plain torch, untied), with
cross-entropy loss on random tokens. The layers are fusible modules (``fusible.LayerNormLinear``,
``fusible.Linear``, ``fusible.LayerNormMLP``), or the same model in plain torch (``nn.LayerNorm``,
``nn.Linear``, GELU tanh) as the reference. The fusible projection is built with
``save_original_input=True``: under FP8 it keeps SDPA's output (which SDPA keeps for its own
backward) for its weight gradient instead of an FP8 copy of it (no change without a recipe, and
no change to any number). Variants:

* ``torch``: the plain-torch model (always run: it is the yardstick);
* ``bf16``: fusible, no recipe (no autocast); ``delayed`` / ``current`` / ``mxfp8``: fusible under
  ``fusible.autocast`` with DelayedScaling / Float8CurrentScaling / MXFP8BlockScaling (autocast
  around the whole forward; embedding, attention and LM head stay high precision);
* ``torchao``: ``torchao.float8.convert_to_float8_training`` (tensorwise scaling) of the plain
  model's layer Linears (not the LM head), when torchao is importable and on CUDA;
* ``head-delayed`` / ``head-current`` (only when named): as ``delayed`` / ``current``, and the
  final LayerNorm + LM head a ``fusible.LayerNormLinear`` under the recipe too (the logits'
  GEMMs in FP8: what the rest of the step would gain, at a numerics cost most users avoid).

Each in two modes (``--modes``): ``eager`` and ``compiled`` (``torch.compile(fullgraph=True)``
of the forward with autocast and loss inside, backward and optimizer outside, as in step.py; one
eager step first; ``graphs`` counts the graphs it made, 1 = no recompiles or graph breaks; a
variant's eager and compiled rows share one model). A step is forward, backward,
``AdamW.step()`` (``fused=True`` on CUDA since 2026-12-01; earlier results used the foreach
default), ``zero_grad(set_to_none=True)``. Per row: median step time (CUDA events,
``_common.time_ms``), model TFLOP/s, peak memory of one step above what lives between steps
(``max_memory_allocated`` after a reset, minus ``memory_allocated`` before the step), what lives
between steps (parameters + optimizer state + recipe state), and ratios to torch eager and torch
compiled measured in the same run.

    python benchmarks/gpt.py [--layers 8 --hidden 2048 --heads 16 --seq 1024 --batch 8]
        [--vocab 32768] [--variants torch,bf16,delayed,current,mxfp8,torchao]
        [--modes eager,compiled | --no-compile] [--out DIR] [--tag NAME] [--strict]
    python benchmarks/gpt.py --profile DIR [--variants current]   # profile instead of timing
    python benchmarks/gpt.py --tiny --no-compile   # smoke test: tiny sizes, 2 timed steps, on
                                                   # CUDA (bf16) if there is one, else CPU (fp32)

Results go to ``--out`` (default benchmarks/results/) as ``gpt[_<tag>]_<gpu>.json``; ``--tiny``
writes a file only with ``--out``. ``--strict`` exits 1 when a variant fails (otherwise failures
are table cells).

Model TFLOP/s counts 6 * tokens * (12 * layers * h^2 + h * vocab) for the matmuls plus
6 * layers * tokens * seq * h for causal attention (half of the full S x S score matrix).
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from _common import (
    all_recipes,
    dynamo_graphs,
    environment,
    error_cell,
    print_table,
    time_ms,
    write_json,
)

# "tl-<recipe>": the layers are fusible.TransformerLayer instead of the hand-wired Layer below.
# "head-<recipe>": also the final norm + LM head as a fusible.LayerNormLinear under the recipe
# (FP8 logits GEMMs; not a default variant: it changes the model's numerics where users
# usually keep high precision).
FUSIBLE = (
    "bf16", "delayed", "current", "mxfp8", "blockwise", "tl-bf16", "tl-delayed", "tl-current",
    "head-delayed", "head-current",
)  # fmt: skip
NOT_DEFAULT = ("torchao", "head-delayed", "head-current")
ALL_VARIANTS = ("torch", *FUSIBLE, "torchao")
MIB = 2**20
FULL = {"layers": 8, "hidden": 2048, "heads": 16, "seq": 1024, "batch": 8, "vocab": 32768,
        "warmup": 5, "iters": 20}  # fmt: skip
TINY = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "batch": 2, "vocab": 1024,
        "warmup": 1, "iters": 2}  # fmt: skip


def recipe_of(variant: str) -> Any:
    """The autocast recipe of a fusible variant (None: no autocast)."""
    return all_recipes("bf16")[variant.removeprefix("tl-").removeprefix("head-")]


def have_torchao() -> bool:
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception:
        return False
    return True


class Layer(nn.Module):
    """One pre-norm transformer layer, fusible modules or plain torch."""

    def __init__(self, h: int, heads: int, use_fusible: bool, device: str, dt: torch.dtype) -> None:
        super().__init__()
        if h % heads:
            raise ValueError(f"hidden {h} is not divisible by heads {heads}")
        self.heads = heads
        kw: dict[str, Any] = {"device": device, "dtype": dt}
        if use_fusible:
            import fusible

            self.qkv: nn.Module = fusible.LayerNormLinear(h, 3 * h, **kw)
            # SDPA keeps its output (the projection's input) for its backward: the projection
            # keeps that tensor too instead of an FP8 copy of it (TE's save_original_input).
            self.proj: nn.Module = fusible.Linear(h, h, save_original_input=True, **kw)
            self.mlp: nn.Module = fusible.LayerNormMLP(h, 4 * h, **kw)
        else:
            self.qkv = nn.Sequential(nn.LayerNorm(h, **kw), nn.Linear(h, 3 * h, **kw))
            self.proj = nn.Linear(h, h, **kw)
            self.mlp = nn.Sequential(
                nn.LayerNorm(h, **kw),
                nn.Linear(h, 4 * h, **kw),
                nn.GELU(approximate="tanh"),
                nn.Linear(4 * h, h, **kw),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(
        self, cfg: dict[str, int], use_fusible: bool, device: str, dt: torch.dtype,
        transformer_layer: bool = False, fusible_head: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        h, v = cfg["hidden"], cfg["vocab"]
        kw: dict[str, Any] = {"device": device, "dtype": dt}
        self.embed = nn.Embedding(v, h, **kw)
        self.pos = nn.Embedding(cfg["seq"], h, **kw)
        layers: list[nn.Module]
        if transformer_layer:
            import fusible

            layers = [fusible.TransformerLayer(h, 4 * h, cfg["heads"], activation="gelu", **kw)
                      for _ in range(cfg["layers"])]  # fmt: skip
        else:
            layers = [Layer(h, cfg["heads"], use_fusible, device, dt) for _ in range(cfg["layers"])]
        self.layers = nn.ModuleList(layers)
        self.head: nn.Module | None = None
        if fusible_head:
            import fusible

            self.head = fusible.LayerNormLinear(h, v, bias=False, **kw)
        else:
            self.norm = nn.LayerNorm(h, **kw)
            self.lm_head = nn.Linear(h, v, bias=False, **kw)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.pos(pos)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x) if self.head is not None else self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build(variant: str, cfg: dict[str, int], device: str, dt: torch.dtype) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg, variant in FUSIBLE, device, dt, variant.startswith("tl-"),
                variant.startswith("head-"))  # fmt: skip
    if variant == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    return model


class Runner:
    """A model, its AdamW and one fixed batch; ``make(mode)`` returns a step callable."""

    def __init__(self, variant: str, cfg: dict[str, int], device: str, dt: torch.dtype) -> None:
        self.model = build(variant, cfg, device, dt)
        self.recipe = recipe_of(variant) if variant in FUSIBLE else None
        # fused=True on CUDA (one kernel for all parameters), as users of recent torch run
        # AdamW; every variant uses the same optimizer, so it is shared cost in every ratio.
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=device == "cuda")
        g = torch.Generator(device="cpu").manual_seed(1)
        shape = (cfg["batch"], cfg["seq"])
        self.idx = torch.randint(0, cfg["vocab"], shape, generator=g).to(device)
        self.targets = torch.randint(0, cfg["vocab"], shape, generator=g).to(device)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.recipe is None:
            return self.model(idx, targets)
        import fusible

        with fusible.autocast(recipe=self.recipe):
            return self.model(idx, targets)

    def make(self, mode: str, fullgraph: bool = True) -> Callable[[], None]:
        fwd: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.loss

        def step() -> None:
            fwd(self.idx, self.targets).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

        if mode == "compiled":
            # One eager step first, as the rows measured before did (a fresh model's first call
            # may be a compiled one: tests/python/ops/test_compile.py
            # test_fresh_model_compiled_first).
            step()
            torch._dynamo.reset()  # a fresh cache per variant: no shared recompile limit
            fwd = torch.compile(self.loss, fullgraph=fullgraph)
        elif mode != "eager":
            raise ValueError(f"mode must be eager or compiled, got {mode!r}")
        return step


def model_flops(cfg: dict[str, int]) -> float:
    tokens = cfg["batch"] * cfg["seq"]
    h, n = cfg["hidden"], cfg["layers"]
    return 6.0 * tokens * (12 * n * h * h + h * cfg["vocab"]) + 6.0 * n * tokens * cfg["seq"] * h


def measure(step: Callable[[], None], cfg: dict[str, int], cuda: bool) -> dict[str, Any]:
    """Step time (median), then the peak memory of one more step (CUDA)."""
    ms = time_ms(step, warmup=cfg["warmup"], iters=cfg["iters"])
    out: dict[str, Any] = {"step_ms": ms, "TFLOP/s": model_flops(cfg) / ms / 1e9}
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        out["peak_MiB"] = (torch.cuda.max_memory_allocated() - before) / MIB
        out["_before"] = before
    return out


def _free(cuda: bool) -> None:
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_variant(
    variant: str, modes: list[str], cfg: dict[str, int], device: str, dt: torch.dtype,
    fullgraph: bool,
) -> list[dict[str, Any]]:  # fmt: skip
    cuda = device == "cuda"
    rows: list[dict[str, Any]] = []
    _free(cuda)
    start = torch.cuda.memory_allocated() if cuda else 0
    try:
        runner = Runner(variant, cfg, device, dt)
    except Exception as e:
        return [{"variant": variant, "mode": m, "step_ms": error_cell(e)} for m in modes]
    for mode in modes:
        row: dict[str, Any] = {"variant": variant, "mode": mode}
        try:
            graphs = dynamo_graphs()
            row.update(measure(runner.make(mode, fullgraph), cfg, cuda))
            if mode == "compiled":
                row["graphs"] = dynamo_graphs() - graphs
            if cuda:
                row["resident_MiB"] = (row.pop("_before") - start) / MIB
        except Exception as e:  # a variant that cannot run is reported, not fatal
            row["step_ms"] = error_cell(e)
        rows.append(row)
        print(f"  {variant} {mode}: {row.get('step_ms')}", flush=True)
    del runner
    _free(cuda)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    ref = {r["mode"]: r for r in rows if r["variant"] == "torch"}
    for r in rows:
        ms = r.get("step_ms")
        if not isinstance(ms, float):
            continue
        for mode in ("eager", "compiled"):
            base = ref.get(mode, {})
            if isinstance(base.get("step_ms"), float):
                r[f"speedup_vs_torch_{mode}"] = base["step_ms"] / ms
        eager_peak = ref.get("eager", {}).get("peak_MiB")
        if isinstance(r.get("peak_MiB"), float) and isinstance(eager_peak, float):
            r["peak_vs_torch_eager"] = r["peak_MiB"] / eager_peak


def profile(
    variants: list[str], modes: list[str], cfg: dict[str, int], device: str, dt: torch.dtype,
    fullgraph: bool, out_dir: str,
) -> int:  # fmt: skip
    """A torch.profiler trace (chrome JSON) of 3 steps per variant and mode, after 3 warm-up
    steps, and the ops tables by self CPU time and (CUDA) by self CUDA time. Returns the
    number of failures."""
    from torch.profiler import ProfilerActivity, record_function

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    failures = 0
    for variant in variants:
        _free(cuda)
        for mode in modes:
            try:
                runner = Runner(variant, cfg, device, dt)
                step = runner.make(mode, fullgraph)
                for _ in range(3):
                    step()
                if cuda:
                    torch.cuda.synchronize()
                with torch.profiler.profile(activities=acts) as prof:
                    for i in range(3):
                        with record_function(f"step {i}"):
                            step()
                    if cuda:
                        torch.cuda.synchronize()
            except Exception as e:
                failures += 1
                print(f"profile {variant} {mode}: {error_cell(e)}")
                continue
            finally:
                runner = None  # type: ignore[assignment]
                _free(cuda)
            path = out / f"gpt_{variant}_{mode}.json"
            prof.export_chrome_trace(str(path))
            print(f"== profile {variant} {mode} (3 steps), trace {path}")
            for key in ("self_cpu_time_total",) + (("self_cuda_time_total",) if cuda else ()):
                print(prof.key_averages().table(sort_by=key, row_limit=30,
                                                max_name_column_width=70))  # fmt: skip
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "warmup", "iters"):
        ap.add_argument(f"--{k}", type=int, default=None,
                        help=f"default {FULL[k]} ({TINY[k]} with --tiny)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, few iterations (smoke test)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    variants_help = (
        f"comma list of {','.join(ALL_VARIANTS)} (default all but head-*; torch always runs "
        "when timing, as the yardstick; torchao only if importable, on CUDA)"
    )
    ap.add_argument("--variants", default=None, help=variants_help)
    ap.add_argument("--modes", default="eager,compiled", help="eager and/or compiled")
    ap.add_argument("--no-compile", action="store_true", help="eager mode only (--modes eager)")
    ap.add_argument("--no-fullgraph", action="store_true", help="torch.compile without fullgraph")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="write torch.profiler traces of 3 steps per variant and mode into DIR "
                         "and print the op tables, instead of timing")  # fmt: skip
    ap.add_argument("--strict", action="store_true", help="exit 1 if any variant fails")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    ap.add_argument("--tag", default=None, help="results file gpt_<tag>_<gpu>.json")
    args = ap.parse_args()

    base = TINY if args.tiny else FULL
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU")
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    cuda = device == "cuda"

    if args.variants is None:
        ao = cuda and have_torchao()
        variants = [v for v in ALL_VARIANTS if v not in NOT_DEFAULT or (v == "torchao" and ao)]
    else:
        variants = [v for v in args.variants.split(",") if v]
        bad = [v for v in variants if v not in ALL_VARIANTS]
        if bad:
            raise SystemExit(f"--variants: unknown {bad} (choose from {', '.join(ALL_VARIANTS)})")
        if "torchao" in variants and not have_torchao():
            print("torchao is not importable: skipping the torchao variant")
            variants.remove("torchao")
    modes = ["eager"] if args.no_compile else [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("eager", "compiled") for m in modes):
        raise SystemExit(f"--modes: eager and/or compiled, got {args.modes!r}")
    fullgraph = not args.no_fullgraph
    tokens = cfg["batch"] * cfg["seq"]
    print(f"GPT {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads, seq "
          f"{cfg['seq']}, batch {cfg['batch']} ({tokens} tokens), vocab {cfg['vocab']}, {dt} on "
          f"{device}; variants {','.join(variants)}; modes {','.join(modes)}")  # fmt: skip

    if args.profile:
        failures = profile(variants, modes, cfg, device, dt, fullgraph, args.profile)
        sys.exit(1 if failures and args.strict else 0)

    if "torch" in variants:
        variants.remove("torch")
    rows: list[dict[str, Any]] = []
    for variant in ["torch", *variants]:
        rows += run_variant(variant, modes, cfg, device, dt, fullgraph)
    add_ratios(rows)
    cols = ["variant", "mode", "step_ms", "TFLOP/s"]
    cols += [f"speedup_vs_torch_{m}" for m in modes]
    if "compiled" in modes:
        cols.append("graphs")
    if cuda:
        cols += ["peak_MiB", "peak_vs_torch_eager", "resident_MiB"]
    print(f"training step (fwd + bwd + AdamW), {tokens} tokens, median of {cfg['iters']} steps")
    print_table(rows, cols)
    payload = {"env": environment(), "config": cfg, "device": device, "dtype": str(dt),
               "args": vars(args), "results": rows}  # fmt: skip
    name = f"gpt_{args.tag}" if args.tag else ("gpt_tiny" if args.tiny else "gpt")
    if args.out or not args.tiny:
        print(f"wrote {write_json(name, payload, args.out)}")
    failed = [
        f"{r['variant']} {r['mode']}" for r in rows if not isinstance(r.get("step_ms"), float)
    ]
    if failed:
        print(f"failed: {', '.join(failed)}")
    sys.exit(1 if failed and args.strict else 0)


if __name__ == "__main__":
    main()
