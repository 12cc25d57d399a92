"""The train/eval modes a graph was captured in, compared before each
replay: a graphed step's (Note [The modules a graphed step's modes are read
from]) and the submodules' of a graphed module (Note [Submodules' modes in
per-module graphs])."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Callable, Iterator, NamedTuple

import torch
from torch import nn

from . import _C

# Note [The modules a graphed step's modes are read from]
# Q: A graph bakes in every `if self.training` of the step's modules
#    (dropout on or off, BatchNorm's batch statistics and running-stat
#    updates).  A step is a plain function: which modules' modes does a
#    replay compare with the capture's, without a walk of every module?
# A: The modules the step's code names, found once per capture: the values
#    of its closure and of the globals it reads (a model, a loss module),
#    a bound method's object and the modules among its attributes (a
#    LightningModule's step, a trainer object's), a functools.partial's
#    arguments, one call deeper into the functions it names (a
#    compute_loss(model, x) helper's own globals), the modules held one
#    level down in a plain container or object the step names (a trainer
#    object's model, ``models["policy"]``), and the DDP models it calls;
#    with their submodules.  Of those, only the modules whose own
#    methods (their class's, below nn.Module) name ``training`` are kept,
#    with every root: Dropout, BatchNorm, an attention block's dropout; a
#    Linear's or a LayerNorm's mode changes nothing.  Before each replay one
#    native call (_C.modes_are) compares their flags with the capture's: a
#    dict lookup and a pointer compare per module, about 16 ns each on the
#    CI machine.  A change (``model.eval()`` then a graphed training
#    step; ``bn.eval()`` to freeze BatchNorm mid-training) captures again.
#    Not seen: a module reached only through deeper containers or calls,
#    and ``training`` read by code outside such a module's methods; after
#    switching those, reset the step (README, Limits).
_DEPTH = 2  # the step, and the functions it names

# Note [Submodules' modes in per-module graphs]
# Q: A graphed module's graphs are keyed by its own train/eval mode, read on
#    every call.  A submodule's mode changed after capture (a BatchNorm put
#    in eval to freeze it, model.apply(freeze_bn), a dropout switched off)
#    is baked into the graphs just the same: what sees it?
# A: Each capture records, in CallableSpec.modes, the submodules whose
#    class's methods name ``training`` (as a graphed step keeps its modules,
#    above) and their flags then; the module's own flag is
#    CallableSpec.training.  The call path (csrc/graphed.c: entry_takes,
#    call_one) compares them natively after the module's own mode and, with
#    several graphs, after the shapes, for the one entry that fits: a
#    lookup in the submodule's instance dict and a pointer compare, about
#    16 ns each on the CI machine (a Llama decoder layer keeps one, its
#    attention; a Linear or a LayerNorm is not kept; a whole 12-layer GPT-2
#    keeps 50, 0.8 us per call).  A call in
#    other modes is another graph's, or a new capture's, as a call in the
#    module's other mode is; with one graph (torch's rules) it runs
#    eagerly, as torch runs the other mode.  A submodule replaced after
#    capture is StateCheck's (cgraph/_describe.py): it raises.


class Modes(NamedTuple):
    """Modules whose modes a graph baked in, and those modes
    (CallableSpec.modes, _C.modes_are)."""

    modules: tuple
    modes: tuple

    @classmethod
    def under(cls, found: list) -> "Modes":
        """A step's: those of the modules `found` (its roots, from roots())
        and of their submodules, roots included."""
        modules: dict = {}
        for root in found:
            for m in root.modules():
                if m is root or _reads_training(type(m)):
                    modules.setdefault(id(m), m)
        return cls.now(tuple(modules.values()))

    @classmethod
    def inside(cls, module: nn.Module) -> "Modes":
        """A graphed module's: its submodules that read their mode (its own
        mode is CallableSpec.training)."""
        return cls.now(tuple(m for m in module.modules()
                             if m is not module and _reads_training(type(m))))

    @classmethod
    def now(cls, modules: tuple) -> "Modes":
        return cls(modules, tuple(m.training for m in modules))

    def same(self) -> bool:
        return _C.modes_are(self.modules, self.modes)

    def first_changed(self) -> str:
        """The first module whose mode changed, for the log."""
        for m, mode in zip(self.modules, self.modes):
            if m.training is not mode:
                return f"{type(m).__name__} was switched to {'train' if m.training else 'eval'}"
        return "nothing"


def roots(fn: Callable, models: list) -> list:
    """The modules a step's code names (Note [The modules a graphed step's
    modes are read from]) and `models` (the DDP models it calls), once each."""
    return list({id(m): m for m in (*_modules_named_by(fn, _DEPTH, set()), *models)}.values())


def _modules_named_by(fn, depth: int, seen: set) -> Iterator[nn.Module]:
    """The modules `fn`'s code names, and those of the functions it names,
    `depth` levels deep."""
    if depth == 0 or id(fn) in seen:
        return
    seen.add(id(fn))
    fn = inspect.unwrap(fn)  # functools.wraps, a torch.compile'd function or method
    if isinstance(fn, nn.Module):
        yield fn
        return
    if isinstance(fn, functools.partial):
        yield from _named_values((*fn.args, *fn.keywords.values()), depth, seen)
        yield from _modules_named_by(fn.func, depth, seen)
        return
    if inspect.ismethod(fn):
        yield from _named_values((fn.__self__, *_attributes(fn.__self__)), depth, seen)
        fn = fn.__func__
    if not inspect.isfunction(fn):  # a callable object: its attributes, its __call__
        yield from _named_values(_attributes(fn), depth, seen)
        call = getattr(type(fn), "__call__", None)
        if inspect.isfunction(call):
            yield from _modules_named_by(call, depth, seen)
        return
    try:
        names = inspect.getclosurevars(fn)
    except (TypeError, ValueError):  # no code to read
        return
    defaults = (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())
    yield from _named_values((*names.nonlocals.values(), *names.globals.values(), *defaults),
                             depth, seen)


def _attributes(obj) -> list:
    """The values of `obj`'s instance attributes; none where it has none to
    read (slots, a builtin, a __dict__ that raises)."""
    try:
        return list(vars(obj).values())
    except Exception:  # noqa: BLE001 -- what it holds is a guess either way
        return []


def _named_values(values, depth: int, seen: set) -> Iterator[nn.Module]:
    for value in values:
        if isinstance(value, nn.Module):
            yield value
        elif isinstance(value, type):
            continue
        elif callable(value):
            yield from _modules_named_by(value, depth - 1, seen)
        elif depth > 1 and id(value) not in seen:
            seen.add(id(value))
            yield from _named_values(_held_values(value), depth - 1, seen)


_MAX_HELD = 64  # a longer container is data (a list of batches), not models


def _held_values(value) -> list:
    """What a plain container or object holds, one level down: a dict's
    values, a short list's or tuple's items, an instance's attributes (a
    trainer object's model, ``models["policy"]``); nothing for tensors,
    strings and Python modules."""
    if isinstance(value, dict):
        held = list(value.values())
    elif isinstance(value, (list, tuple)):
        held = list(value)
    elif isinstance(value, (torch.Tensor, str, bytes, types.ModuleType)):
        return []
    else:
        held = _attributes(value)
    return held if len(held) <= _MAX_HELD else []


@functools.lru_cache(maxsize=None)
def _reads_training(cls: type) -> bool:
    """Whether a method of `cls` below nn.Module names ``training``."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            continue
        for value in vars(klass).values():
            code = getattr(inspect.unwrap(value) if callable(value) else value, "__code__", None)
            if code is not None and "training" in _names_in(code):
                return True
    return False


def _names_in(code) -> set:
    """The names `code` and the functions defined in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names_in(const)
    return names
