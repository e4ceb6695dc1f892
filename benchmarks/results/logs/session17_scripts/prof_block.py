"""Timeline of one fused MLP-block step per recipe: kernels in order, gaps, sync checks."""
import json, sys, os, collections, warnings
sys.path.insert(0, "benchmarks")
import torch
from _common import all_recipes, fusible_block, fusible_step, time_ms
warnings.filterwarnings("ignore")
out = os.environ.get("OUT", "/tmp")
h, f, n = 4096, 16384, 16384
x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
model = fusible_block(h, f)
recs = all_recipes("none")
for name in sys.argv[1:]:
    step = fusible_step(model, recs[name], x, dy)
    ms = time_ms(step)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step(); torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    syncs = [str(x.message)[:200] for x in w if "synchron" in str(x.message)]
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    p = f"{out}/trace_{name}.json"
    prof.export_chrome_trace(p)
    ev = json.load(open(p))["traceEvents"]
    k = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
    # last step = last third of kernels
    per = len(k) // 3
    ks = k[-per:]
    t0, t1 = ks[0]["ts"], ks[-1]["ts"] + ks[-1]["dur"]
    busy = sum(e["dur"] for e in ks)
    print(f"== {name}: time_ms {ms:.3f}; last profiled step span {(t1-t0)/1e3:.3f} ms, kernels busy {busy/1e3:.3f} ms, {per} kernels; host syncs: {len(syncs)}")
    for s in syncs[:5]: print("   sync:", s)
    prev = t0
    for e in ks:
        gap = e["ts"] - prev
        print(f"  {'gap %6.1f us ' % gap if gap > 5 else ' ' * 14}{e['dur']:8.1f} us  {e['name'][:110]}")
        prev = e["ts"] + e["dur"]
    agg = collections.Counter()
    for e in ks: agg[e["name"][:60]] += e["dur"]
    print("  -- by kernel:")
    for nm, d in agg.most_common(): print(f"     {d:9.1f} us  {nm}")
    rt = collections.Counter()
    for e in ev:
        if e.get("cat") == "cuda_runtime": rt[e["name"]] += 1
    print("  runtime calls (3 steps):", dict(rt.most_common(8)))
