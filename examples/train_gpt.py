"""The main job: train a small GPT-style byte-level language model built from
``fusible.TransformerLayer`` on real text -- the Python standard library's own source files,
found through the running interpreter (no download) -- under an FP8 recipe chosen on the command
line, next to the same model trained without a recipe (BF16 autocast on a GPU, FP32 on the CPU)
from the same initial weights and data order.

    python examples/train_gpt.py --recipe current          # none|delayed|current|mxfp8|blockwise
    python examples/train_gpt.py --tiny --steps 4          # smoke run (seconds)

It prints the fusion plan of one layer, a progress bar per run (loss, tokens/s), the train and
held-out loss of both runs, writes a PNG of both curves, saves the FP8 run's model through
``state_dict()`` as safetensors (no pickle), reloads it into a fresh model built on the ``meta``
device (checking that it gives the very same logits), and samples some text from the reloaded
model. Exits 1 when the FP8 run's final held-out loss is more than ``--tolerance`` (3%) above the
baseline's, 2 when the reloaded model's logits differ.

The model: byte embedding (256), ``--layers`` pre-norm ``fusible.TransformerLayer``s (LayerNorm,
GELU MLP, biases, causal attention with rotary position embeddings), final LayerNorm and LM head.
Embedding, final norm and head are plain torch and stay in high precision; attention
(``scaled_dot_product_attention``) runs in high precision too; the layers' four Linears (qkv,
proj, fc1, fc2) run their GEMMs under the recipe. The default size fits about two minutes for
both runs on a 2-core CPU; with CUDA it picks a larger model by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fusible
from fusible import recipe

RECIPES = {
    "none": lambda: None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=16),
    "current": lambda: recipe.Float8CurrentScaling(),
    "mxfp8": lambda: recipe.MXFP8BlockScaling(),
    "blockwise": lambda: recipe.Float8BlockScaling(),
}
VOCAB = 256  # bytes


@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    batch: int
    steps: int
    lr: float
    eval_every: int
    eval_batches: int
    max_bytes: int  # how much source text to read (train + held out)


# MXFP8 needs the hidden, QKV (3 * hidden) and FFN sizes and the tokens per batch to be
# multiples of 32. CPU: about a minute per run on 2 idle cores.
CPU = Config(layers=4, hidden=128, heads=4, ffn=512, seq=64, batch=16, steps=600, lr=6e-3,
             eval_every=100, eval_batches=8, max_bytes=16 << 20)  # fmt: skip
GPU = Config(layers=6, hidden=384, heads=6, ffn=1536, seq=256, batch=32, steps=1000, lr=1.5e-3,
             eval_every=100, eval_batches=16, max_bytes=64 << 20)  # fmt: skip
TINY = Config(layers=1, hidden=32, heads=2, ffn=64, seq=32, batch=2, steps=4, lr=3e-3,
              eval_every=2, eval_batches=1, max_bytes=1 << 20)  # fmt: skip


# ---- data ---------------------------------------------------------------------------------------


def stdlib_sources(max_bytes: int) -> tuple[Path, list[Path]]:
    """The standard library's ``.py`` files (sorted; not its test suites or installed packages),
    up to ``max_bytes`` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    files.sort()
    picked, total = [], 0
    for f in files:
        size = f.stat().st_size
        if total + size > max_bytes and picked:
            continue
        picked.append(f)
        total += size
    return root, picked


class ByteData:
    """The sources as one byte stream each for training and held-out evaluation (every tenth
    file is held out), batches of random windows in a fixed order (the same for both runs)."""

    def __init__(self, cfg: Config, device: str, seed: int) -> None:
        self.root, files = stdlib_sources(cfg.max_bytes)
        if len(files) < 2:
            raise RuntimeError(f"train_gpt: found no Python sources under {self.root}")
        train, held = bytearray(), bytearray()
        for i, f in enumerate(files):
            (held if i % 10 == 9 else train).extend(f.read_bytes() + b"\n")
        if len(held) < 2 * cfg.seq + 2:  # a tiny source set: hold out its tail instead
            cut = len(train) * 9 // 10
            train, held = train[:cut], train[cut:]
        self.files, self.cfg, self.device = len(files), cfg, device
        self.train = torch.frombuffer(train, dtype=torch.uint8)
        self.held = torch.frombuffer(held, dtype=torch.uint8)
        g = torch.Generator().manual_seed(seed)
        span = cfg.seq + 1
        self.starts = torch.randint(0, len(self.train) - span, (cfg.steps, cfg.batch), generator=g)
        n_eval = cfg.eval_batches * cfg.batch
        self.eval_starts = torch.linspace(0, len(self.held) - span - 1, n_eval).long()

    def _windows(self, stream: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        idx = starts[:, None] + torch.arange(self.cfg.seq + 1)
        w = stream[idx].long().to(self.device)
        return w[:, :-1], w[:, 1:]

    def batch(self, step: int) -> tuple[torch.Tensor, ...]:
        return self._windows(self.train, self.starts[step])

    def eval_batches(self) -> Iterator[tuple[torch.Tensor, ...]]:
        b = self.cfg.batch
        for i in range(0, len(self.eval_starts), b):
            yield self._windows(self.held, self.eval_starts[i : i + b])


# ---- model --------------------------------------------------------------------------------------


class GPT(nn.Module):
    """Byte embedding, ``cfg.layers`` fusible.TransformerLayers (causal, RoPE), LayerNorm, head."""

    def __init__(self, cfg: Config, device: Any = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device}
        self.embed = nn.Embedding(VOCAB, cfg.hidden, **kw)
        self.layers = nn.ModuleList(
            fusible.TransformerLayer(
                cfg.hidden,
                cfg.ffn,
                cfg.heads,
                rotary=True,
                self_attn_mask_type="causal",
                name=f"layer{i}",
                **kw,
            )
            for i in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden, **kw)
        self.lm_head = nn.Linear(cfg.hidden, VOCAB, bias=False, **kw)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # type: ignore[no-any-return]


@contextlib.contextmanager
def precision(rec: Any, device: str) -> Iterator[None]:
    """BF16 autocast on CUDA (fp32 parameters, as in mixed-precision training), FP32 on the
    CPU; ``fusible.autocast`` inside decides which GEMMs run in FP8."""
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.startswith("cuda")
        else contextlib.nullcontext()
    )
    with amp, fusible.autocast(enabled=rec is not None, recipe=rec):
        yield


def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor, rec: Any, device: str) -> torch.Tensor:
    with precision(rec, device):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: GPT, data: ByteData, rec: Any, device: str) -> float:
    model.eval()
    losses = [loss_of(model, x, y, rec, device).item() for x, y in data.eval_batches()]
    model.train()
    return sum(losses) / len(losses)


# ---- training -----------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    train: list[float]
    held: list[tuple[int, float]]  # (step, held-out loss)
    seconds: float


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10%."""
    warm = max(1, cfg.steps // 10)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: GPT, data: ByteData, cfg: Config, rec: Any, name: str, device: str) -> Run:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    run = Run(name, [], [], 0.0)
    tokens = cfg.batch * cfg.seq
    # A live bar on a terminal (redrawn every step); in logs, a line every 30 s.
    bar = tqdm(
        range(cfg.steps),
        desc=f"{name:>8}",
        ncols=100,
        file=sys.stderr,
        mininterval=0 if sys.stderr.isatty() else 30,
    )
    start = time.perf_counter()
    rate = None
    for step in bar:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = data.batch(step)
        loss = loss_of(model, x, y, rec, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run.train.append(loss.item())  # .item() synchronizes: the step time below is real
        dt = time.perf_counter() - t0
        rate = tokens / dt if rate is None else 0.9 * rate + 0.1 * tokens / dt
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            run.held.append((step + 1, evaluate(model, data, rec, device)))
        post = {"loss": f"{run.train[-1]:.3f}", "tok/s": f"{rate:,.0f}"}
        if run.held:
            post["held-out"] = f"{run.held[-1][1]:.3f}"
        bar.set_postfix(post, refresh=False)
    bar.close()
    run.seconds = time.perf_counter() - start
    return run


# ---- checkpoint (safetensors: tensors only, no pickle) -----------------------------------------


def save_checkpoint(model: nn.Module, path: Path, metadata: dict[str, str]) -> int:
    """``model.state_dict()`` as safetensors: recipe state (``..._extra_state``, a dict of plain
    tensors per Linear) spread into one tensor per field (``fusible.flatten_state_dict``)."""
    from safetensors.torch import save_file

    flat = fusible.flatten_state_dict(model.state_dict())
    save_file(flat, str(path), metadata=metadata)
    return len(flat)


def load_checkpoint(path: Path, device: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``state_dict`` saved by :func:`save_checkpoint` and its metadata."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=device) as f:
        meta = f.metadata() or {}
        flat = {name: f.get_tensor(name) for name in f.keys()}
    return fusible.unflatten_state_dict(flat), meta


def fresh_model(cfg: Config, device: str) -> GPT:
    """A model built on ``meta`` (no memory, no initialisation) and materialised on ``device``
    with uninitialised values: a checkpoint fills them in."""
    model = GPT(cfg, device="meta")
    return model.to_empty(device=device)


@torch.no_grad()
def sample(
    model: GPT, prompt: torch.Tensor, n: int, rec: Any, device: str, k: int = 8, t: float = 0.7
) -> bytes:
    """``n`` bytes continuing ``prompt`` (top-``k`` sampling at temperature ``t``, seeded). The
    model always sees a full window of ``len(prompt)`` bytes (MXFP8 needs token counts divisible
    by 32)."""
    model.eval()
    g = torch.Generator(device=device).manual_seed(0)
    window, out = prompt.long().to(device).view(1, -1), []
    for _ in range(n):
        with precision(rec, device):
            logits = model(window)[0, -1].float()
        top = logits.topk(k)
        nxt = top.indices[torch.multinomial((top.values / t).softmax(-1), 1, generator=g)]
        out.append(int(nxt))
        window = torch.cat((window[:, 1:], nxt.view(1, 1)), dim=1)
    return bytes(out)


# ---- report -------------------------------------------------------------------------------------


def plot(runs: list[Run], path: Path, title: str) -> None:
    """Both runs' train loss (raw, faint; trailing mean of 10 steps) and held-out loss, and
    below them the FP8 run's relative difference to the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(8, 6), dpi=110, sharex=True,
                                   gridspec_kw={"height_ratios": [3, 1]})  # fmt: skip
    colors = ("tab:blue", "tab:orange")
    for run, color in zip(runs, colors, strict=False):
        steps = range(1, len(run.train) + 1)
        ax.plot(steps, run.train, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, trailing_mean(run.train), color=color, label=f"{run.name} train")
        hs, hl = zip(*run.held, strict=True)
        ax.plot(hs, hl, "o--", color=color, label=f"{run.name} held-out")
    ref, run = runs
    steps = range(1, len(run.train) + 1)
    rel = [100 * (a / b - 1) for a, b in zip(trailing_mean(run.train), trailing_mean(ref.train),
                                             strict=True)]  # fmt: skip
    diff.plot(steps, rel, color=colors[1], label="train")
    held = [(s, 100 * (a / b - 1)) for (s, a), (_, b) in zip(run.held, ref.held, strict=True)]
    diff.plot(*zip(*held, strict=True), "o--", color=colors[1], label="held-out")
    diff.axhline(0, color=colors[0], linewidth=0.8)
    diff.set_ylabel(f"{run.name} vs\n{ref.name} (%)")
    diff.set_xlabel("step")
    diff.grid(alpha=0.3)
    diff.legend(fontsize="small")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def trailing_mean(xs: list[float], k: int = 10) -> list[float]:
    """Mean of the last ``k`` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x - (xs[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out


def printable(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", choices=list(RECIPES), default="current")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and 4 steps (CI smoke run)")
    for f in (
        "layers",
        "hidden",
        "heads",
        "ffn",
        "seq",
        "batch",
        "steps",
        "eval_every",
        "eval_batches",
    ):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.03,
        help="largest allowed relative excess of the FP8 held-out loss (0.03: 3%%)",
    )
    ap.add_argument("--sample-bytes", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("runs/train_gpt"),
        help="where the plot, the checkpoint and a JSON summary go",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev = args.device
    cfg = TINY if args.tiny else (GPU if dev.startswith("cuda") else CPU)
    cfg = replace(
        cfg,
        **{
            k: v
            for k, v in vars(args).items()
            if k in Config.__dataclass_fields__ and v is not None
        },
    )
    rec = RECIPES[args.recipe]()
    base_name = "bf16" if dev.startswith("cuda") else "fp32"
    n_sample = args.sample_bytes if args.sample_bytes is not None else (16 if args.tiny else 64)
    args.out.mkdir(parents=True, exist_ok=True)

    data = ByteData(cfg, dev, args.seed)
    print(
        f"data: {len(data.train) + len(data.held):,} bytes of Python source in {data.files} "
        f"files under {data.root} ({len(data.held):,} bytes in every tenth file held out)"
    )
    torch.manual_seed(args.seed)
    base = GPT(cfg, device=dev)
    fp8 = GPT(cfg, device=dev)
    fp8.load_state_dict(base.state_dict())  # the same initial weights
    params = sum(p.numel() for p in base.parameters())
    print(
        f"model: {cfg.layers} x fusible.TransformerLayer(hidden {cfg.hidden}, {cfg.heads} "
        f"heads, ffn {cfg.ffn}, causal, RoPE) + byte embedding / head, {params / 1e6:.2f} M "
        f"parameters; {cfg.batch} x {cfg.seq} bytes per step, {cfg.steps} steps on {dev}"
    )
    compute = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    print(f"\nfusion plan of one layer under --recipe {args.recipe}:")
    print(base.layers[0].explain(recipe=rec, dtype=compute, device=dev))
    print()

    runs = [
        train(base, data, cfg, None, base_name, dev),
        train(fp8, data, cfg, rec, args.recipe, dev),
    ]
    ref, run = runs

    print(
        f"\n{'step':>6} {base_name + ' train':>12} {args.recipe + ' train':>14} "
        f"{base_name + ' held-out':>15} {args.recipe + ' held-out':>17}"
    )
    for (s, hb), (_, hf) in zip(ref.held, run.held, strict=True):
        k = min(s, max(1, cfg.eval_every // 5))  # mean train loss of the last few steps
        tb, tf = sum(ref.train[s - k : s]) / k, sum(run.train[s - k : s]) / k
        print(f"{s:>6} {tb:>12.4f} {tf:>14.4f} {hb:>15.4f} {hf:>17.4f}")
    ref_end, end = ref.held[-1][1], run.held[-1][1]
    ratio = end / ref_end
    print(
        f"final held-out loss: {base_name} {ref_end:.4f}, {args.recipe} {end:.4f} (ratio "
        f"{ratio:.4f}, {math.log2(math.e) * end:.3f} bits/byte); runs took {ref.seconds:.1f} s "
        f"and {run.seconds:.1f} s"
    )

    png = args.out / f"loss_{args.recipe}.png"
    plot(runs, png, f"byte-level GPT on the Python stdlib: {base_name} vs {args.recipe}")
    print(f"plot: {png}")

    ckpt = args.out / f"gpt_{args.recipe}.safetensors"
    n = save_checkpoint(fp8, ckpt, {"config": json.dumps(asdict(cfg)), "recipe": args.recipe})
    sd, meta = load_checkpoint(ckpt, dev)
    reloaded = fresh_model(Config(**json.loads(meta["config"])), dev)
    reloaded.load_state_dict(sd, strict=True)
    x, _ = next(data.eval_batches())
    fp8.eval()
    with torch.no_grad(), precision(rec, dev):
        same = torch.equal(fp8(x), reloaded(x))
    print(
        f"checkpoint: {ckpt} ({n} tensors, {ckpt.stat().st_size / 1e6:.2f} MB), reloaded into "
        f"a fresh model built on meta: logits {'identical' if same else 'DIFFER'}"
    )

    prompt = data.held[data.eval_starts[0] : data.eval_starts[0] + cfg.seq]
    text = sample(reloaded, prompt, n_sample, rec, dev)
    print(
        f"sample from the reloaded model (top-8 sampling at temperature 0.7; the {n_sample} "
        "generated bytes are between « », after the end of a held-out prompt):"
    )
    shown = printable(bytes(prompt.tolist())[-48:]) + "«" + printable(text) + "»"
    print("  ..." + shown.replace("\n", "\n  "))

    summary = {
        "config": asdict(cfg),
        "recipe": args.recipe,
        "device": dev,
        "runs": [asdict(r) for r in runs],
        "ratio": ratio,
        "reload_identical": same,
        "sample": printable(text),
    }
    (args.out / f"summary_{args.recipe}.json").write_text(json.dumps(summary, indent=1))
    if not same:
        print("FAIL: the reloaded model's logits differ from the trained model's")
        return 2
    if ratio > 1 + args.tolerance:
        print(
            f"FAIL: {args.recipe} held-out loss is more than {args.tolerance:.0%} above "
            f"{base_name}'s"
        )
        return 1
    print(f"OK: {args.recipe} held-out loss within {args.tolerance:.0%} of {base_name}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
