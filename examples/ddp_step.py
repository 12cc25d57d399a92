"""A DDP training step graphed whole, its gradient allreduce inside the graph:
from the repository root after a build,

    PYTHONPATH=. torchrun --nproc_per_node=2 examples/ddp_step.py   # or 1

The recipe is the eager one: build DDP as usual (on the default stream),
write the step as for eager training, graph it with make_graphed_step.
Nothing else: cgraph runs the eager steps DDP needs before capture (11,
logged with CGRAPH_LOGS=info), moves DDP's grad accumulators onto the
capture stream while it captures, and needs no
TORCH_NCCL_ASYNC_ERROR_HANDLING (Note [DDP inside a graphed step] in
cgraph/_ddp.py).

Each rank checks, and prints one line per check (tests/test_ddp.py reads
them):

1. graphed DDP step: STEPS steps of an MLP with fused AdamW, graphed and on
   an eager DDP twin (same weights, each rank its own data): every loss, and
   the parameters and grads after, bitwise equal.  With two ranks the grads
   are equal only if the graph averaged them: its allreduce replays.
2. warm-up: the graphed step ran 11 eager steps, then one capture, then
   replays.
3. allreduce in the graph: a DDP comm hook (torch's allreduce_hook) that
   also counts its calls on the host and in a GPU tensor.  The host count
   stops at the capture; the GPU count goes on by one per bucket per replay,
   so the reduction DDP launches is replayed by the graph, not the host.
4. buffers after a forward under no_grad(): an MLP with BatchNorm (DDP
   broadcasts rank 0's running stats at a forward that follows a
   grad-syncing one), a forward under no_grad() in train mode before the
   last step, after which eager DDP broadcasts nothing: parameters and
   buffers bitwise equal to eager DDP's on every rank, the last step eager
   (Note [Grad sync set outside a graphed step] in cgraph/_step_checks.py).
5. buffers around a graphed evaluation: the BatchNorm MLP's training step
   and an evaluation step (its forward under no_grad(), the model in eval
   mode), each graphed, called in turn.  Eager DDP broadcasts rank 0's
   running stats at each evaluation (it follows a grad-syncing forward) and
   at no training forward (each follows a forward under no_grad()); every
   replay leaves DDP's flag as its capture's forward did, so the graphs do
   the same: every evaluation's output, DDP's flag after it, and the
   parameters and buffers after, bitwise equal to eager DDP's on every
   rank, and no call eager
   after either capture (the evaluation leaves the training step's grads
   alone: Note [Grads no optimizer of the step holds]).
6. gradient accumulation, no_sync() outside: a forward-and-backward step
   called once per micro-batch, no_sync() around all but the last of
   each 3, its first call among them; the optimizer steps outside.  The
   step stays eager until DDP has run its 11 grad-syncing forwards (33
   calls), then captures under no_sync(); the synced call after finds
   DDP's require_backward_grad_sync changed and steps eagerly (a replay
   would reduce nothing), and the next captures again, warned of at the
   third such change.  Parameters and grads bitwise equal to eager DDP's.
7. static_graph with an unused parameter: DDP built with
   find_unused_parameters=True and static_graph=True, the fix a graphed
   step's refusal of find_unused_parameters=True alone names, over a model
   one of whose parameters no forward uses.  DDP finds it unused in its
   first step and then reduces without searching: losses, parameters and
   grads (the unused one's None) bitwise equal to eager DDP's, captured
   after DDP's 11 forwards as in check 2.
8. a capture failing on one rank: an error planted on the last rank, while
   capturing, once: before the forward (the other ranks capture the
   allreduce it never issues), or after the backward.  Every rank raises
   at the same call, naming that rank and its error (Note [A capture that
   fails on one rank] in cgraph/_ranks.py); the caller goes on calling the
   step, which captures again at the next call and replays from then on.
   Every other call's loss, and the parameters and grads after, bitwise
   equal to eager DDP's without the failed call's batch (a failed capture
   runs no kernel).
9. gradient accumulation, one graphed step per setting: check 6's loop
   with two graphed steps of the same function, one called under
   no_sync() and one synced, the grads zeroed in place (the recipe the
   warning of check 6 names; cgraph.lightning does the same).  Each keeps
   its setting, so each captures once, after DDP has run its 11
   grad-syncing forwards, and replays from then on, nothing warned.
   Parameters and grads bitwise equal to eager DDP's.
10. teardown: step.reset() of all but the two first steps (the first two
    replay all-reduces), then dist.destroy_process_group(), which resets
    those first (Note [destroy_process_group with live graphs]).
"""

import contextlib
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import cgraph

WIDTH, CLASSES, BATCH, STEPS = 64, 10, 32, 16


def mlp():
    torch.manual_seed(0)  # the same weights on every rank (DDP broadcasts them anyway)
    return nn.Sequential(nn.Linear(WIDTH, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, CLASSES)).cuda()


def bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 128), nn.BatchNorm1d(128), nn.GELU(),
                         nn.Linear(128, CLASSES)).cuda()


def train_step(model, opt):
    """An ordinary eager training step."""

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def batch(step, rank):
    torch.manual_seed(1000 * step + rank)  # each rank its own data
    return (torch.randn(BATCH, WIDTH, device="cuda"),
            torch.randint(0, CLASSES, (BATCH,), device="cuda"))


def check(ok, rank, what):
    if not ok:
        raise SystemExit(f"rank {rank} {what}: FAILED")
    print(f"rank {rank} {what}: OK", flush=True)


def graphed_vs_eager(rank, device):
    model = DDP(mlp(), device_ids=[device])  # as users build it: on the default stream
    eager = DDP(mlp(), device_ids=[device])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, fused=True)
    step = cgraph.make_graphed_step(train_step(model, opt), batch(0, rank))
    eager_step = train_step(eager, opt_e)
    for i in range(STEPS):
        x, y = batch(i, rank)
        loss, loss_e = step(x, y), eager_step(x, y)
        if not torch.equal(loss, loss_e):
            raise SystemExit(f"rank {rank} graphed DDP step: loss {i} {loss.item()} != eager "
                             f"{loss_e.item()}")
    for (name, p), q in zip(model.module.named_parameters(), eager.module.parameters()):
        if not (torch.equal(p, q) and torch.equal(p.grad, q.grad)):
            raise SystemExit(f"rank {rank} graphed DDP step: {name} or its grad differs from "
                             "eager DDP")
    check(True, rank, f"graphed DDP step: losses, parameters and grads equal to eager DDP "
                      f"over {STEPS} steps")
    want = {"eager": 11, "captures": 1, "replays": STEPS - 11}  # the capture's call replays too
    check(step.stats == want, rank, f"warm-up: {step.stats} (want {want})")
    return step


def allreduce_in_graph(rank, device):
    model = DDP(mlp(), device_ids=[device])
    host, gpu = [0], torch.zeros((), dtype=torch.int64, device="cuda")

    def counting_allreduce(state, bucket):
        host[0] += 1
        gpu.add_(1)
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_allreduce)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    step = cgraph.make_graphed_step(train_step(model, opt), batch(0, rank))
    counts = []  # (host, gpu) after each step
    for i in range(STEPS):
        step(*batch(i, rank))
        counts.append((host[0], int(gpu.item())))
    captured = step.stats["eager"]  # index of the capture's step
    buckets = counts[captured][0] - counts[captured - 1][0]
    later = STEPS - 1 - captured  # replays after the capture's call (which replays once)
    ok = (buckets > 0 and counts[-1][0] == counts[captured][0]
          and counts[-1][1] - counts[captured][1] == later * buckets)
    check(ok, rank, f"allreduce in the graph: comm hook calls on the host / on the GPU after "
                    f"each step {counts}, {buckets} bucket(s) a step")
    return step


def buffers_after_a_no_grad_forward(rank, device):
    model, eager = DDP(bn_mlp(), device_ids=[device]), DDP(bn_mlp(), device_ids=[device])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, fused=True)
    step = cgraph.make_graphed_step(train_step(model, opt), batch(0, rank))
    eager_step = train_step(eager, opt_e)
    for i in range(STEPS):
        x, y = batch(i, rank)
        step(x, y)
        eager_step(x, y)
        if i == STEPS - 2:  # after the capture: the last step broadcasts nothing
            with torch.no_grad():
                model(x)
                eager(x)
    same = all(torch.equal(a, b) for a, b in zip(
        [*model.module.parameters(), *model.module.buffers()],
        [*eager.module.parameters(), *eager.module.buffers()]))
    want = {"eager": 12, "captures": 1, "replays": STEPS - 12}
    check(same and step.stats == want, rank,
          f"buffers after a forward under no_grad(): parameters and buffers equal to eager "
          f"DDP: {same}, {step.stats} (want {want})")
    return step


def buffers_around_a_graphed_evaluation(rank, device):
    model, eager = DDP(bn_mlp(), device_ids=[device]), DDP(bn_mlp(), device_ids=[device])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, fused=True)
    step = cgraph.make_graphed_step(train_step(model, opt), batch(0, rank))

    def evaluation(ddp):
        def evaluate(x):
            with torch.no_grad():
                return ddp(x)
        return evaluate

    evaluate = cgraph.make_graphed_step(evaluation(model), batch(0, rank)[:1])
    eager_step, evaluate_e = train_step(eager, opt_e), evaluation(eager)
    same = True
    for i in range(STEPS):
        x, y = batch(i, rank)
        step(x, y)
        eager_step(x, y)
        model.eval()
        eager.eval()
        same &= torch.equal(evaluate(x), evaluate_e(x))
        # Off after eager's evaluation: the next training forward broadcasts
        # nothing (rank 0's stats just came with the evaluation's broadcast,
        # so the values alone would not show an extra one).
        same &= model.require_forward_param_sync == eager.require_forward_param_sync
        model.train()
        eager.train()
    same &= all(torch.equal(a, b) for a, b in zip(
        [*model.module.parameters(), *model.module.buffers()],
        [*eager.module.parameters(), *eager.module.buffers()]))
    # The evaluation's forwards sync no grads: it warms up as any step does.
    want = {"eager": 11, "captures": 1, "replays": STEPS - 11}
    want_e = {"eager": 3, "captures": 1, "replays": STEPS - 3}
    check(same and step.stats == want and evaluate.stats == want_e, rank,
          f"buffers around a graphed evaluation: outputs, parameters and buffers equal to "
          f"eager DDP: {bool(same)}, {step.stats} and {evaluate.stats} (want {want} and "
          f"{want_e})")
    return [step, evaluate]


def accumulated(rank, device, steps_of, micro: int, cycles: int):
    """Gradient accumulation with one call per micro-batch, no_sync() around
    all but the last of each `micro`, the optimizer stepped and the grads
    zeroed in place outside, by a DDP model and its eager twin; `steps_of`
    gives, for the DDP model's forward-and-backward function, the step to
    call under no_sync() and the synced one.  Returns those steps, whether
    parameters and grads ended bitwise equal to eager DDP's, and what
    cgraph warned of."""
    model, eager = DDP(mlp(), device_ids=[device]), DDP(mlp(), device_ids=[device])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, fused=True)

    def forward_backward(ddp):
        def fb(x, y):
            (F.cross_entropy(ddp(x), y) / micro).backward()
        return fb

    unsynced, synced = steps_of(forward_backward(model))
    step_e = forward_backward(eager)
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    handler.setLevel(logging.WARNING)
    logging.getLogger("cgraph").addHandler(handler)
    try:
        for i in range(micro * cycles):
            last = i % micro == micro - 1
            for ddp, fb in ((model, synced if last else unsynced), (eager, step_e)):
                with contextlib.nullcontext() if last else ddp.no_sync():
                    fb(*batch(i, rank))
            if last:
                for o in (opt, opt_e):
                    o.step()
                    o.zero_grad(set_to_none=False)  # the same grads: replays add into them
    finally:
        logging.getLogger("cgraph").removeHandler(handler)
    same = all(torch.equal(p, q) and torch.equal(p.grad, q.grad)
               for p, q in zip(model.parameters(), eager.parameters()))
    return unsynced, synced, same, warned


def accumulation_with_no_sync_outside(rank, device, micro=3, cycles=14):
    def one_step(fb):
        step = cgraph.make_graphed_step(fb, batch(0, rank))
        return step, step

    step, _, same, warned = accumulated(rank, device, one_step, micro, cycles)
    late = cycles - 11  # the cycles after DDP's 11 synced forwards: a capture and a replay each
    want = {"eager": 33 + late, "captures": late, "replays": 2 * late}
    flips = sum("changed 3 times, each within" in m for m in warned)
    check(same and step.stats == want and flips == 1, rank,
          f"gradient accumulation, no_sync() outside: parameters and grads equal to eager DDP: "
          f"{same}, {step.stats} (want {want}), warned once of the recaptures: {flips == 1}")
    return step


def one_step_per_setting(rank, device, micro=3, cycles=14):
    def two_steps(fb):
        return (cgraph.make_graphed_step(fb, batch(0, rank)),
                cgraph.make_graphed_step(fb, batch(0, rank)))

    unsynced, synced, same, warned = accumulated(rank, device, two_steps, micro, cycles)
    late = cycles - 11  # the cycles after DDP's 11 synced forwards
    # Called once more eagerly, at the cycle after: each eager call sets the
    # next call's warm-up by DDP's count as it stands, one short before the
    # synced step's 11th forward.
    want = {"eager": 2 * 11 + 1, "captures": 1, "replays": 2 * late - 1}
    want_synced = {"eager": 11, "captures": 1, "replays": late}
    check(same and unsynced.stats == want and synced.stats == want_synced and not warned, rank,
          f"gradient accumulation, one graphed step per setting: parameters and grads equal "
          f"to eager DDP: {same}, {unsynced.stats} and {synced.stats} (want {want} and "
          f"{want_synced}), nothing warned: {not warned}")
    return [unsynced, synced]


class WithUnused(nn.Module):
    """The MLP beside a layer its forward never calls."""

    def __init__(self):
        super().__init__()
        self.net = mlp()  # seeds, so the layer below starts alike too
        self.unused = nn.Linear(WIDTH, WIDTH).cuda()

    def forward(self, x):
        return self.net(x)


def same_training(models, what: str) -> bool:
    """Parameters and grads (None where None) of the graphed model, bitwise
    equal to the eager twin's."""
    for (name, p), q in zip(models[0].module.named_parameters(), models[1].module.parameters()):
        grads = (p.grad is None and q.grad is None) or (
            p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
        if not (torch.equal(p, q) and grads):
            print(f"{what}: {name} or its grad differs from eager DDP", flush=True)
            return False
    return True


def static_graph_with_an_unused_parameter(rank, device):
    models = [DDP(WithUnused(), device_ids=[device], find_unused_parameters=True,
                  static_graph=True) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in models]
    step = cgraph.make_graphed_step(train_step(models[0], opts[0]), batch(0, rank))
    eager_step = train_step(models[1], opts[1])
    losses = True
    for i in range(STEPS):
        losses &= torch.equal(step(*batch(i, rank)), eager_step(*batch(i, rank)))
    same = losses and same_training(models, f"rank {rank} static_graph")
    unused = models[0].module.unused.weight.grad is None
    want = {"eager": 11, "captures": 1, "replays": STEPS - 11}
    check(same and unused and step.stats == want, rank,
          f"static_graph with an unused parameter: losses, parameters and grads equal to eager "
          f"DDP: {same}, the unused one's grad None: {unused}, {step.stats} (want {want})")
    return step


def capture_failing_on_one_rank(rank, world, device, where):
    models = [DDP(mlp(), device_ids=[device]) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in models]
    armed = [rank == world - 1]

    def plant(here):
        if here == where and armed[0] and torch.cuda.is_current_stream_capturing():
            armed[0] = False
            raise RuntimeError("planted at capture")

    def planted(x, y):
        opts[0].zero_grad()
        plant("before the forward")  # the other ranks capture an allreduce this one never issues
        loss = F.cross_entropy(models[0](x), y)
        loss.backward()
        plant("after the backward")
        opts[0].step()
        return loss

    step = cgraph.make_graphed_step(planted, batch(0, rank))
    eager_step = train_step(models[1], opts[1])
    failed_at, losses = [], True
    for i in range(STEPS):
        try:
            loss = step(*batch(i, rank))
        except RuntimeError as e:
            said = " ".join([str(e), *getattr(e, "__notes__", [])])
            named = world == 1 or f"failed on rank(s) [{world - 1}]" in said
            if "planted at capture" not in said or not named:
                raise
            failed_at.append(i)  # the eager twin skips this batch too
            continue
        losses &= torch.equal(loss, eager_step(*batch(i, rank)))
    same = losses and same_training(models, f"rank {rank} failed capture")
    want = {"eager": 11, "captures": 1, "replays": STEPS - 12}
    check(same and failed_at == [11] and step.stats == want, rank,
          f"a capture failing on one rank {where}: raised on every rank at call {failed_at} "
          f"(want [11]), naming rank {world - 1} and its error; later losses, parameters and "
          f"grads equal to eager DDP: {same}, {step.stats} (want {want})")
    return step


def main():
    device = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    steps = [graphed_vs_eager(rank, device), allreduce_in_graph(rank, device),
             buffers_after_a_no_grad_forward(rank, device),
             *buffers_around_a_graphed_evaluation(rank, device),
             accumulation_with_no_sync_outside(rank, device),
             *one_step_per_setting(rank, device),
             static_graph_with_an_unused_parameter(rank, device),
             *(capture_failing_on_one_rank(rank, dist.get_world_size(), device, where)
               for where in ("before the forward", "after the backward"))]
    for step in steps[2:]:  # the all-reducing steps left alive: destroy_process_group
        step.reset()        # resets them first (Note [destroy_process_group with live graphs])
    dist.barrier()
    started = time.perf_counter()
    dist.destroy_process_group()
    print(f"rank {rank} teardown: step.reset, then destroy_process_group with graphs of "
          f"collectives alive, in {time.perf_counter() - started:.2f} s: OK", flush=True)


if __name__ == "__main__":
    main()
