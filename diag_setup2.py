"""Scratch: where setup time goes, torch vs cgraph (delete before stopping)."""
import cProfile, pstats, io, time, torch, statistics
from torch.profiler import profile, ProfilerActivity
from benchmarks.workloads import WORKLOADS, build, prepare
from benchmarks.variant import _pay_one_time_costs
_pay_one_time_costs("gpt-6")
def t(v):
    p = build(WORKLOADS["gpt-6"]); torch.cuda.synchronize()
    s = time.perf_counter(); prepare(p, v); torch.cuda.synchronize(); return (time.perf_counter() - s) * 1e3
for v in ("torch-mgc-whole", "cgraph-whole", "torch-mgc-layer", "cgraph-layer"):
    print(v, "ms", sorted(round(t(v), 1) for _ in range(5)), flush=True)
for v in ("cgraph-whole", "torch-mgc-whole"):
    p = build(WORKLOADS["gpt-6"]); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prepare(p, v); torch.cuda.synchronize()
    print(v); print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22), flush=True)
p = build(WORKLOADS["gpt-6"]); torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable(); prepare(p, "cgraph-whole"); torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-4000:])
