"""DistributedDataParallel inside a graphed training step (make_graphed_step):
the DDP models a step calls are found in its first eager call, the step
stays eager until DDP is ready for capture, and the capture records DDP's
gradient allreduce with the rest.  cgraph/_step.py calls this module
at three places: around each eager step (``watch``, ``warmup_iters``),
before capture (``before_capture``) and for the captured call (``call``).

Note [DDP inside a graphed step]
Q: A step's model is wrapped in DistributedDataParallel, built as users build
   it (on the default stream).  What does capturing its allreduce in the
   step's graph take, and why does the user write nothing for it (NVIDIA's
   guide: build DDP under a side stream, 11 warm-up iterations,
   TORCH_NCCL_ASYNC_ERROR_HANDLING=0)?
A: Three things, each from torch's source:
   1. DDP's grad accumulators on the capture stream.  DDP's Reducer makes
      each parameter's AccumulateGrad node when DDP is built, hangs its
      autograd hook on it (the hook copies the grad into its bucket and, when
      the bucket is full, launches the allreduce) and keeps the node alive
      (reducer.cpp, Reducer::Reducer).  A node runs on the stream that was
      current when it was made: InputMetadata's constructor records it,
      Node::stream() returns it, and the autograd engine guards onto it and
      makes it wait for the grad's producer (input_buffer.cpp,
      InputBuffer::add).  For DDP built on the default stream, the captured
      backward would have the legacy default stream wait on the capture
      stream, which CUDA refuses (cudaError 906; torch >= 2.9 also warns "The
      AccumulateGrad node's stream does not match ...").  The guide, torch's
      docs and Megatron build DDP on the stream that later captures.  cgraph
      instead moves the accumulators of each DDP model's parameters onto the
      capture stream for the length of the captured call (their one input
      metadata remade there; the nodes and DDP's hooks stay:
      csrc/aten_accumulators.cpp) and gives them their streams back after.
      DDP's hooks, its bucket copies, the allreduce (NCCL's stream joins the
      capture through ProcessGroupNCCL's event) and the copy back into the
      grads then run on the capture stream and are captured.  Warm-up steps
      run on the capture stream too (Note [A step's warm-up in its pool] in
      csrc/aten_setup.cpp), so every one after the first, which finds the
      models, moves them the same way.
   2. Eleven eager forwards first.  At each grad-syncing forward DDP's logger
      first reads the previous iteration's CUDA timing events
      (Logger::set_runtime_stats_and_log -> CudaTimer::measureDifference ->
      cudaEventSynchronize) at sampled iterations: Reducer::
      should_collect_runtime_stats, num_iterations_ in 1..10 and every
      100th, read before prepare_for_forward counts the forward.  Forwards
      2 to 11 sync, so the forward captured must be the 12th or later; DDP
      also rebuilds its buckets at the 2nd (a broadcast and a host copy).  So
      the step stays eager until each DDP model it trains has run
      DDP_WARMUP_FORWARDS grad-syncing forwards, as DDP's logger records
      them (its "iteration": the sampled count, 10 from the 11th on;
      ddp_warmed_up), checked after every eager step: also where no_sync()
      is set outside the step, so that its first calls sync nothing and the
      synced ones come every few calls (gradient accumulation), and only
      those left where the model trained eagerly before; a model trained under
      no_sync() at every call never gets there, and its step stays eager
      (warned of after 22 calls).  The calls that takes are
      logged, estimated from the grad-syncing forwards of the step's first
      call, counted through DistributedDataParallel._pre_forward, patched
      for that call (a step does the same every call: its graph replays it),
      which also finds the models the step calls and those it trains
      (forwards with grad, synced or not: their accumulators move, their
      require_backward_grad_sync is the step's).
      Not a global module hook: torch.compile traces a module compiled in
      that call with the hook in it (and recompiles once it is gone), and
      with it a compiled model's steps came out 1 ulp off the same model
      compiled and stepped eagerly (H100s, a fresh Inductor cache); without
      it, bitwise.  And before capture the models' runtime-stats sampling is
      turned off (the sample rate set to 2**31 - 1): a recapture (a changed
      hyperparameter) runs the forward again, and every 100th would sync.
      Stats of a replayed step would measure nothing anyway: its forward ran
      once, at capture.
   3. Nothing for NCCL's error handling.  The guide disables it because
      ProcessGroupNCCL's watchdog thread queried CUDA events, which a capture
      in global mode on another thread forbids.  torch no longer needs that:
      collectives issued while capturing are not enqueued for the watchdog
      (ProcessGroupNCCL::collective, enqueue only when not capturing;
      pytorch PR 102542), and the watchdog queries earlier work under
      thread-local capture mode (a CUDAStreamCaptureModeGuard in its loop;
      PR 148594; before it, CUDAGraph::capture_begin waited out pending
      queries, PR 104487).  The variable is read when the process group is
      made, before cgraph could set it anyway.
   Refused at capture, with the fix: find_unused_parameters=True without
   static_graph.  Its Reducer searches the autograd graph for unused
   parameters on the host at every forward (prepare_for_backward), which
   replays would not redo, and, when it finds one, reads the map of used
   parameters back from the GPU in finalize_backward: a sync.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from . import _C, _log

__all__ = ["DDPInStep", "DDP_WARMUP_FORWARDS"]

# Note [DDP inside a graphed step], 2: forwards 2..11 read CUDA events.
DDP_WARMUP_FORWARDS = 11
# The largest sample rate DDP's C++ takes (an int): never reached.
_NEVER = 2**31 - 1


# ---- counting DDP's forwards in a step's first call -------------------------
# DDP's _pre_forward is replaced while any step's first call runs, in any
# thread, and put back when the last one ends, in whatever order they end;
# each call counts into the paces of the first calls running on its thread.
_patch_lock = threading.Lock()
_patch_users = 0
_unpatched: Callable | None = None  # DDP's _pre_forward as it was before
_running = threading.local()  # .paces: this thread's first calls' pace dicts


class Forwards:
    """One DDP model's forwards in a step's first call: those with grad
    (under no_sync() too: the model trains in the step) and those that
    synced grads (DDP counts only these as iterations).  An evaluation's,
    under no_grad(), are neither.  And DDP's own count of its grad-syncing
    forwards after that call (_synced_forwards), where the step waits for
    DDP: the warm-up warns if it has not grown."""

    __slots__ = ("with_grad", "synced", "counted")

    def __init__(self) -> None:
        self.with_grad = self.synced = self.counted = 0

    def __repr__(self) -> str:
        return (f"Forwards(with_grad={self.with_grad}, synced={self.synced}, "
                f"counted={self.counted})")


def _counted_pre_forward(module, *inputs, **kwargs):
    grad = torch.is_grad_enabled()
    for pace in getattr(_running, "paces", ()):
        forwards = pace.get(module)
        if forwards is None:
            forwards = pace[module] = Forwards()
        forwards.with_grad += grad
        forwards.synced += grad and module.require_backward_grad_sync
    return _unpatched(module, *inputs, **kwargs)


@contextlib.contextmanager
def _counting_forwards(pace: weakref.WeakKeyDictionary):
    global _patch_users, _unpatched
    with _patch_lock:
        if _patch_users == 0:
            _unpatched = DistributedDataParallel._pre_forward
            DistributedDataParallel._pre_forward = functools.wraps(_unpatched)(
                _counted_pre_forward)
        _patch_users += 1
    paces = _running.__dict__.setdefault("paces", [])
    paces.append(pace)
    try:
        yield
    finally:
        del paces[next(i for i, p in enumerate(paces) if p is pace)]
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                DistributedDataParallel._pre_forward = _unpatched


class DDPInStep:
    """The DDP models one graphed step calls, each with its Forwards per
    step, weakly held, found in the step's first eager call."""

    def __init__(self) -> None:
        self.pace: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Forwards
        self.watched = False
        self.waiting_logged = False

    # -- warm-up ---------------------------------------------------------------

    @contextlib.contextmanager
    def watch(self):
        """Around an eager step: in the first one that returns, DDP's
        _pre_forward notes each DDP model called and counts its grad-syncing
        forwards (a step is the same every call: its graph replays it); a
        call that raises is counted again in the next.  Patched on the
        class, not a global module hook, which torch.compile would trace
        into the modules it compiles in this call (Note [DDP inside a
        graphed step], 2)."""
        if self.watched:
            yield
            return
        try:
            with _counting_forwards(self.pace):
                yield
        except BaseException:
            self.pace.clear()
            raise
        self.watched = True

    def warmup_iters(self, step) -> int:
        """The step's num_warmup_iters after an eager step: one more call
        while a DDP model it trains has run fewer than DDP_WARMUP_FORWARDS
        grad-syncing forwards (Note [DDP inside a graphed step], 2).  Logged
        once, with the calls that take if every call syncs as the first did,
        where more than num_warmup_iters (and raised to them at once: the
        count a user reads); warned of once where DDP's count has not grown
        since the step's first call, 2 x DDP_WARMUP_FORWARDS calls in (a
        count of 1 cannot tell 0 from 1; a model trained under no_sync() at
        every call never captures)."""
        waiting = [m for m in self.training() if not ddp_warmed_up(m)]
        if not waiting:
            return step.num_warmup_iters
        eager = step.stats["eager"]
        wanted = eager + 1
        if not self.waiting_logged:
            self.waiting_logged = True
            for m in waiting:
                self.pace[m].counted = _synced_forwards(m)
            calls = self._calls_left(waiting)
            if calls is None or eager + calls > step.num_warmup_iters:
                _log.step_ddp_warmup(step, None if calls is None else eager + calls,
                                     DDP_WARMUP_FORWARDS)
                wanted = max(wanted, eager + (calls or 0))
        if eager == 2 * DDP_WARMUP_FORWARDS and any(
                _synced_forwards(m) <= max(self.pace[m].counted, 1) for m in waiting):
            _log.step_ddp_never_synced(step, eager)
        return max(step.num_warmup_iters, wanted)

    def _calls_left(self, waiting: list) -> int | None:
        """The eager calls DDP still needs if every call syncs as the first
        did, from DDP's own count (a model may have trained before); None
        where the first call synced no grad of a model (no_sync() outside)."""
        paces = [self.pace[m].synced for m in waiting]
        if min(paces) == 0:
            return None
        return max(-(-(DDP_WARMUP_FORWARDS - _synced_forwards(m)) // p)
                   for m, p in zip(waiting, paces))

    # -- capture ---------------------------------------------------------------

    def models(self) -> list:
        """Every DDP model the step calls: their collectives (a buffer
        broadcast, at any forward) and flags are the step's."""
        return list(self.pace.keys())

    def training(self) -> list:
        """Those the step runs forwards of with grad: their backward runs
        in the step, and reduces there unless no_sync() is set, inside or
        out (then, as its require_backward_grad_sync is compared before
        each replay, a call under the other setting captures again)."""
        return [model for model, f in self.pace.items() if f.with_grad > 0]

    def communicating(self) -> list:
        """Those whose calls in the step issue collectives: the ones it
        trains, and those whose forward broadcasts rank 0's buffers.  A
        forward under no_grad() of a model without buffers issues none: a
        step of it may run on some ranks only (Note [A capture that fails
        on one rank], cgraph/_ranks.py)."""
        return [model for model, f in self.pace.items()
                if f.with_grad > 0 or broadcasts_buffers(model)]

    def before_capture(self) -> None:
        """Refuses, naming the fix, a DDP model a graph cannot reduce for;
        turns off DDP's runtime-stats sampling (Note [DDP inside a graphed
        step], 2)."""
        for model in self.training():
            if model.find_unused_parameters and not model.static_graph:
                raise ValueError(
                    "cgraph: this DistributedDataParallel model has "
                    "find_unused_parameters=True: it searches the autograd graph for unused "
                    "parameters on the host at every step, which a replayed graph would not "
                    "redo (and reads their map back from the GPU when it finds one: a "
                    "sync). A graphed step runs the same graph every call: build DDP with "
                    "find_unused_parameters=False if every parameter gets a grad, or with "
                    "static_graph=True (DDP then finds unused parameters once, in its first "
                    "step).")
            model._set_ddp_runtime_logging_sample_rate(_NEVER)

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict):
        """fn(*args, **kwargs), the captured call or a warm-up step after the
        first: with DDP's grad accumulators on the current (capture) stream
        meanwhile."""
        models = self.training()
        if not models:
            return fn(*args, **kwargs)
        params = [p for model in models for p in model.parameters() if p.requires_grad]
        out, moved = _C.call_with_accumulators_here(params, fn, args, kwargs)
        _log.log.debug("cgraph: %d grad accumulators of %d DDP model(s) on the capture "
                       "stream.", moved, len(models))
        return out


def ddp_warmed_up(model) -> bool:
    """Whether DDP `model` has run DDP_WARMUP_FORWARDS grad-syncing
    forwards, as its logger records them: "iteration" is its Reducer's
    count before the forward, recorded at sampled forwards only (2..11, then
    every sample-rate-th), so it reads 10 from the 11th on (a module
    spanning devices too: the logger records it before its early return,
    in torch 2.11 and 2.14).  A model without a C++ logger, or that delays
    every allreduce, times nothing."""
    if (getattr(model, "logger", None) is None or getattr(model, "_use_python_reducer", False)
            or getattr(model, "_delay_all_reduce_all_params", False)):
        return True  # its _pre_forward returns before the logger's timing
    return _synced_forwards(model) >= DDP_WARMUP_FORWARDS


def _synced_forwards(model) -> int:
    """DDP `model`'s grad-syncing forwards so far as its logger records
    them, up to DDP_WARMUP_FORWARDS: exact from 2 on; 1 stands for 0 or 1."""
    return model._get_ddp_logging_data().get("iteration", 0) + 1


def broadcasts_buffers(model) -> bool:
    """Whether DDP `model` broadcasts rank 0's buffers at a forward that
    follows a grad-syncing one (DistributedDataParallel.
    will_sync_module_buffers, less the flag)."""
    syncs = getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", False))
    return bool(syncs) and len(getattr(model, "modules_buffers", ())) > 0
