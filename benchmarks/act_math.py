"""Cost of the activation functions themselves (cpp/src/common/activation_math.h), the part of the
activation kernels that issue 18 is about: a CPU proxy and the instruction count per element.

- CPU: ns per element of each function, one thread, in a loop compiled the way the CPU backend
  compiles its kernels (``--isa``: the AVX-512 or AVX2+FMA target attributes, or the baseline;
  -O3 -ffp-contract=off), over an L2-resident input of N(0, 2) values. Rounds interleave the
  functions and the variants; the figure is the fastest round, so a machine shared with other jobs
  disturbs it less.
- GPU, with ``nvcc`` on the PATH (no GPU needed): PTX instructions per element of a kernel that
  applies the function to one float, minus those of a kernel that copies it, for sm_90a, not
  counting moves and negations or |.| (ptxas folds those into operands). The kernels' speed on the
  H200 is benchmarks/ops_kernels.py's to measure.

``--base REV`` measures the header at a git revision next to the working tree's.

    python3 benchmarks/act_math.py [--base REV] [--isa avx512|avx2|baseline] [--rounds 15]
        [--out DIR]        # --isa: default the widest this processor runs
"""

from __future__ import annotations

import argparse
import collections
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from _common import environment, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
HEADERS = ("numerics.h", "fp32_ops.h", "activation_math.h")
# name -> expression of x (both revisions of the header define these).
FUNCTIONS = {
    "exp_neg_f": "exp_neg_f(-f_abs(x))",
    "sigmoid": "sigmoid_f(x)",
    "gelu_tanh": "gelu_tanh(x)",
    "dgelu_tanh": "dgelu_tanh(x)",
    "gelu_erf": "gelu_erf(x)",
    "dgelu_erf": "dgelu_erf(x)",
    "silu": "silu(x)",
    "dsilu": "dsilu(x)",
}
TARGETS = {
    "avx512": "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2,popcnt",
    "avx2": "avx2,fma,bmi,bmi2,popcnt",
    "baseline": "",
}

LOOPS = """#include "common/activation_math.h"
using namespace fusible;
#define NAME2(v, fn) v##_##fn
#define NAME(v, fn) NAME2(v, fn)
#define LOOP(fn, expr) extern "C" ATTR void NAME(V, fn)(const float* in, float* out, long n) { \\
  for (long i = 0; i < n; ++i) { const float x = in[i]; out[i] = (expr); } }
"""

DRIVER = """#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
using Loop = void (*)(const float*, float*, long);
%(decls)s
int main(int, char** argv) {
  const int rounds = atoi(argv[1]);
  const long n = 1 << 14;  // 64 KiB in, 64 KiB out
  std::vector<float> x(n), y(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> g(0.0f, 2.0f);
  for (auto& v : x) v = g(rng);
  Loop loops[] = {%(loops)s};
  const int m = sizeof(loops) / sizeof(loops[0]);
  std::vector<double> best(m, 1e30);
  for (int r = 0; r < rounds; ++r)
    for (int i = 0; i < m; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < 50; ++k) loops[i](x.data(), y.data(), n);
      const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
      best[i] = std::min(best[i], dt.count() / (50.0 * n));
    }
  for (int i = 0; i < m; ++i) printf("%%.4f\\n", best[i]);
}
"""

KERNELS = """#include "common/activation_math.h"
using namespace fusible;
#define K(fn, expr) extern "C" __global__ void k_##fn(const float* __restrict__ in, \\
  float* __restrict__ out) { const int i = blockIdx.x * blockDim.x + threadIdx.x; \\
  const float x = in[i]; out[i] = (expr); }
K(copy, x)
"""


def best_isa() -> str:
    """The widest of TARGETS this processor runs (what the CPU backend's cpu_isa() would pick)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "baseline"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "baseline"
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "baseline"


def headers(dest: Path, rev: str | None) -> Path:
    """The three headers of the working tree (rev None) or of a git revision, under dest/common."""
    common = dest / "common"
    common.mkdir(parents=True)
    for h in HEADERS:
        path = f"cpp/src/common/{h}"
        if rev is None:
            shutil.copy(ROOT / path, common / h)
        else:
            text = subprocess.check_output(["git", "show", f"{rev}:{path}"], cwd=ROOT, text=True)
            (common / h).write_text(text)
    return dest


def cpu_times(variants: dict[str, Path], isa: str, rounds: int, tmp: Path) -> dict[str, list]:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise SystemExit("no C++ compiler on the PATH")
    flags = ["-O3", "-std=c++17", "-fno-fast-math", "-ffp-contract=off"]
    flags.append(f"-I{ROOT / 'cpp/include'}")
    attr = f'__attribute__((target("{TARGETS[isa]}")))' if TARGETS[isa] else ""
    objs, decls, loops = [], [], []
    for v, inc in variants.items():
        src = tmp / f"loops_{v}.cpp"
        body = "".join(f"LOOP({f}, {e})\n" for f, e in FUNCTIONS.items())
        src.write_text(f"#define V {v}\n#define ATTR {attr}\n" + LOOPS + body)
        obj = tmp / f"loops_{v}.o"
        subprocess.check_call([cxx, *flags, f"-I{inc}", "-c", str(src), "-o", str(obj)])
        objs.append(str(obj))
    for f in FUNCTIONS:
        for v in variants:
            decls.append(f'extern "C" void {v}_{f}(const float*, float*, long);')
            loops.append(f"{v}_{f}")
    drv = tmp / "driver.cpp"
    drv.write_text(DRIVER % {"decls": "\n".join(decls), "loops": ", ".join(loops)})
    exe = tmp / "driver"
    subprocess.check_call([cxx, "-O2", "-std=c++17", str(drv), *objs, "-o", str(exe)])
    out = subprocess.check_output([str(exe), str(rounds)], text=True).split()
    vals = [float(v) for v in out]
    k = len(variants)
    return {f: vals[i * k : (i + 1) * k] for i, f in enumerate(FUNCTIONS)}


def ptx_counts(variants: dict[str, Path], tmp: Path) -> dict[str, list] | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    src = tmp / "kernels.cu"
    src.write_text(KERNELS + "".join(f"K({f}, {e})\n" for f, e in FUNCTIONS.items()))
    res: dict[str, list] = {f: [] for f in FUNCTIONS}
    for v, inc in variants.items():
        ptx = tmp / f"kernels_{v}.ptx"
        subprocess.check_call([nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90a",
                               "-ptx", f"-I{inc}", f"-I{ROOT / 'cpp/include'}", str(src), "-o",
                               str(ptx)])  # fmt: skip
        counts = {}
        for m in re.finditer(r"\.entry k_(\w+)\(.*?\n\)\n\{(.*?)\n\}", ptx.read_text(), re.S):
            ops: collections.Counter[str] = collections.Counter()
            for line in m.group(2).split("\n"):
                line = line.strip()
                if not line or line.startswith((".", "//", "$", "{", "}", "ret")):
                    continue
                if line.startswith("@"):
                    line = line.split(None, 1)[1]
                ops[line.split()[0]] += 1
            counts[m.group(1)] = ops
        base = counts["copy"]
        folded = ("mov.", "neg.", "abs.")
        for f in FUNCTIONS:
            extra = {
                o: c - base.get(o, 0) for o, c in counts[f].items() if not o.startswith(folded)
            }
            res[f].append(sum(n for n in extra.values() if n > 0))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="also measure the header at this git revision")
    ap.add_argument("--isa", choices=list(TARGETS), default=best_isa(), help="default: the best")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", help="directory for the JSON (default benchmarks/results)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        variants = {"tree": headers(tmp / "tree", None)}
        if args.base:
            variants["base"] = headers(tmp / "base", args.base)
        times = cpu_times(variants, args.isa, args.rounds, tmp)
        ptx = ptx_counts(variants, tmp)
    names = list(variants)
    rows: list[dict[str, Any]] = []
    for f in FUNCTIONS:
        row: dict[str, Any] = {"function": f}
        for i, v in enumerate(names):
            row[f"{v}_ns_per_elem"] = times[f][i]
            if ptx is not None:
                row[f"{v}_ptx_per_elem"] = ptx[f][i]
        if args.base:
            row["cpu_speedup"] = times[f][1] / times[f][0]
        rows.append(row)
    cols = ["function"] + [k for k in rows[0] if k != "function"]
    print(f"activation math, CPU {args.isa} loop, 1 thread (fastest of {args.rounds} rounds)")
    print_table(rows, cols)
    payload = {"env": environment(), "isa": args.isa, "base": args.base, "rows": rows}
    print(f"wrote {write_json(f'act_math_{args.isa}', payload, args.out)}")


if __name__ == "__main__":
    main()
