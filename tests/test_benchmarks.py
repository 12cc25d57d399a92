"""Tests of the benchmark runner.  On CPU: the workload catalogue, the plan,
ratios, table, JSON and chart on made-up rows, a failing variant becoming an
error row, and the clean exit without CUDA.  On a GPU: a quick run end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import breakdown, memory, run, variant, workloads

REPO = Path(__file__).resolve().parent.parent
NO_CUDA = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _row(workload, variant, wall, host, peak=1.5, pipe=None):
    """A made-up result row; its pipelined time is 0.8 x its wall time
    unless given."""
    return {"workload": workload, "variant": variant, "wall_us": wall, "host_us": host,
            "pipe_us": 0.8 * wall if pipe is None else pipe, "peak_mib": peak,
            "peak_reserved_mib": 2.0, "setup_s": 0.25, "device": "Fake GPU"}


def _error(workload, variant):
    return {"workload": workload, "variant": variant,
            "error": "exit code 1: RuntimeError: CUDA error: misaligned address"}


ROWS = [
    _row("overhead-32", "eager", 800.0, 700.0),
    _row("overhead-32", "torch-mgc-whole", 200.0, 100.0),
    _row("overhead-32", "cgraph-whole", 100.0, 20.0, peak=0.75, pipe=60.0),
    _error("overhead-32", "cgraph-layer"),
    _row("overhead-32", "floor", 50.0, 40.0),
    # No torch reference at all: only the floor ratio exists.
    _row("overhead-8", "eager", 300.0, 250.0),
    _row("overhead-8", "floor", 30.0, 25.0),
    # The torch reference failed: no torch ratio, no floor.
    _error("mlp", "torch-mgc-whole"),
    _row("mlp", "eager", 900.0, 800.0),
    # gpt-24's torch reference is torch-mgc-layer.
    _row("gpt-24", "torch-mgc-layer", 1000.0, 400.0),
    _row("gpt-24", "cgraph-layer", 500.0, 100.0),
]


def _ratios(rows, workload, variant):
    (row,) = (r for r in rows if (r["workload"], r["variant"]) == (workload, variant))
    return tuple(row[key] for key in run.RATIOS)


def test_catalogue():
    for w in workloads.WORKLOADS.values():
        assert set(w.variants) <= set(workloads.VARIANTS), w.name
        assert "floor" in w.variants and w.torch_ref in w.variants, w.name
    assert workloads.smallest_workloads() == ["overhead-8", "mlp", "gpt-6"]
    assert workloads.WORKLOADS["gpt-24"].torch_ref == "torch-mgc-layer"


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_layer_samples_match_the_layers_inputs(name):
    """On CPU: one eager step runs, and each layer's sample args have the
    shape, dtype and requires_grad of what the layer really receives."""
    problem = workloads.build(workloads.WORKLOADS[name], device="cpu")
    seen = []
    for layer in problem.layers:
        layer.register_forward_pre_hook(lambda _, args: seen.append(args))
    workloads.prepare(problem, "eager")()
    samples = problem.layer_samples()
    assert len(seen) == len(samples) == len(problem.layers)
    for (real,), (sample,) in zip(seen, samples, strict=True):
        assert (sample.shape, sample.dtype, sample.requires_grad) == (
            real.shape, real.dtype, real.requires_grad)
    assert all(p.grad is not None for p in problem.model.parameters())


def test_plan():
    everything = run.plan(None, None, quick=False)
    assert len(everything) == sum(len(w.variants) for w in workloads.WORKLOADS.values())
    assert {w for w, _ in run.plan(None, None, quick=True)} == {"overhead-8", "mlp", "gpt-6"}
    assert run.plan("overhead", "eager", quick=False) == [
        ("overhead-8", "eager"), ("overhead-32", "eager"), ("overhead-128", "eager")]
    # Variants that do not apply to a workload are left out for it.
    assert run.plan("gpt-24", "eager,compile-default", quick=False) == [("gpt-24", "eager")]


@pytest.mark.parametrize("workloads_arg, variants_arg, text", [
    ("gpt-7", None, "unknown workload"),
    (None, "eager,jit", "unknown variant"),
    ("overhead-8", "compile-default", "none of the requested variants"),
])
def test_plan_refuses(workloads_arg, variants_arg, text):
    with pytest.raises(ValueError, match=text):
        run.plan(workloads_arg, variants_arg, quick=False)


def test_ratios():
    rows = run.add_ratios(ROWS)
    # (wall/torch, wall/floor, pipe/floor, host/torch, peak/eager, resv/eager)
    assert _ratios(rows, "overhead-32", "cgraph-whole") == (0.5, 2.0, 1.5, 0.2, 0.5, 1.0)
    assert _ratios(rows, "overhead-32", "torch-mgc-whole") == (1.0, 4.0, 4.0, 1.0, 1.0, 1.0)
    assert _ratios(rows, "overhead-32", "cgraph-layer") == (None,) * 6
    assert _ratios(rows, "overhead-8", "eager") == (None, 10.0, 10.0, None, 1.0, 1.0)
    assert _ratios(rows, "mlp", "eager") == (None, None, None, None, 1.0, 1.0)
    assert _ratios(rows, "gpt-24", "cgraph-layer") == (0.5, None, None, 0.25, None, None)
    assert len(rows) == len(ROWS) and "wall_vs_torch" not in ROWS[0]
    # Results from before pipelined times were measured: no pipe ratio.
    old = [{k: v for k, v in r.items() if k != "pipe_us"} for r in ROWS]
    assert _ratios(run.add_ratios(old), "overhead-32", "cgraph-whole") == (
        0.5, 2.0, None, 0.2, 0.5, 1.0)


def test_table():
    table = run.format_table(run.add_ratios(ROWS))
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["workload", "variant"]
    cgraph = next(line for line in lines if "overhead-32" in line and "cgraph-whole" in line)
    assert cgraph.split()[2:] == ["20.0", "100.0", "60.0", "0.8", "2.0", "0.25", "0.50x",
                                  "2.00x", "1.50x", "0.20x", "0.50x", "1.00x", "-"]
    failed = next(line for line in lines if "cgraph-layer" in line and "overhead-32" in line)
    assert "error: exit code 1: RuntimeError: CUDA error: misaligned address" in failed
    no_ref = next(line for line in lines if line.startswith("overhead-8") and "eager" in line)
    assert no_ref.split()[-7:] == ["-", "10.00x", "10.00x", "-", "1.00x", "1.00x", "-"]
    assert "over torch-mgc-whole" in lines[-1] and "(gpt-24: torch-mgc-layer)" in lines[-1]


def test_best_of_repeats():
    slow, fast = _row("mlp", "eager", 900.0, 800.0), _row("mlp", "eager", 600.0, 500.0)
    slow["setup_s"], fast["setup_s"] = 0.5, 0.1
    third = {**slow, "wall_us": 700.0, "setup_s": 0.3}
    best = run.best_of([slow, fast, third])
    assert (best["wall_us"], best["host_us"]) == (600.0, 500.0)  # one process's pair
    assert best["setup_s"] == 0.3 and best["repeats"] == 3 and best["wall_spread"] == 1.5
    assert run.best_of([fast]) == {**fast, "repeats": 1, "wall_spread": 1.0}
    # Any failed process makes the row an error, however fast the others were.
    assert run.best_of([fast, _error("mlp", "eager"), slow]) == _error("mlp", "eager")


def test_json(tmp_path):
    rows = run.add_ratios(ROWS)
    path = tmp_path / "results.json"
    run.write_json(path, rows, {"device": "Fake GPU"})
    data = json.loads(path.read_text())
    assert data["meta"] == {"device": "Fake GPU"}
    assert data["results"] == rows
    assert data["results"][3]["error"].startswith("exit code 1")


def test_chart(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "chart.png"
    assert run.draw_chart(run.add_ratios(ROWS), path, "Fake GPU")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    path = tmp_path / "chart.png"
    assert not run.draw_chart(run.add_ratios(ROWS), path, "Fake GPU")
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not path.exists()


def test_main_with_fake_measurements(tmp_path, monkeypatch, capsys):
    """The runner's whole flow, with each variant's measurement made up."""
    calls = []

    def fake_run_variant(workload, variant, steps, warmup):
        assert (steps, warmup) == (7, run.QUICK_WARMUP)
        calls.append(variant)
        if variant == "cgraph-whole":
            return _error(workload, variant)
        wall = 100.0 if variant != "floor" else 25.0
        return _row(workload, variant, wall + (len(calls) < 7) * 50.0, 10.0)

    monkeypatch.setattr(run.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "run_variant", fake_run_variant)
    copies = tmp_path / "copies"
    copies.mkdir()
    monkeypatch.setenv("OUT", str(copies))
    out = tmp_path / "results"
    assert run.main(["--quick", "--workloads", "overhead-8", "--steps", "7", "--repeats", "2",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    variants = list(workloads.WORKLOADS["overhead-8"].variants)
    assert calls == variants * 2  # the variants take turns
    assert "[6/12] overhead-8 floor: 75.0 µs wall" in printed
    assert "[12/12] overhead-8 floor: 25.0 µs wall" in printed
    assert "error: exit code 1" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["device"] == "Fake GPU" and data["meta"]["steps"] == 7
    assert data["meta"]["repeats"] == 2
    assert [r["variant"] for r in data["results"]] == variants
    assert data["results"][0]["wall_us"] == 100.0 and data["results"][0]["wall_spread"] == 1.5
    assert data["results"][0]["wall_vs_floor"] == 4.0
    assert (copies / "results.json").read_text() == (out / "results.json").read_text()


def test_variant_usage():
    assert variant.main([]) == 2


def test_failing_variant_becomes_error_row(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    row = run.run_variant("overhead-8", "eager", steps=1, warmup=0)
    assert (row["workload"], row["variant"]) == ("overhead-8", "eager")
    assert row["error"].startswith("exit code 1: ")
    assert row["stderr_tail"]


def test_no_cuda_exits_cleanly():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick"], cwd=REPO,
                          env=NO_CUDA, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout


@pytest.mark.gpu
def test_quick_run(tmp_path):
    chosen = ("eager", "floor", "cgraph-whole", "torch-mgc-whole")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # keep $OUT for the caller
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--workloads", "overhead-8",
         "--variants", ",".join(chosen), "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert sorted(r["variant"] for r in results) == sorted(chosen)
    for row in results:
        assert row["workload"] == "overhead-8"
        assert "error" not in row, row
        assert row["wall_us"] > 0 and row["host_us"] > 0 and row["peak_mib"] > 0
        assert row["pipe_us"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["overhead-8", "mlp"])
def test_one_time_costs_leave_no_memory_behind(name):
    """The throwaway eager step that pays CUDA and cuBLAS initialization
    before a variant's clock starts must not count in its memory columns."""
    import torch

    # Start without cuBLAS workspaces: earlier tests in this process may have
    # left some, which the one-time costs' own clearing would count as freed.
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    before = torch.cuda.memory_allocated()
    variant._pay_one_time_costs(name)
    assert torch.cuda.memory_allocated() == before


def test_host_wall_and_pipelined_loops_share_the_steps(monkeypatch):
    """steps=7 over 5 rounds: 7 host steps (one synchronize each), 7 wall
    steps (two each) and 7 pipelined steps (two synchronizes per round that
    has steps: 2, 2, 1, 1, 1), alternating.  On a made-up clock where a step
    takes 10 µs (the very first one 1000 µs) and a synchronize 3 µs, the
    times per step are known: host 10 (a step with no synchronize; the
    median, so the slow first step does not count), wall 13 (a step and the
    synchronize after it) and pipelined, per round, (n steps + the final
    synchronize) / n, of which the median over rounds."""
    calls, clock, first = [], [0.0], [1000.0]

    def spend(what, us):
        calls.append(what)
        clock[0] += us * 1e-6

    def step():
        spend("step", first.pop() if first else 10.0)

    monkeypatch.setattr(variant.torch.cuda, "synchronize", lambda: spend("sync", 3.0))
    monkeypatch.setattr(variant, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    host, wall, pipe = variant._step_times_us(step, steps=7)
    assert calls.count("step") == 21 and calls.count("sync") == 7 + 14 + 2 * 5
    # Pipelined rounds of 2, 2, 1, 1, 1 steps: 11.5, 11.5, 13, 13, 13 µs a step.
    assert (host, wall, pipe) == pytest.approx((10.0, 13.0, 13.0))
    # Fewer steps than rounds: the rounds without steps time nothing.
    calls.clear()
    assert variant._step_times_us(step, steps=2) == pytest.approx((10.0, 13.0, 13.0))
    assert calls.count("step") == 6 and calls.count("sync") == 2 + 4 + 2 * 2
    # Rounds of 2 steps each: the pipelined step shares its synchronize.
    assert variant._step_times_us(step, steps=10) == pytest.approx((10.0, 13.0, 11.5))


@pytest.mark.gpu
@pytest.mark.parametrize("floor", ["floor-eager-opt", "floor-eager-loss"])
def test_raw_graph_floors_keep_their_inputs_alive(floor):
    """The floors' raw graphs read the workload's inputs: freed, their memory
    went to the eager optimizer's tensors and gpt's embedding read garbage
    token ids (a device-side assert)."""
    row = run.run_variant("gpt-6", floor, steps=5, warmup=2)
    assert "error" not in row, row


@pytest.mark.gpu
def test_eager_loss_floor_trains_as_eager_does():
    """floor-eager-loss is a floor of the same step, not of a cheaper one:
    without dropout its steps move the weights as eager steps do (the
    graphs' kernels are eager's, so to float rounding)."""
    import torch

    def trained(variant):
        problem = workloads.build(workloads.WORKLOADS["mlp"])
        problem.model.eval()  # dropout off: the same masks are no masks
        step = workloads.prepare(problem, variant)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in problem.model.parameters()]

    for got, want in zip(trained("floor-eager-loss"), trained("eager"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["overhead-8", "mlp"])
def test_breakdown_phases_make_up_the_step(name):
    """On CPU: the breakdown's phases, run in order, do what the step does:
    every parameter gets a grad, and the optimizer (if any) moves the weights."""
    problem = workloads.build(workloads.WORKLOADS[name], device="cpu")
    before = [p.detach().clone() for p in problem.model.parameters()]
    steps = breakdown.phases(problem, "eager")
    assert [n for n, _ in steps][-1] == ("backward" if problem.optimizer is None else "step")
    for _, fn in steps:
        fn()
    params = list(problem.model.parameters())
    assert all(p.grad is not None for p in params)
    moved = any(not p.detach().equal(b) for p, b in zip(params, before))
    assert moved == (problem.optimizer is not None)


def test_breakdown_without_cuda_says_so():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.breakdown"], cwd=REPO, env=NO_CUDA,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout


def test_memory_groups_segments_by_owner_stream_and_kind():
    """benchmarks.memory's grouping, on a made-up snapshot: the device's own
    cache and a graph pool apart, streams named by first appearance, and
    segments sorted into small (2 MiB), large (20 MiB) and huge."""
    mib = 2**20

    def seg(pool, stream, size, allocated):
        return {"segment_pool_id": pool, "stream": stream, "total_size": size * mib,
                "allocated_size": allocated * mib}

    groups = memory.group_segments([
        seg((0, 0), 0, 2, 1), seg((0, 0), 0, 2, 2), seg((0, 0), 0, 32, 32),
        seg((0, 1), 77, 20, 4), seg((0, 1), 77, 2, 0), seg((0, 0), 77, 2, 0),
    ])
    assert groups == {
        ("eager", "default", "huge"): memory.Group(32.0, 32.0, 1),
        ("eager", "default", "small"): memory.Group(4.0, 3.0, 2),
        ("eager", "stream 1", "small"): memory.Group(2.0, 0.0, 1),
        ("pool (0, 1)", "stream 1", "large"): memory.Group(20.0, 4.0, 1),
        ("pool (0, 1)", "stream 1", "small"): memory.Group(2.0, 0.0, 1),
    }


def test_memory_without_cuda_says_so():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", "gpt-6", "eager"], cwd=REPO,
                          env=NO_CUDA, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout


@pytest.mark.gpu
def test_breakdown_runs_on_a_gpu():
    """Each (workload, variant) gets a host line and a waits line; the waits
    are GPU idle times, so never negative.  (How the step's time from an
    idle GPU compares with its time with the host ahead is a measurement,
    not checked here: with other tests on the GPU, six steps of each swing
    either way.)"""
    waits = breakdown.gpu_waits("overhead-8", "cgraph-whole", steps=6, warmup=2, host_us=200.0)
    assert list(waits) == ["forward", "sum", "backward", "gpu", "wall"]
    assert all(v >= 0 for v in waits.values()) and waits["gpu"] > 0 and waits["wall"] > 0
    proc = subprocess.run([sys.executable, "-m", "benchmarks.breakdown", "--workloads",
                           "overhead-8", "--variants", "eager,cgraph-whole", "--steps", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("primitives, host µs:") and "calling thread" in lines[0]
    for v in ("eager", "cgraph-whole"):
        assert [line.split()[2] for line in lines if line.split()[1:2] == [v]] == ["host", "waits"]


def test_the_sharded_tp_plan_names_llama_decoder_layer_submodules():
    """benchmarks/sharded.py parallelizes these submodules of each decoder
    layer; a renamed one would make parallelize_module fail on the GPUs."""
    transformers = pytest.importorskip("transformers")
    from benchmarks import sharded
    config = transformers.LlamaConfig(**{**sharded.CONFIG, "hidden_size": 64,
                                         "intermediate_size": 128, "num_attention_heads": 4,
                                         "num_key_value_heads": 4})
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, layer_idx=0)
    for name in sharded.tp_plan():
        assert type(layer.get_submodule(name)).__name__ == "Linear", name


def test_sharded_llama_attends_without_a_mask_inside_captures(monkeypatch):
    """transformers builds a dense causal mask while a CUDA stream captures
    (it may not read position_ids then); the sharded benchmark's attention
    implementation builds none, so eager and captured steps run the same
    unmasked causal SDPA.  The capture is simulated on the CPU."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.utils import import_utils
    from benchmarks import sharded
    config = {**sharded.CONFIG, "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4}
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)
    ids = torch.randint(0, 100, (2, 16))
    for implementation, expected in (("sdpa", (False, False)),
                                     (sharded.unpadded_causal_attention(), (True, True))):
        seen.clear()
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**config, attn_implementation=implementation))
        model(input_ids=ids)
        assert seen == [expected], implementation


def test_frameworks_workload_checks_each_graphed_run_against_eager(monkeypatch):
    """benchmarks/frameworks.py times the examples' runs, and refuses a
    graphed run that ends elsewhere than its eager twin."""
    torch = pytest.importorskip("torch")
    from benchmarks import frameworks
    same, other = [torch.zeros(2)], [torch.ones(2)]

    def variants(eager, *graphed):
        runs = {"eager": lambda: eager}
        runs.update({f"graphed-{i}": (lambda run=run: run) for i, run in enumerate(graphed)})
        monkeypatch.setattr(frameworks, "runs", lambda name, size: runs)

    variants((None, same, 10.0), (None, same, 4.0), (None, same, 2.0))
    assert frameworks.measure("hf_trainer", 2) == {"eager": [10.0, 10.0], "graphed-0": [4.0, 4.0],
                                                   "graphed-1": [2.0, 2.0]}
    variants((None, same, 10.0), (None, same, 4.0), (None, other, 2.0))
    with pytest.raises(SystemExit, match="graphed-1 run's losses or parameters differ"):
        frameworks.measure("hf_trainer", 1)
    variants(([1.0], same, 10.0), ([2.0], same, 4.0))
    with pytest.raises(SystemExit, match="differ from eager"):
        frameworks.measure("hf_trainer", 1)


def test_frameworks_workload_where_eager_is_not_deterministic(monkeypatch, capsys):
    """Where two eager runs end apart (a nondeterministic kernel), a graphed
    run passes within ten times that distance, and fails beyond it; eager
    runs that cannot be compared (a NaN in one) stop the run; lightning_mlp
    refuses a size it does not have."""
    torch = pytest.importorskip("torch")
    from benchmarks import frameworks
    with pytest.raises(SystemExit, match="lightning_mlp has one size"):
        frameworks.runs("lightning_mlp", "large")
    eager_ends = iter([[torch.zeros(2)], [torch.full((2,), 1e-3)]] * 2)

    def variants(graphed_end):
        monkeypatch.setattr(frameworks, "runs", lambda name, size: {
            "eager": lambda: (None, next(eager_ends), 10.0),
            "graphed": lambda: (None, [torch.full((2,), graphed_end)], 4.0)})

    variants(5e-3)
    assert frameworks.measure("lightning_callback", 1) == {"eager": [10.0], "graphed": [4.0]}
    assert "two eager runs differ (max |diff| 0.001)" in capsys.readouterr().out
    variants(0.1)
    with pytest.raises(SystemExit, match=r"max \|diff\| 0.1, two eager runs 0.001"):
        frameworks.measure("lightning_callback", 1)
    nan, zero = torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0])
    assert frameworks._distance((None, [nan], 0.0), (None, [zero], 0.0)) == float("inf")
    assert frameworks._distance((None, [nan], 0.0), (None, [nan.clone()], 0.0)) == 0.0
    eager_ends = iter([[nan], [zero]])
    with pytest.raises(SystemExit, match="two eager runs cannot be compared"):
        frameworks.measure("lightning_callback", 1)


def test_sharded_memory_measures_variants_of_the_sharded_workload():
    """benchmarks/sharded_memory.py splits the peaks of benchmarks/sharded.py's
    variants (a '+zeroed' suffix drops the grads before each set-up call)."""
    from benchmarks import sharded, sharded_memory
    names = {v.partition("+")[0] for v in sharded_memory.VARIANTS}
    assert names <= set(sharded.VARIANTS), names - set(sharded.VARIANTS)
    assert any(v.endswith("+zeroed") for v in sharded_memory.VARIANTS)


def test_sharded_host_times_each_outermost_call_once_and_finds_fsdp2_hooks():
    """benchmarks/sharded_host.py: a timed call inside another timed call is
    not counted twice, and the FSDP2 methods it wraps exist in this torch
    (else it would time nothing)."""
    from benchmarks import sharded_host
    for cls, names in sharded_host.HOOKS:
        assert [n for n in names if not hasattr(cls, n)] == [], cls
    sharded_host.spent.clear()
    inner = sharded_host.timed("inner", lambda: 1)
    outer = sharded_host.timed("outer", lambda x: inner() + x)
    assert outer(1) == 2
    assert set(sharded_host.spent) == {"outer"} and sharded_host.spent["outer"] > 0
    sharded_host.spent.clear()


def test_the_sharded_gpu_timeline_counts_overlapping_activity_once():
    """benchmarks/sharded_gpu.py's busy time: kernels on several streams that
    overlap count once, gaps not at all, in any order."""
    from benchmarks.sharded_gpu import union
    assert union([(20, 25), (0, 10), (5, 15), (21, 22), (15, 16)]) == 21
    assert union([]) == 0
