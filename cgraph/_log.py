"""cgraph's log: Python ``logging`` under the logger ``cgraph``.

Nothing is printed unless asked for: events are logged at INFO (or DEBUG)
and Python's default shows WARNING and above.  Switch it on as
``TORCH_LOGS`` does for torch, with an environment variable read at import:

    CGRAPH_LOGS=info python train.py    # or debug

or with ``logging.getLogger("cgraph").setLevel(logging.INFO)`` and a handler
of your own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref

log = logging.getLogger("cgraph")


def configure_from_environment(value: str | None = None) -> None:
    """Sets the logger's level from ``CGRAPH_LOGS`` (info, debug, warning),
    with a handler writing "[cgraph] message" to stderr; unset: nothing."""
    value = os.environ.get("CGRAPH_LOGS") if value is None else value
    if not value:
        return
    level = logging.getLevelName(value.strip().upper())
    if not isinstance(level, int):
        raise ValueError(f"CGRAPH_LOGS={value!r}: use one of debug, info, warning.")
    log.setLevel(level)
    if not any(getattr(h, "_cgraph", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[cgraph] %(message)s"))
        handler._cgraph = True
        log.addHandler(handler)


def describe(graphed) -> str:
    """'callable 0 (Linear)': how log lines name a graphed callable."""
    spec = graphed.spec
    if spec is None:
        return "a reset callable" if graphed.is_reset else "a callable with no graph yet"
    target = spec.module() if spec.module is not None else spec.function
    name = type(target).__name__ if spec.module is not None else getattr(
        target, "__qualname__", type(target).__name__)
    return f"callable {spec.index} ({name})"


def on_event(event: str, graphed) -> None:
    """The native core's event hook (_C.set_event_hook)."""
    if event == "progress":
        if _bar is not None:
            _bar.update(1)
    elif event == "reset":
        if graphed.num_graphs and log.isEnabledFor(logging.INFO):
            log.info("%s: reset: %d graph(s) freed; their pools held %.1f MiB.",
                     describe(graphed), graphed.num_graphs, pool_mib(graphed.pools))
    elif event == "eager_pending":
        log.info(
            "%s: a call ran eagerly because a backward that has not run yet (of its "
            "previous call, or of another graph of its pool) needs memory a replay would "
            "overwrite; counted in stats['eager_pending']. Logged once per callable.",
            describe(graphed))
    elif event in ("past_max_graphs", "past_max_graphs_pending"):
        _past_limit(graphed, pending=event == "past_max_graphs_pending")
    elif event == "pool_dropped":
        _pool_dropped(graphed)
    elif event == "outputs_copied":
        log.info(
            "%s: an output of an earlier call was still held when the graph replayed over "
            "its memory, so it was copied to memory of its own first and keeps its value "
            "(make_graphed's kept_outputs='copy', the default, and every graphed step): one "
            "small device copy per held output per call, counted in stats['outputs_copied']. "
            "Logged once per callable.", describe(graphed))
    elif event == "outputs_invalidated":
        log.info(
            "%s: an output of an earlier call was still held when the graph replayed over "
            "its memory; it now raises when read (kept_outputs='error'), counted in "
            "stats['outputs_invalidated']. Clone outputs you keep across calls, or graph "
            "with kept_outputs='copy' (the default). Logged once per callable.",
            describe(graphed))
    else:
        log.debug("%s: %s", describe(graphed), event)


# The graphed callables already told that a call carrying a Cache ran eagerly.
_told_cache: "weakref.WeakSet" = weakref.WeakSet()


_told_nested: "weakref.WeakSet" = weakref.WeakSet()


def _first_time(told: "weakref.WeakSet", graphed) -> bool:
    """Whether `graphed` is not in `told` yet; it is from now on."""
    if graphed in told:
        return False
    told.add(graphed)
    return True


def nested_call_eager(graphed) -> None:
    """A call passing a nested tensor ran eagerly (cgraph/_regraph.py);
    logged once per callable."""
    if not _first_time(_told_nested, graphed):
        return
    log.info("%s: a call passing a nested tensor (nn.TransformerEncoder's fast path turns a "
             "padded batch into one in evaluation) runs eagerly: no graph takes its ragged "
             "shape. Counted in stats['eager_on_miss']. Logged once per callable.",
             describe(graphed))


def cache_call_eager(graphed) -> None:
    """A call carrying a transformers Cache ran eagerly (cgraph/_regraph.py);
    logged once per callable."""
    if not _first_time(_told_cache, graphed):
        return
    log.info("%s: a call carrying a transformers Cache (generate(), or use_cache=True) runs "
             "eagerly: the layer appends to the cache, a Python side effect a replay would "
             "skip. Counted in stats['eager_on_miss']. Logged once per callable.",
             describe(graphed))


# (module class, buffer name) pairs already logged: Note [A buffer assigned
# anew during set-up] (cgraph/_capture.py).
_told_buffers: set = set()


def buffer_kept_in_place(module, name: str) -> None:
    """A set-up's call assigned a buffer a new tensor alike to its own: its
    values were copied in instead; logged once per module class and name."""
    key = (type(module).__qualname__, name, "kept")
    if key not in _told_buffers:
        _told_buffers.add(key)
        log.info("%s.%s was assigned a new tensor while graphed; its values were copied "
                 "into the buffer instead, so that the graph reads and writes one tensor "
                 "(Note [A buffer assigned anew during set-up]). Logged once.",
                 type(module).__name__, name)


def buffer_replaced_at_capture(module, name: str) -> None:
    """A capture assigned a buffer a tensor unlike its own (another shape,
    dtype or kind): a warning, once per module class and name."""
    key = (type(module).__qualname__, name, "replaced")
    if key not in _told_buffers:
        _told_buffers.add(key)
        log.warning("%s.%s was assigned a new tensor of another shape, dtype or kind during "
                    "a capture: each replay writes that tensor but reads the one it replaced, "
                    "as the capture began. If the new value depends on the old, update the "
                    "buffer in place (self.%s.copy_(new), or mul_/add_) and keep its shape "
                    "and dtype. Logged once.", type(module).__name__, name, name)


def reset_before_destroy(graphs: int) -> None:
    """destroy_process_group() found graphs alive: reset_all() first (Note
    [destroy_process_group with live graphs] in cgraph/_api.py)."""
    log.info("destroy_process_group(): %d graphed callable(s) still alive; reset_all() "
             "first, since NCCL waits for every graph holding its collectives to go.", graphs)


def destroy_subgroup_with_graphs(graphs: int) -> None:
    """destroy_process_group(subgroup) found graphs alive, which cgraph does
    not reset (Note [destroy_process_group with live graphs] in
    cgraph/_api.py): said before a call that may never return."""
    log.warning("destroy_process_group(subgroup): %d graphed callable(s) or step(s) still "
                "alive. If any captured a collective of that group, this call never returns "
                "(NCCL waits for every graph holding one): call cgraph.reset_all(), or those "
                "graphs' reset(), first.", graphs)


def captured(graphed, captured, why: str, samples, seconds: float) -> None:
    """A graph captured after the first (cgraph/_regraph.py): `captured`,
    which `graphed` adopts as its latest graph once this returns."""
    if not log.isEnabledFor(logging.INFO):
        return
    from torch.utils import _pytree as pytree  # only when logging
    import torch

    shapes = ", ".join(str(tuple(t.shape)) for t in pytree.tree_leaves(samples)
                       if isinstance(t, torch.Tensor))
    log.info("%s: captured graph %d for %s (tensors %s) in %.3f s; its pools hold %.1f MiB.",
             describe(captured if graphed.spec is None else graphed), graphed.num_graphs + 1,
             why, shapes or "none", seconds, pool_mib([*graphed.pools, *captured.pools]))


def set_up(graphed: tuple, seconds: float) -> None:
    """Callables graphed together: their first graphs captured
    (make_graphed_callables, make_graphed with samples)."""
    if not log.isEnabledFor(logging.INFO):
        return
    pools = {tuple(p) for g in graphed for p in g.pools}
    log.info("captured %s in %.3f s; pool memory %.1f MiB.",
             ", ".join(describe(g) for g in graphed), seconds, pool_mib(pools))


def pool_mib(pools) -> float:
    """Memory the caching allocator holds for these pools (reserved, MiB)."""
    import torch  # only when asked

    wanted = {tuple(p) for p in pools}
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", (0, 0))) in wanted) / 2**20


def _pool_dropped(graphed) -> None:
    """Note [Warm-up in the pool]: a warm-up kept memory in a pool that no
    move could free, so the earlier graphs there were dropped."""
    log.info("%s: a warm-up left memory allocated in the pool of earlier graphs that no "
             "Python tensor holds (state the callable made for these arguments, such as the "
             "autograd history of a kept tensor), which their replays would overwrite: "
             "those graphs are dropped and captured again when needed; %d graph(s) remain.",
             describe(graphed), graphed.num_graphs)


def _past_limit(graphed, pending: bool) -> None:
    """A call runs eagerly: no graph takes it and max_graphs are captured
    (so num_graphs is max_graphs)."""
    why, counter = (("the backwards of its graphs for these arguments are pending",
                     "eager_pending") if pending
                    else ("none of its graphs takes these arguments", "eager_past_limit"))
    log.warning(
        "%s: a call ran eagerly because %s and max_graphs=%d graphs are captured; "
        "counted in stats[%r]. Raise max_graphs, or pad inputs to fewer shapes. Logged "
        "once per callable.", describe(graphed), why, graphed.num_graphs, counter)


def step_captured(step, recapture: bool, seconds: float) -> None:
    """A training step captured (cgraph/_step.py)."""
    if log.isEnabledFor(logging.INFO):
        log.info("%r: %s in %.3f s; its pool holds %.1f MiB.", step,
                 "captured again" if recapture else "captured", seconds,
                 pool_mib(step.graphed.pools))


def step_stale(step, owner: str, key: str) -> None:
    """A hyperparameter baked into a step's graph changed: it is captured again."""
    log.info("%r: the %s's %r changed since capture (a graph bakes it in): capturing the "
             "step again. %s", step, owner, key, _stale_fix(owner, key))


def step_fsdp_holds_every_call(step, group: str, calls: int) -> None:
    """`group` ("FSDP's 'layers.0'") held grads of backwards outside a step before each of its last
    `calls` calls, each then stepped eagerly (Note [Grads FSDP2 holds, kept
    after a step's capture] in cgraph/_fsdp.py)."""
    log.warning("%r: %s held unsharded grads of backwards outside the step before "
                "each of the last %d calls (micro-batches under set_requires_gradient_sync("
                "False)): each such call steps eagerly, since a replay would drop them. Run "
                "the micro-batches inside the step, calling set_requires_gradient_sync(i == "
                "last) before each backward, to replay every call. Logged at the third such "
                "call in a row.", step, group, calls)


def step_stale_every_call(step, owner: str, key: str, calls: int) -> None:
    """A baked hyperparameter changed before each of a step's last `calls`
    calls: each captured the step again (Note [Capturable optimizers] in
    cgraph/_step.py)."""
    log.warning("%r: the %s's %r changed before each of the last %d calls, and each change "
                "captures the step again (a graph bakes it in), far slower than a replay. "
                "%s Logged once per step.", step, owner, key, calls, _stale_fix(owner, key))


# How to keep a scheduler from changing a hyperparameter a graph bakes in,
# by the optimizer's key; _stale_fix's default for other keys and owners.
_STALE_FIXES = {
    "lr": "For lr: SGD(fused=True), and RMSprop or Adadelta with foreach=True, read it "
          "from the device instead.",
    "momentum": "OneCycleLR and CyclicLR change it at every step: build them with "
                "cycle_momentum=False.",
    "betas": "OneCycleLR and CyclicLR change it at every step: build them with "
             "cycle_momentum=False.",
}


def _stale_fix(owner: str, key: str) -> str:
    fix = _STALE_FIXES.get(key) if owner == "optimizer" else None
    return fix or "Change it rarely: each change costs a capture."


def step_optimizer_replaced(step, optimizer) -> None:
    """An optimizer's param_groups or state were replaced or grown since the step's capture."""
    what = ("an optimizer it captured is gone" if optimizer is None else
            f"{type(optimizer).__name__}'s param_groups or state were replaced since capture "
            "(load_state_dict, add_param_group)")
    log.info("%r: %s: this call steps eagerly and the next captures again, so that the graph "
             "steps the optimizers' tensors as they are now.", step, what)


def step_params_changed(step, what: str, how: str) -> None:
    """A parameter a step's graph steps, or a module's mode, changed since its
    capture (Note [What a graphed step checks before a replay] in
    cgraph/_step_checks.py)."""
    log.info("%r: %s: %s since capture: this call steps eagerly and the next captures again, "
             "so that the graph runs the step as it is now.", step, what, how)


def step_sync_flips(step, what: str, changes: int, span: int) -> None:
    """Grad sync set outside a step changed `changes` times, each within
    `span` calls of the last, each then captured again (Note [Grad sync set
    outside a graphed step] in cgraph/_step_checks.py): gradient
    accumulation's micro-batches, one call each."""
    log.warning("%r: %s changed %d times, each within %d calls of the last: each change steps "
                "eagerly and captures the step again, far slower than a replay (gradient "
                "accumulation with one call per micro-batch and DDP's no_sync() or FSDP's "
                "set_requires_gradient_sync() set outside). "
                "Run the micro-batches inside the step, sync turned off around all but the "
                "last, or graph one step per setting, the grads zeroed in place "
                "(zero_grad(set_to_none=False)), as cgraph.lightning does and "
                "examples/ddp_step.py check 9 shows. Logged once per step.",
                step, what, changes, span)


def step_capture_dropped(step, optimizers: list) -> None:
    """A capture made optimizer state that a GradScaler's conditional node
    would have left unwritten: dropped, the call stepped eagerly (Note
    [GradScaler with any optimizer] in cgraph/_step.py)."""
    log.info("%r: its capture made optimizer state inside the GradScaler's skip of %s (a "
             "parameter trained since the warm-up): dropped; this call steps eagerly, and the "
             "step captures after a step the scaler does not skip.", step,
             ", ".join(type(opt).__name__ for opt in optimizers))


def step_state_made_at_capture(step, made: list) -> None:
    """A step's capture made optimizer state (`made`: an optimizer per
    parameter, on this rank), which every replay would make again."""
    what = (f"made {type(made[0]).__name__}'s state for {len(made)} parameter(s) (they had "
            "no grad in the warm-up calls: unfrozen, or first used now)" if made else
            "made optimizer state on another rank")
    log.info("%r: its capture %s, which every replay would make again: it replays for this "
             "call, as a first step, and the next call captures again.", step, what)


def step_reset(step) -> None:
    """A graphed training step reset by its user."""
    log.info("%r: reset: its graph freed; the next call captures again.", step)


def step_ddp_warmup(step, eager: int | None, forwards: int) -> None:
    """A step trains a DistributedDataParallel model: its first `eager`
    calls run eagerly, or (None) as many as DDP's grad-syncing forwards
    take, synced from outside."""
    if eager is not None:
        log.info("%r: the step trains a DistributedDataParallel model, whose first %d "
                 "grad-syncing forwards sync the GPU (Note [DDP inside a graphed step] in "
                 "cgraph/_ddp.py): %d eager steps before capture, not %d.", step, forwards,
                 eager, step.num_warmup_iters)
        return
    log.info("%r: the step trains a DistributedDataParallel model, whose first %d "
             "grad-syncing forwards sync the GPU (Note [DDP inside a graphed step] in "
             "cgraph/_ddp.py), and this call synced none (no_sync() around it): the step "
             "runs eagerly until the model has run %d, however many calls that takes.",
             step, forwards, forwards)


def step_ddp_never_synced(step, calls: int) -> None:
    """DDP's count of a step's model's grad-syncing forwards has not grown
    since the step's first call (1 stands for 0 or 1), `calls` calls in:
    the step waits for DDP's grad-syncing forwards (Note
    [DDP inside a graphed step] in cgraph/_ddp.py), however many calls they
    take."""
    log.warning("%r: %d calls in, a DistributedDataParallel model it trains has synced grads "
                "at most once since its first call (no_sync() around the calls): the step "
                "runs eagerly until DDP has run its first 11 grad-syncing forwards, which "
                "sync the GPU, and never captures if every call is under no_sync(). Logged "
                "once per step.", step, calls)


def step_grads_copied(moved: int, held: int) -> None:
    """A graphed step's optimizer found new grad tensors made outside the step."""
    log.info("A graphed step's optimizer reads grads made outside the step, and %d of %d were "
             "new tensors at this call (zero_grad() sets them to None): their values are "
             "copied into the ones the graph reads before every such call, beside them in "
             "memory. optimizer.zero_grad(set_to_none=False) outside the step keeps the same "
             "grads, with no copy (Note [Grads around a graphed step] in "
             "cgraph/_step_grads.py). Logged once per step.", moved, held)


def fsdp_home_taken_back(holder: str, taker: str) -> None:
    """An idle FSDP layer holding a shared home was resharded, the first
    time in its model (cgraph/_fsdp.py)."""
    log.info("FSDP layer %s was still unsharded (set_reshard_after_backward(False), or an "
             "unshard()) in the home its graphs share with %s for their unsharded parameters: "
             "cgraph resharded it, and FSDP all-gathers it again before its next use (Note [A "
             "layer kept unsharded in a shared home] in cgraph/_fsdp.py). To keep layers "
             "unsharded, shard them with reshard_after_forward=False: a home each. Logged "
             "once per model.", holder, taker)


def step_waits_for_a_step(step, optimizers: list) -> None:
    """A GradScaler skipped every warm-up step of these optimizers so far."""
    names = ", ".join(sorted({type(opt).__name__ for opt in optimizers}))
    log.info("%r: GradScaler has skipped every step of %s so far (inf or NaN grads): warm-up "
             "goes on until each has stepped once, so that its state exists before capture "
             "(Note [GradScaler with any optimizer] in cgraph/_step.py).", step, names)


# The progress bar of the set-up in progress, if any (progress()).
_bar = None


@contextlib.contextmanager
def progress(callables: int):
    """A progress bar over one set-up's warm-ups and captures (three steps
    per callable), with tqdm when it is installed.  It shows only once the
    set-up has taken a second, and only on a terminal or in a notebook."""
    global _bar
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield
        return
    noun = "callable" if callables == 1 else "callables"
    bar = tqdm(total=3 * callables, desc=f"cgraph: graphing {callables} {noun}", delay=1.0,
               leave=False, unit="step", disable=not _interactive())
    outer, _bar = _bar, bar
    try:
        yield
    finally:
        _bar = outer
        bar.close()


def _interactive() -> bool:
    return sys.stderr.isatty() or "ipykernel" in sys.modules
