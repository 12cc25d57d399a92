"""cgraph for Lightning: one callback.

    from cgraph.lightning import CUDAGraphs
    trainer = lightning.Trainer(callbacks=[CUDAGraphs()])              # each block
    trainer = lightning.Trainer(callbacks=[CUDAGraphs(scope="step")])  # the whole step

Needs ``lightning`` (``pip install cgraph[lightning]``) or the standalone
``pytorch_lightning``; the callback works with either's Trainer (Note [Two
namespaces of Lightning]).

Note [Two namespaces of Lightning]
Q: Lightning ships the same code twice, as ``lightning.pytorch`` and as
   ``pytorch_lightning``, with distinct classes; a user imports either, and
   may have both installed.  How does one CUDAGraphs serve both Trainers?
A: CUDAGraphs derives from the Callback of each package installed
   (_PACKAGES), lightning.pytorch's first.  A Trainer calls its callbacks'
   hooks by name; it looks at their class only where given one callback
   alone (callbacks=CUDAGraphs(): an isinstance against its own Callback,
   without which it takes the callback for a list) and where it checks that
   stateful callbacks have distinct state_keys (is_overridden("state_dict",
   callback, its own Callback), which compares code objects).  The step
   scope's checks (Note [Lightning's step graphed whole]) compare with the
   classes of the package the trainer comes from (_package_of): the
   strategy's and the precision plugin's types, the module's hooks against
   its LightningModule, another callback's hooks against the Callback that
   callback derives from (a Trainer takes the other package's callbacks in
   a list too).  Against the other package's classes the types never match,
   and the code objects match only while both packages are the same
   version (CPython's code equality leaves out the file name); so with two
   versions installed, a pytorch_lightning Trainer also takes CUDAGraphs
   for a stateful callback, and refuses two of them (one is all a fit
   needs).

Note [Lightning's step graphed whole]
Q: scope="step" graphs what Lightning's automatic optimization does for one
   training batch (_AutomaticOptimization.run: zero_grad, training_step,
   backward, clipping, the precision plugin's GradScaler, optimizer.step)
   as a make_graphed_step.  A replay runs none of the Python inside.  Which
   of Lightning's host work there must still happen on every batch, and how?
A: Four things, kept by the callback's wrapper of run (_GraphedRun):
   1. Progress counters.  run counts zero_grads and optimizer steps in
      optim_progress, which trainer.global_step (max_steps, checkpointing,
      logging intervals) reads.  The captured call moved them once; each
      replay moves them by as much (their state_dict's difference across
      the captured call).
   2. self.log.  Inside the step (its eager warm-up calls and its capture),
      the module's log is recorded, not done: each logged tensor becomes an
      output of the step, and after every call, replay or not, the wrapper
      logs it from there as Lightning would have (under the same hook name,
      with the same arguments), so on_step and on_epoch values, the progress
      bar and the loggers see each batch's value.  A Python number logged
      there (or a tensor on the host) would be the capture's value at every
      replay: the callback falls back to graphing the layers instead, logged.
   3. One graphed step per phase.  With accumulate_grad_batches=k, run zeroes
      the grads at the first micro-batch of k and steps the optimizer at the
      last one (and at an epoch's last batch): up to four programs, each its
      own graphed step, warmed up and captured when first met (keyed also by
      k, which divides the loss, and by whether backward runs).  All of them
      must read and write the same grads, so with k > 1 optimizer.zero_grad
      zeroes them in place inside the steps (set_to_none=False): the grads
      are made by the first backward and never move (0 + g is g, bitwise),
      at the cost of a memset and of an add per parameter.  With k = 1 the
      one graph zeroes as the module asks.  A batch of another shape than
      its phase's graph took (a short last batch) runs eagerly, zeroing in
      place too, so the grads stay the ones the graphs use.  A frozen
      parameter's grad is set to None there, as eager's zero_grad leaves it,
      so that no step moves it (AdamW's weight decay would); a trainable one
      that no micro-batch of a window used keeps a zero grad, which the
      optimizer steps where eager's skips it (README, Limits).
   4. The grads stay the graphs'.  Lightning sets them to None before each
      validation (on_validation_model_zero_grad), and so may a user's hook;
      a graph would then write grads nobody holds, into memory that may
      have been handed out again.  The wrapper holds the grads as the last
      capture left them and puts back any that was replaced before each
      call (a pointer compare per parameter).
   What the graphs fixed at capture beyond that, which parameters train and
   the optimizer's param groups, is compared before each call: a change (a
   fine-tuning callback unfreezing a backbone) graphs every phase again.
   Python in training_step and in the hooks that run inside run runs once,
   at capture, as in any graphed step.  So a module or another callback
   that overrides such a hook (optimizer_step, on_after_backward, ...), a
   module that optimizes manually, a strategy other than one device or DDP
   (or DDP with a communication hook or model averaging, which count
   iterations on the host), or a precision plugin other than autocast, half
   or full precision is graphed by layers instead, with the reason logged;
   so is a step whose capture fails (logged as a warning, with the error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections import OrderedDict
from typing import Callable, NamedTuple

import torch
from torch.utils import _pytree as pytree

from ._capture import patched
from ._describe import CONSTANT_TYPES
from ._layers import NoBlocks, graph_layers_once
from ._step import GraphedStep, make_graphed_step

__all__ = ["CUDAGraphs"]

log = logging.getLogger("cgraph")

SCOPES = ("layers", "step")

# Hooks that Lightning's run calls inside the step (Note [Lightning's step
# graphed whole]): overridden, their Python would run once, at capture.
_MODULE_HOOKS_INSIDE = ("backward", "on_before_backward", "on_after_backward",
                        "on_before_optimizer_step", "optimizer_step", "optimizer_zero_grad",
                        "on_before_zero_grad", "configure_gradient_clipping", "clip_gradients")
_CALLBACK_HOOKS_INSIDE = ("on_before_backward", "on_after_backward", "on_before_optimizer_step",
                          "on_before_zero_grad")


class _Package(NamedTuple):
    """The classes of one of Lightning's two namespaces that the callback
    compares with (Note [Two namespaces of Lightning])."""

    Trainer: type
    LightningModule: type
    Callback: type
    strategies: tuple  # those the step scope graphs
    precisions: tuple  # the precision plugins it graphs
    is_overridden: Callable


def _load(name: str) -> _Package | None:
    """The package's classes, or None where it is not installed.  One that
    is installed but fails to import raises its own error."""
    try:
        root = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in (name, name.split(".")[0]):
            raise
        return None
    precision = importlib.import_module(f"{name}.plugins.precision")
    strategies = importlib.import_module(f"{name}.strategies")
    helpers = importlib.import_module(f"{name}.utilities.model_helpers")
    return _Package(root.Trainer, root.LightningModule, root.Callback,
                    (strategies.SingleDeviceStrategy, strategies.DDPStrategy),
                    (precision.Precision, precision.MixedPrecision, precision.HalfPrecision),
                    helpers.is_overridden)


def _packages() -> tuple[_Package, ...]:
    """The namespaces installed.  One that fails to import beside one that
    works (a stale pytorch_lightning next to lightning) is left out, logged;
    where none works, the first failure is raised."""
    loaded, failures = [], []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            package = _load(name)
        except Exception as e:  # noqa: BLE001 (kept, and raised where nothing loads)
            failures.append((name, e))
            continue
        if package is not None:
            loaded.append(package)
    if not loaded and failures:
        raise failures[0][1]
    if not loaded:
        raise ImportError("cgraph: cgraph.lightning needs Lightning: pip install lightning "
                          "(or pip install cgraph[lightning]); the standalone "
                          "pytorch_lightning works as well.")
    for name, e in failures:
        log.debug("cgraph.lightning: %s did not import (%s: %s); left out", name,
                  type(e).__name__, e)
    return tuple(loaded)


_PACKAGES = _packages()
_CALLBACK_BASES = tuple(package.Callback for package in _PACKAGES)


class CUDAGraphs(*_CALLBACK_BASES):
    """Graphs the LightningModule's training when training starts (after
    the strategy has set the module up, DDP wrapping it, and after the
    sanity-check validation, which runs under ``torch.inference_mode``,
    where torch up to 2.11 must not capture a process's first graph,
    pytorch#172706).

    ``scope="layers"`` (the default) graphs the repeated blocks
    (:func:`cgraph.graph_layers`): each captures on its first call, one graph
    per shape, train and eval mode, and autocast state.
    ``precision="16-mixed"`` or ``"bf16-mixed"``, ``accumulate_grad_batches``
    and the validation loop keep working, and ``self.log`` is untouched.
    Keywords go to :func:`cgraph.graph_layers` (``layers=``, ``pool=``,
    ``buckets=``, ``max_graphs=``...).

    ``scope="step"`` graphs the whole automatic-optimization step of each
    training batch (zero_grad, ``training_step``, backward, clipping, the
    precision plugin's GradScaler, the optimizer) with
    :func:`cgraph.make_graphed_step`, after three eager steps; LR
    schedulers, ``self.log`` of tensors, ``accumulate_grad_batches``, both
    mixed precisions and DDP keep working, validation runs eagerly (Note
    [Lightning's step graphed whole] in cgraph/lightning.py).  Python in
    ``training_step`` runs once, at capture, as in any graphed step.  Where
    the loop cannot be graphed whole (manual optimization, a hook overridden
    inside the step, another strategy), it graphs the layers instead and
    logs why; the keywords then go to :func:`cgraph.graph_layers`.

    One class for ``lightning.Trainer`` and ``pytorch_lightning.Trainer``
    alike (Note [Two namespaces of Lightning])."""

    def __init__(self, scope: str = "layers", **graph_layers_kwargs):
        if scope not in SCOPES:
            raise ValueError(f"cgraph: CUDAGraphs: scope must be one of {SCOPES}, got {scope!r}.")
        self.scope = scope
        self.graph_layers_kwargs = graph_layers_kwargs
        self._run: _GraphedRun | None = None
        # scope="step": the graphed steps' counts ("eager", "captures",
        # "replays", "phases") when the last fit ended or fell back.
        self.stats: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if getattr(pl_module, "_compiler_ctx", None):  # trainer.fit(torch.compile(module))
            raise ValueError(
                "cgraph: CUDAGraphs: the LightningModule was compiled whole (torch.compile), "
                "around the blocks the callback would graph. Fit the module uncompiled; to "
                "compile as well, compile each block's forward (block.forward = "
                "torch.compile(block.forward)): cgraph graphs compiled forwards.")
        if self.scope == "step":
            why = _why_not_the_step(trainer, pl_module, self)
            if why is None:
                self._run = _GraphedRun(trainer, pl_module, self._fall_back)
                return
            log.info("cgraph: CUDAGraphs(scope='step'): %s; graphing the layers instead.", why)
            self._graph_layers_instead(pl_module)
            return
        graph_layers_once(pl_module, "CUDAGraphs", **self.graph_layers_kwargs)

    def _fall_back(self, trainer, pl_module) -> None:
        """The step cannot be graphed after all (_GraphedRun found why):
        from the next batch on, the layers are."""
        self._remove_run()
        self._graph_layers_instead(pl_module)

    def _graph_layers_instead(self, pl_module) -> None:
        """scope="step" could not graph the step: the layers then, or, where
        the model has no repeated blocks, nothing (training goes on eagerly,
        logged) rather than an error in the middle of a fit.  Any other
        refusal of graph_layers (a wrong keyword or path) is raised."""
        try:
            graph_layers_once(pl_module, "CUDAGraphs", **self.graph_layers_kwargs)
        except NoBlocks as exc:
            log.warning("cgraph: CUDAGraphs(scope='step'): the layers cannot be graphed "
                        "either (%s); training runs eagerly.", exc)

    def on_train_end(self, trainer, pl_module) -> None:
        self._remove_run()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._remove_run()

    def _remove_run(self) -> None:
        if self._run is not None:
            self.stats = self._run.remove()
            self._run = None


def _why_not_the_step(trainer, module, callback) -> str | None:
    """Why Lightning's loop for this fit cannot be graphed whole, or None."""
    if not module.automatic_optimization:
        return ("the module optimizes manually (automatic_optimization=False), with its own "
                "Python between the kernels")
    package = _package_of(trainer)
    if package is None:
        return (f"the trainer is a {type(trainer).__name__}, not a lightning.Trainer or a "
                "pytorch_lightning.Trainer")
    strategy, precision = trainer.strategy, trainer.precision_plugin
    if type(strategy) not in package.strategies:
        return f"the step graphs one device or DDP, not the {type(strategy).__name__} strategy"
    if (getattr(strategy, "_ddp_comm_hook", None) is not None
            or getattr(strategy, "_model_averager", None) is not None):
        return ("DDP's communication hook or model averaging keeps host-side state (its "
                "iteration count), which a replay would not move")
    if strategy.handles_gradient_accumulation:
        return f"the {type(strategy).__name__} strategy accumulates gradients itself"
    if type(precision) not in package.precisions:
        return (f"the step graphs autocast, half or full precision, not the "
                f"{type(precision).__name__} plugin")
    for hook in _MODULE_HOOKS_INSIDE:
        if package.is_overridden(hook, module, package.LightningModule):
            return (f"{type(module).__name__}.{hook} is overridden, and its Python would run "
                    "only once, at capture")
    for other in trainer.callbacks:
        # A Trainer takes a list holding the other package's callbacks too.
        base = next((c for c in type(other).__mro__ if c in _CALLBACK_BASES), package.Callback)
        for hook in _CALLBACK_HOOKS_INSIDE:
            if other is not callback and package.is_overridden(hook, other, base):
                return (f"the {type(other).__name__} callback's {hook} would run only once, "
                        "at capture")
    return None


def _package_of(trainer) -> _Package | None:
    """The namespace the trainer's class comes from (a subclass's too)."""
    return next((p for p in _PACKAGES if isinstance(trainer, p.Trainer)), None)


class _Phase(NamedTuple):
    """Which program Lightning's run is for a batch: Note [Lightning's step
    graphed whole] item 3."""

    zero_grad: bool
    optimizer_steps: bool
    accumulate: int  # the loss is divided by it (GradientAccumulationScheduler changes it)
    backward: bool  # not skipped (Lightning skips it in SWA's BatchNorm epoch)


@dataclasses.dataclass
class _Logged:
    """One ``self.log`` call inside the step; its value is an output of the
    step (Note [Lightning's step graphed whole] item 2)."""

    fx: str  # the hook it was called from (Lightning validates on_step/on_epoch by it)
    name: str
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class _PhaseStep:
    """The graphed step of one phase."""

    step: GraphedStep
    batch: tuple  # the batch's signature its graph takes: _signature
    logged: list  # the _Logged of its last call inside cgraph
    moved: dict | None = None  # the progress its captured call moved; None: not captured


class _Call(NamedTuple):
    """One call of Lightning's run, as the step's body needs it."""

    optimizer: torch.optim.Optimizer
    batch_idx: int
    kwargs: OrderedDict
    entry: _PhaseStep
    # The progress counters before this call, where it captures its phase's
    # step (None: a warm-up call or a replay): what the capture moved them by
    # (item 1), and what a failed capture puts back.
    progress: dict | None


class _GraphedRun:
    """Lightning's automatic-optimization run of one training batch, graphed:
    it replaces ``run`` on the fit loop's _AutomaticOptimization for the fit
    (Note [Lightning's step graphed whole])."""

    def __init__(self, trainer, module, fall_back):
        self.trainer, self.module, self.fall_back = trainer, module, fall_back
        self.loop = trainer.fit_loop.epoch_loop.automatic_optimization
        self.lightning_run = self.loop.run  # Lightning's own, bound
        self.phases: dict[_Phase, _PhaseStep] = {}
        self.call: _Call | None = None  # what the step's body runs, for this call
        self.ran = False  # whether the body ran for this call already
        self.refused: str | None = None  # why the step cannot be graphed, found inside it
        self.eager_shapes = False  # logged that a batch of another shape ran eagerly
        self.eager_in_a_row = 0  # batches in a row of another shape: warned at _EAGER_WARNING_AT
        # (parameter, its grad) as the last capture left them: item 4.
        self.grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.params = list(module.parameters())
        self.layout: tuple | None = None  # _check_layout
        self.loop.run = self

    def remove(self) -> dict:
        """Lightning's run back, every graph freed; returns the steps' stats
        summed over the phases (logged)."""
        self.loop.__dict__.pop("run", None)
        stats = {"phases": len(self.phases), "eager": 0, "captures": 0, "replays": 0}
        for phase in self.phases.values():
            for key, value in phase.step.stats.items():
                stats[key] += value
            phase.step.reset()
        self.phases.clear()
        log.info("cgraph: CUDAGraphs(scope='step'): %(replays)d step(s) replayed, %(eager)d "
                 "eager, %(captures)d capture(s) of %(phases)d phase(s).", stats)
        return stats

    def __call__(self, optimizer, batch_idx: int, kwargs: OrderedDict):
        if "batch" not in kwargs:  # training_step(dataloader_iter)
            return self._refuse("training_step takes the dataloader's iterator, whose batches "
                                "the step cannot copy in", optimizer, batch_idx, kwargs)
        batch = kwargs["batch"]
        self._check_layout(optimizer)
        phase = self._phase(batch_idx)
        signature = _signature(batch)
        if signature is None:
            return self._refuse(f"the batch is a {type(batch).__name__}, whose parts are not "
                                "all tensors or constants", optimizer, batch_idx, kwargs)
        entry = self.phases.get(phase)
        if entry is None:
            entry = self.phases[phase] = _PhaseStep(
                make_graphed_step(self._body), signature, [])
        if entry.batch != signature:
            return self._eagerly(optimizer, batch_idx, kwargs, entry.batch, signature)
        self.eager_in_a_row = 0
        return self._through_the_step(entry, optimizer, batch_idx, kwargs)

    def _through_the_step(self, entry: _PhaseStep, optimizer, batch_idx: int,
                          kwargs: OrderedDict):
        """This batch's run through its phase's graphed step (a warm-up, the
        capture, or a replay), with Lightning's books kept: Note
        [Lightning's step graphed whole] items 1, 2 and 4."""
        self._grads_back()
        step, progress = entry.step, self.loop.optim_progress
        ran, captures_before = step.stats["eager"] + step.stats["captures"], step.stats["captures"]
        captures = step.graphed is None and step.stats["eager"] >= step.num_warmup_iters
        before = progress.state_dict() if captures else None
        self.call, self.ran = _Call(optimizer, batch_idx, kwargs, entry, before), False
        try:
            out, values = step(kwargs["batch"])
        except Exception as exc:
            if not captures:
                raise
            log.warning("cgraph: CUDAGraphs(scope='step'): the step's capture failed (%s: %s); "
                        "graphing the layers instead.", type(exc).__name__, exc)
            self._undo_capture(before)
            return self._refuse(None, optimizer, batch_idx, kwargs)
        finally:
            self.call = None
        if step.stats["eager"] + step.stats["captures"] == ran:  # a replay: item 1
            progress.load_state_dict(_moved_by(progress.state_dict(), entry.moved))
        elif step.stats["captures"] > captures_before:  # item 4
            self.grads = [(p, p.grad) for p in self.params if p.grad is not None]
        self._log(entry.logged, values)
        if self.refused is not None:
            self._refuse(self.refused, None, batch_idx, kwargs)
        return out

    def _phase(self, batch_idx: int) -> _Phase:
        """What run will do for this batch, decided as run decides it."""
        trainer, backward = self.trainer, not self.loop._skip_backward
        zero = backward and batch_idx % trainer.accumulate_grad_batches == 0
        steps = (trainer.strategy.handles_gradient_accumulation
                 or not trainer.fit_loop._should_accumulate())
        return _Phase(zero, steps, trainer.accumulate_grad_batches, backward)

    def _body(self, batch):
        """The step make_graphed_step warms up and captures: Lightning's run
        for this call's batch, logs recorded, progress moved noted."""
        call, entry = self.call, self.call.entry
        # A capture the step dropped (Note [GradScaler with any optimizer] in
        # cgraph/_step.py) ran this body once already: the same call, now
        # eager, starts from the state before it, and captured nothing.
        rerun = call.progress is not None and self.ran
        if rerun:
            self._undo_capture(call.progress)
            entry.moved = None
        self.ran = True
        kwargs = OrderedDict(call.kwargs)
        kwargs["batch"] = batch
        logged: list = []
        with self._recording(logged), self._zeroing_in_place(call.optimizer):
            out = self.lightning_run(call.optimizer, call.batch_idx, kwargs)
        if call.progress is not None and not rerun:
            entry.moved = _difference(self.loop.optim_progress.state_dict(), call.progress)
        entry.logged = [record for record, _ in logged]
        return out, tuple(value for _, value in logged)

    @contextlib.contextmanager
    def _recording(self, logged: list):
        """self.log records its value into `logged` (Note [Lightning's step
        graphed whole] item 2); a value that is not a tensor refuses the
        step from the next batch on."""
        module, run = self.module, self

        def record(name, value, *args, **kwargs):
            if isinstance(value, torch.Tensor) and value.device == module.device:
                value = value.detach().clone()  # its value now, as Lightning's log copies it
            elif run.refused is None:
                what = (f"tensor on {value.device}" if isinstance(value, torch.Tensor)
                        else type(value).__name__)
                run.refused = (f"self.log({name!r}, ...) in {module._current_fx_name} logs a "
                               f"{what}, which every replay would log again as it was at "
                               f"capture (log a tensor on {module.device} to graph the step)")
            logged.append((_Logged(module._current_fx_name, name, args, kwargs), value))

        with patched({(module, "log"): record}):
            yield

    def _zeroing_in_place(self, optimizer):
        """Note [Lightning's step graphed whole] item 3: zero_grad zeroes in
        place when several phases share the grads, or once a graph holds
        them and this call runs eagerly."""
        if self.trainer.accumulate_grad_batches == 1 and not self._graphed():
            return contextlib.nullcontext()
        zero_grad = optimizer.zero_grad

        def in_place(set_to_none: bool = True):
            zero_grad(set_to_none=False)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if not p.requires_grad:  # frozen: no grad, so the step skips it
                        p.grad = None

        return patched({(optimizer, "zero_grad"): in_place})

    def _check_layout(self, optimizer) -> None:
        """What the graphs fixed at capture: which parameters train and the
        optimizer's param groups.  A fine-tuning callback that unfreezes a
        backbone or adds a param group changes it: every phase is then
        warmed up and captured again (logged)."""
        layout = (tuple(p.requires_grad for p in self.params),
                  tuple(len(group["params"]) for group in optimizer.param_groups))
        if layout == self.layout:
            return
        if self.phases:
            log.info("cgraph: CUDAGraphs(scope='step'): the parameters that train or the "
                     "optimizer's param groups changed; the step is graphed again.")
            for entry in self.phases.values():
                entry.step.reset()
            self.phases.clear()
            self.grads = []
        self.layout = layout

    def _grads_back(self) -> None:
        """The grads the graphs read and write, back on their parameters
        where something set them to None (Note [Lightning's step graphed
        whole] item 4)."""
        for param, grad in self.grads:
            if param.grad is not grad:
                param.grad = grad

    def _graphed(self) -> bool:
        return any(entry.moved is not None for entry in self.phases.values())

    def _log(self, logged: list, values: tuple) -> None:
        """self.log of each recorded value, as Lightning's run would have."""
        module = self.module
        fx = module._current_fx_name
        try:
            for record, value in zip(logged, values):
                module._current_fx_name = record.fx
                module.log(record.name, value, *record.args, **record.kwargs)
        finally:
            module._current_fx_name = fx

    def _eagerly(self, optimizer, batch_idx: int, kwargs: OrderedDict, graphed: tuple,
                 signature: tuple):
        """Lightning's run, eagerly: a batch of another shape than its
        phase's graph takes (Note [Lightning's step graphed whole] item 3);
        a short last batch logs once, batches that all differ (a string or
        an id in each) warn once, at the _EAGER_WARNING_AT-th in a row."""
        if not self.eager_shapes:
            self.eager_shapes = True
            log.info("cgraph: CUDAGraphs(scope='step'): batch %d differs from the batches the "
                     "step was graphed with (%s); such batches run eagerly.", batch_idx,
                     _describe(kwargs.get("batch")))
        self.eager_in_a_row += 1
        if self.eager_in_a_row == _EAGER_WARNING_AT:
            log.warning("cgraph: CUDAGraphs(scope='step'): the last %d batches each differed "
                        "from the batches the step was graphed with, and ran eagerly: %s",
                        self.eager_in_a_row, _difference_named(graphed, signature))
        return self._run_eagerly(optimizer, batch_idx, kwargs)

    def _run_eagerly(self, optimizer, batch_idx: int, kwargs: OrderedDict):
        self._grads_back()
        with self._zeroing_in_place(optimizer):
            return self.lightning_run(optimizer, batch_idx, kwargs)

    def _undo_capture(self, progress: dict) -> None:
        """Lightning's host state as before a capture that failed (a capture
        runs no kernel): the progress counters it moved, the GradScaler's
        record of unscale_ (a defaultdict: cleared, its states are fresh)."""
        self.loop.optim_progress.load_state_dict(progress)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler._per_optimizer_states.clear()

    def _refuse(self, why: str | None, optimizer, batch_idx: int, kwargs: OrderedDict):
        """Graph the layers from the next batch on; this batch's run, if
        `optimizer` is given, eagerly now."""
        if why is not None:
            log.info("cgraph: CUDAGraphs(scope='step'): %s; graphing the layers instead.", why)
        out = None if optimizer is None else self._run_eagerly(optimizer, batch_idx, kwargs)
        self.fall_back(self.trainer, self.module)
        return out


def _signature(batch) -> tuple | None:
    """What a graph of the batch fixes: each tensor's shape, dtype, device
    and strides, each constant's value; None if a part is neither."""
    leaves, spec = pytree.tree_flatten(batch)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride()))
        elif isinstance(leaf, CONSTANT_TYPES):
            parts.append((type(leaf), leaf))
        else:
            return None
    return (spec, tuple(parts))


# Batches in a row that run eagerly, each unlike the graphed one, before a warning.
_EAGER_WARNING_AT = 10


def _difference_named(graphed: tuple, batch: tuple) -> str:
    """What differs between two _signatures, and what to do."""
    (spec, parts), (spec_now, parts_now) = graphed, batch
    if spec != spec_now or len(parts) != len(parts_now):
        return "the batch's structure changes. Give every batch one structure."
    i, was, now = next((i, a, b) for i, (a, b) in enumerate(zip(parts, parts_now)) if a != b)
    if isinstance(was[0], type):
        return (f"part {i} of the batch, a {was[0].__name__}, was {was[1]!r} and is now "
                f"{now[1]!r}: a graph bakes constants in. Leave values that change with "
                "every batch (names, paths, ids) out of the batch, or pass them as tensors.")
    return (f"part {i} of the batch, a tensor, was {was} and is now {now} (shape, dtype, "
            "device, strides). Pad batches to one shape, or graph the layers "
            "(scope='layers'), which capture once per shape.")


def _describe(batch) -> str:
    shapes = [tuple(x.shape) for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    return "tensors of shapes " + ", ".join(map(str, shapes))


def _difference(after: dict, before: dict) -> dict:
    """after - before, for nested dicts of counters."""
    return {key: _difference(value, before[key]) if isinstance(value, dict)
            else value - before[key] for key, value in after.items()}


def _moved_by(state: dict, moved: dict) -> dict:
    """state + moved, for nested dicts of counters."""
    return {key: _moved_by(value, moved[key]) if isinstance(value, dict)
            else value + moved[key] for key, value in state.items()}

