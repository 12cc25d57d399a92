"""Describing a callable to the native core: what to call, its samples, and
how later calls are checked (the fields of ``_C.CallableSpec``).

The first capture and every later one (cgraph/_regraph.py) describe their
callable here, from one :class:`Target` made once per callable: a later
capture must not look at the module again (its ``forward`` is the graphed
callable by then, and hooks may have been registered since)."""

from __future__ import annotations

import enum
import functools
import inspect
import weakref
from typing import Any, NamedTuple, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import _C, _dtensor, _fsdp
from ._buckets import Bucketed
from ._modes import Modes

# Non-tensor arguments a graph can bake in as constants: each call must pass
# the captured value again (checked in C on every call).
CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype,
                  torch.device, torch.layout, torch.memory_format)

# Containers whose contents are the arguments.  Any other object a pytree
# can flatten (transformers registers its caches) is the callable's to
# change, which no replay would do: refused by _check_containers.
_CONTAINERS = (tuple, list, dict)


# Note [None among the outputs]
# Q: Hugging Face blocks return None beside their hidden states (DeBERTa-v2,
#    Falcon: (hidden, None); T5's encoder: (hidden, bias, None)): the
#    attention weights or cache they were not asked for.  A graph replays
#    tensors only.  How does a graphed block return them?
# A: As None, where the block put it.  The native capture flattens a
#    callable's outputs with flatten_outputs (csrc/capture.c output_leaves):
#    each None becomes a _NoneOutput, a pytree node with no leaves whose
#    rebuild is None, so the graph's outputs are the tensors alone and the
#    TreeSpec the replay rebuilds with puts each None back.  Other
#    non-tensor outputs are still refused (README, Limits).
class _NoneOutput:
    """A None among a graphed callable's outputs: Note [None among the outputs]."""

    __slots__ = ()


_NONE = _NoneOutput()
pytree.register_pytree_node(_NoneOutput, lambda node: ([], None),
                            lambda leaves, context: None,
                            serialized_type_name="cgraph._describe._NoneOutput")


def flatten_outputs(out) -> tuple[list, pytree.TreeSpec]:
    """(leaves, spec) of a callable's outputs with no None among the leaves:
    Note [None among the outputs]."""
    return pytree.tree_flatten(pytree.tree_map(lambda x: _NONE if x is None else x, out))


class Constant(NamedTuple):
    """A non-tensor sample argument captured into the graph: each call must
    pass the same value again (checked in csrc/arguments.c)."""

    position: int  # among the pytree leaves of (args, kwargs)
    name: str
    value: Any


class Default(NamedTuple):
    """A parameter of the callable the samples leave out, with a default a
    call may pass again (checked in csrc/arguments.c)."""

    name: str
    position: int  # its position among the positional parameters; -1: keyword only
    value: Any
    by_keyword: bool  # it may be passed by keyword


class Target(NamedTuple):
    """One callable, looked at once: what to call and how to run it eagerly
    (CallableSpec's target fields, but ``training`` and ``modes``, which
    each capture reads afresh), and the signature its arguments bind to."""

    index: int  # position among the callables graphed together
    fn: Any  # the callable: weakly, for a module (module.forward holds the Graphed)
    fields: dict
    signature: inspect.Signature | None

    @classmethod
    def of(cls, index: int, fn) -> "Target":
        if not callable(fn):
            raise TypeError(f"cgraph: callable {index} is a {type(fn).__name__}, not callable.")
        try:
            signature = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)
        except (TypeError, ValueError):
            signature = None
        held = weakref.ref(fn) if isinstance(fn, nn.Module) else fn
        return cls(index, held, _target_fields(index, fn), signature)

    def callable(self):
        """The callable, or None for a module that no longer exists."""
        return self.fn() if isinstance(self.fn, weakref.ref) else self.fn

    def run_eagerly(self, args: tuple, kwargs: dict):
        """What the callable returns for this call without graphs, called
        the way the native core's eager path calls it (graphed.c's
        call_eager, from the same fields)."""
        fields = self.fields
        if fields["module"] is None:
            return fields["function"](*args, **kwargs)
        module = fields["module"]()
        if module is None:
            raise RuntimeError("cgraph: the graphed module no longer exists.")
        if fields["eager_takes_module"]:
            return fields["eager"](module, *args, **kwargs)
        return fields["eager"](*args, **kwargs)


class Draft(NamedTuple):
    """A callable's description, checked, short of the device, which depends
    on every callable and on CUDA (checked after the arguments)."""

    fields: dict  # CallableSpec's fields but the device
    leaves: list  # every pytree leaf of (args, kwargs)


def draft(target: Target, args, kwargs, claimed: set[int]) -> Draft:
    """Describes a call of `target` with these samples.  `claimed`: sample
    memory already used as a static input (see _static_input)."""
    index, fn = target.index, target.callable()
    if not isinstance(args, tuple):
        hint = " (write (x,) for one tensor)" if isinstance(args, torch.Tensor) else ""
        raise TypeError(
            f"cgraph: sample args of callable {index} must be a tuple{hint}, "
            f"got {type(args).__name__}."
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(
            f"cgraph: sample_kwargs of callable {index} must be a dict of keyword "
            f"arguments, got {type(kwargs).__name__}."
        )
    kwargs = dict(sorted(kwargs.items()))  # calls are flattened in this order too
    _check_containers(index, target.signature, args, kwargs)
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    _dtensor.refuse_dtensors(leaves, "takes")
    leaves = [_static_input(leaf, claimed) if isinstance(leaf, torch.Tensor) else leaf
              for leaf in leaves]
    args, kwargs = pytree.tree_unflatten(leaves, in_spec)
    names = leaf_names(target.signature, args, kwargs)
    tensors, tensor_names, constants = _classify_leaves(index, leaves, names)
    flat = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
    module = isinstance(fn, nn.Module)
    if module:
        _refuse_weight_hooks(index, fn)
        _refuse_grad_dtypes(index, fn)
    fields = dict(
        index=index, **target.fields, training=fn.training if module else False,
        modes=Modes.inside(fn) if module else Modes((), ()),
        args=args, kwargs=kwargs, kw_names=tuple(kwargs), tensors=tensors,
        names=tensor_names,
        params=tuple(map(_dtensor.local_leaf, fn.parameters())) if module else (),
        buffers=tuple(fn.buffers()) if module else (), flat=flat,
        in_spec=None if flat else in_spec, walk=None if flat else _walk(leaves, in_spec),
        constants=constants,
        defaults=_defaults(target.signature, len(args), kwargs),
        rng_warmup=None,  # cgraph/_step.py sets it: Note [RNG inside a graphed step]
    )
    return Draft(fields, leaves)


def _walk(leaves: list, in_spec) -> tuple[tuple, dict] | None:
    """What calls are walked beside in C instead of flattened (Note
    [Arguments walked in C] in csrc/arguments.c): the samples rebuilt once
    more, so that no one else holds these containers (the callable is
    called with the spec's own args and kwargs, and may change them in
    place), or None where they cannot be walked (_walkable)."""
    args, kwargs = pytree.tree_unflatten(leaves, in_spec)
    return (args, kwargs) if _walkable(args, kwargs, in_spec) else None


def _walkable(args: tuple, kwargs: dict, in_spec) -> bool:
    """Whether calls can be walked beside these samples: every container
    an exact tuple, list or dict with str keys, and the samples as
    tree_unflatten rebuilt them flattening to `in_spec` again (a
    torch.Size comes back a tuple).  Nesting too deep to compare is left
    to tree_flatten."""
    def plain(node) -> bool:
        if type(node) in (tuple, list):
            return all(map(plain, node))
        if type(node) is dict:
            return all(type(k) is str for k in node) and all(map(plain, node.values()))
        return not isinstance(node, (tuple, list, dict)) and type(node) not in pytree.SUPPORTED_NODES
    try:
        return plain((args, kwargs)) and pytree.tree_structure((args, kwargs)) == in_spec
    except RecursionError:
        return False


def device_of(drafts: Sequence[Draft]) -> int:
    """The device of the first CUDA tensor among the samples and parameters,
    else the current one: the device every graph of one call runs on."""
    for d in drafts:
        for t in (*d.leaves, *d.fields["params"]):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return t.device.index
    return torch.cuda.current_device()


def leaf_names(signature: inspect.Signature | None, args, kwargs=None) -> list[str]:
    """A readable name per pytree leaf of ``(args, kwargs)``: the forward's
    parameter name for positional arguments ('x', "batch['mask']"), the
    keyword for keyword arguments, else the leaf's path ('args[2]')."""
    positional = [] if signature is None else [
        p.name for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs or {}))[0]:
        (part, head), rest = path[:2], path[2:]
        if part.idx == 1:  # a keyword argument
            base = str(head.key)
        else:
            base = positional[head.idx] if head.idx < len(positional) else f"args[{head.idx}]"
        names.append(base + "".join(str(k) for k in rest))
    return names


def _defaults(signature: inspect.Signature | None, nargs: int,
              kwargs: dict) -> tuple[Default, ...]:
    """The parameters of the signature that the samples (nargs positional
    arguments, these keywords) leave out, whose defaults are values a call
    can be compared with: None, and the constant types.  (*args and
    **kwargs have no default, so they are never among them.)"""
    if signature is None:
        return ()
    defaults = []
    for position, p in enumerate(signature.parameters.values()):
        positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        if p.default is p.empty or (positional and position < nargs) or p.name in kwargs:
            continue
        if isinstance(p.default, CONSTANT_TYPES):
            defaults.append(Default(p.name, position if positional else -1, p.default,
                                    p.kind != p.POSITIONAL_ONLY))
    return tuple(defaults)


def _check_containers(index: int, signature: inspect.Signature | None, args, kwargs) -> None:
    """Refuses objects a pytree flattens that are not plain containers
    (named tuples are tuples).  transformers' DynamicCache is one when it is
    registered: the layer appends to it, a Python side effect no replay
    performs."""
    def visit(node, name):
        if isinstance(node, (torch.Tensor, *CONSTANT_TYPES)):
            return
        if isinstance(node, _CONTAINERS):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                visit(child, name)
        elif type(node) in pytree.SUPPORTED_NODES:
            raise _not_an_argument(index, name, node)

    names = leaf_names(signature, tuple(range(len(args))), dict.fromkeys(kwargs, 0))
    for name, value in zip(names, (*args, *kwargs.values())):
        visit(value, name)


def is_cache(value) -> bool:
    """Whether `value` is a transformers Cache (past_key_values=DynamicCache(...)),
    which a layer appends to: a Python side effect no graph replays."""
    return "Cache" in type(value).__name__


def holds_cache(tree) -> bool:
    """Whether a call's (args, kwargs) carry a Cache, in tuples, lists or
    dicts (not through pytree: transformers may register caches as nodes)."""
    if isinstance(tree, (tuple, list)):
        return any(map(holds_cache, tree))
    if isinstance(tree, dict):
        return any(map(holds_cache, tree.values()))
    return is_cache(tree)


def _not_an_argument(index: int, name: str, value) -> TypeError:
    kind = type(value).__name__
    if is_cache(value):
        return TypeError(
            f"cgraph: argument '{name}' of callable {index} is a {kind}, which the callable "
            "appends to: a Python side effect a graph replay would skip. Call the model with "
            "use_cache=False (as training does), or leave this call eager.")
    return TypeError(
        f"cgraph: sample argument '{name}' of callable {index} is a {kind}; graphed "
        "callables take tensors and constants (None, int, float, bool, str, enum, "
        "torch.dtype, ...) nested in tuples, lists or dicts. Bind other values with "
        "functools.partial.")


def _classify_leaves(index: int, leaves: list, names: list[str]):
    """The tensor leaves and their names, and the constants."""
    tensors, tensor_names, constants = [], [], []
    for position, (name, leaf) in enumerate(zip(names, leaves)):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            tensor_names.append(name)
        elif isinstance(leaf, CONSTANT_TYPES):
            constants.append(Constant(position, name, leaf))
        else:
            raise _not_an_argument(index, name, leaf)
    return tuple(tensors), tuple(tensor_names), tuple(constants)


def _target_fields(index: int, fn) -> dict:
    """What to call, and for a module how to run it eagerly and check it."""
    if not isinstance(fn, nn.Module):
        return dict(function=fn, module=None, eager=None, eager_takes_module=False,
                    verify=None)
    # The module's own hooks (FSDP2's among them) run around every call,
    # outside the graphs, as in eager (cgraph/_api.py, make_graphed); hooks
    # of FSDP modules inside it would run once, at capture; an FSDP module
    # around it frees its parameters after each forward; so do FSDP1's and
    # ZeRO-3's inside it.
    _fsdp.refuse_nested(index, fn)
    _fsdp.refuse_enclosed(index, fn)
    _fsdp.refuse_other_sharding(index, fn)
    if any(b.requires_grad for b in fn.buffers()):
        raise ValueError(
            f"cgraph: module {index} has a buffer that requires grad; only parameters "
            "may be trainable in a graphed module (make it an nn.Parameter)."
        )
    own = fn.__dict__.get("forward")
    if is_graphed_callable(own):
        raise ValueError(f"cgraph: module {index} ({type(fn).__name__}) {GRAPHED_ALREADY}; "
                         f"{GRAPHED_ALREADY_FIX}")
    eager, takes_module = (type(fn).forward, True) if own is None else (own, False)
    if any(map(_dtensor.is_dtensor, fn.parameters())):
        # Note [DTensor parameters in per-layer graphs] (cgraph/_dtensor.py),
        # for an instance forward too (block.forward = torch.compile(block.forward))
        if own is not None:
            eager = lambda module, *args, **kwargs: own(*args, **kwargs)  # noqa: E731
        eager, takes_module = _dtensor.forward_on_leaves(eager), True
    # The module weakly: module.forward holds the Graphed, which holds the spec.
    return dict(function=None, module=weakref.ref(fn), eager=eager,
                eager_takes_module=takes_module, verify=StateCheck(index, fn))


def _refuse_weight_hooks(index: int, module: nn.Module) -> None:
    """A module's own forward pre-hook from torch.nn.utils.prune, weight_norm
    or spectral_norm recomputes its weight (``weight = weight_orig * mask``)
    before each call, outside the graphs, where the graphed forward reads
    the weight of the call that captured: warm-up's second backward raises
    autograd's "backward through the graph a second time", and the
    optimizer's steps of weight_orig would never reach the graphs.  Refused,
    naming the ways that keep the computation inside."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    kinds = (BasePruningMethod, WeightNorm, SpectralNorm)
    hook = next((h for h in module._forward_pre_hooks.values() if isinstance(h, kinds)), None)
    if hook is not None:
        raise ValueError(
            f"cgraph: module {index} ({type(module).__name__}) has a forward pre-hook of "
            f"{type(hook).__name__} that recomputes its weight before each call, outside the "
            "graphs, which would keep reading the weight of the call that captured. Graph "
            "the module that calls it (the hook then runs inside the graphs), use "
            "torch.nn.utils.parametrize (parametrizations.weight_norm, spectral_norm), or "
            "call torch.nn.utils.prune.remove(module, name) first.")


def _refuse_grad_dtypes(index: int, module: nn.Module) -> None:
    """A parameter whose grad_dtype is set to another dtype than its own
    (bf16 weights with float32 grads accumulated by autograd) gets grads of
    that dtype from eager's AccumulateGrad; a graph's backward hands out
    grads in the parameter's dtype.  Refused, naming the way that keeps
    autograd's own accumulation: a whole step's capture runs it as eager
    does."""
    for name, p in module.named_parameters():
        wanted = getattr(p, "grad_dtype", None)
        if wanted is not None and wanted != p.dtype and p.requires_grad:
            raise ValueError(
                f"cgraph: parameter {name!r} of module {index} ({type(module).__name__}) has "
                f"grad_dtype {wanted} where it is {p.dtype}: autograd would hand it grads of "
                f"{wanted}, and per-module graphs hand out grads in the parameter's dtype. "
                "Graph the whole training step instead (cgraph.make_graphed_step, whose "
                "capture keeps autograd's accumulation), or leave grad_dtype unset.")


def _static_input(sample: torch.Tensor, claimed: set[int]) -> torch.Tensor:
    """Samples become the graphs' static input buffers.

    * Two that share memory (one tensor passed to several callables, or twice
      to one) would overwrite each other at replay, and backward would read
      the wrong activations; torch computes wrong grads without a word.  A
      sample whose memory an earlier sample already uses is replaced by a
      clone.
    * A sample with autograd history (the output of other ops) is replaced
      by a leaf over the same memory: the backward capture runs a plain
      .backward() that must stop at the graph's inputs (csrc/aten_warmup.cpp,
      Note [Backward capture runs .backward()]).
    * A sample that is a view of more memory than it covers (a slice of a
      dataset kept on the device, ``X[:64]``) would have every later call's
      arguments copied into the caller's data around it, as torch's
      graphs do without a word: it is replaced by a clone too (as is an
      expanded one, which a copy cannot write)."""
    key = sample.untyped_storage().data_ptr()
    if sample.numel() and (key in claimed or sample.untyped_storage().nbytes() !=
                           sample.numel() * sample.element_size()):
        sample = sample.detach().clone().requires_grad_(sample.requires_grad)
        key = sample.untyped_storage().data_ptr()
    elif sample.grad_fn is not None:
        sample = sample.detach().requires_grad_()
    claimed.add(key)
    return sample


# A module whose forward cgraph set to a graphed callable (graph_layers, the
# drop-in, a module with hooks), graphed again without a reset: the new
# graphs' warm-up and capture would run the old graphs inside them.
GRAPHED_ALREADY = ("is graphed already: its forward is a graphed callable, which new graphs "
                   "would replay inside their capture")
GRAPHED_ALREADY_FIX = ("use the module as it is (a drop-in cell run twice in a notebook), or "
                       "reset its graphs first (module.forward.reset(), or cgraph.reset_all()), "
                       "which gives it its own forward back, then graph it again.")


def is_graphed_callable(value) -> bool:
    """Whether `value` is a graphed callable, bare or padded to buckets.  On
    every forward of a model graph_layers graphed (its cache hook asks):
    the classes imported once, not per call."""
    return isinstance(value, (_C.Graphed, Bucketed))


class StateCheck:
    """verify(module), called by graphed.c on a graphed module's first call
    after any module registered a parameter, buffer or submodule: raises if
    this module's parameters or buffers are no longer the tensors its graphs
    read.  Walks them only when that could have happened (Note [Which
    registrations re-check graphed modules])."""

    __slots__ = ("index", "captured", "submodules", "cls", "walked", "adopted")

    def __init__(self, index: int, module: nn.Module):
        self.index = index
        self.captured = dict(_named_state(module))
        self.submodules = _submodules(module)
        self.adopted = False  # no capture yet
        self.cls = type(module)  # fully_shard swaps it, registering nothing
        self.walked = _replacing[0]
        _watch(module)

    def __call__(self, module: nn.Module) -> None:
        if type(module) is self.cls and self.walked == _replacing[0]:
            return  # a submodule registered outside every graphed module
        now = dict(_named_state(module))
        faces = _fsdp.faces(module)
        for name in [*self.captured, *(k for k in now if k not in self.captured)]:
            was, found = self.captured.get(name), now.get(name)
            if was is found or (id(was) in faces and faces[id(was)] is faces.get(id(found))):
                continue  # the same tensor, or FSDP's other face of it
            if was is None:
                raise RuntimeError(
                    f"cgraph: '{name}' was added to graphed module {self.index} "
                    f"({type(module).__name__}) after capture; its graphs, captured without "
                    "it, would never read it. Add parameters, buffers and submodules holding "
                    "them before graphing, or reset the graphs after adding them "
                    "(graphed.reset(); layer.forward.reset() for graph_layers) and graph the "
                    "module again.")
            raise RuntimeError(
                f"cgraph: '{name}' of graphed module {self.index} "
                f"({type(module).__name__}) was replaced after capture "
                "(load_state_dict(assign=True), module.to() or .half() converting a buffer, a "
                "new nn.Parameter or buffer in its place, a removed one, "
                "torch.func.functional_call with other tensors, or fully_shard or "
                "parallelize_module applied after graphing); the graphs would keep reading "
                "the old tensor. Graph the module again after replacing it, load weights in "
                "place (load_state_dict without assign=True), or call the ungraphed module in "
                "functional_call; to shard a model, shard first (fully_shard every layer and "
                "the root), then graph each layer: cgraph.make_graphed(layer)."
            )
        self._check_submodules(module)
        # Only once it passed: a check that raised raises again on every call.
        self.cls, self.walked = type(module), _replacing[0]
        _watch(module)  # a submodule added since: its registrations too

    def _check_submodules(self, module: nn.Module) -> None:
        """A submodule the graphs ran, replaced or deleted since (a Dropout
        by an Identity, an activation swapped): the replays would run the
        old one's kernels.  One added under a new name ran in no capture
        (a metric or a loss module attached later) and passes."""
        now = dict(module.named_modules())
        for name, was in self.submodules.items():
            found = now.get(name)
            if found is None or found is not was():  # deleted, or replaced
                raise RuntimeError(
                    f"cgraph: submodule '{name}' of graphed module {self.index} "
                    f"({type(module).__name__}) was {'deleted' if name not in now else 'replaced'}"
                    " after capture; the graphs would keep running the old one. Change "
                    "submodules before graphing, or reset the graphs after changing them "
                    "(graphed.reset(); layer.forward.reset() for graph_layers) and graph "
                    "the module again.")

    def adopt(self, module: nn.Module) -> None:
        """After a capture of `module` (its warm-up and capture calls).  The
        first capture's state is the state: no graph read the one seen when
        the module was graphed without samples (a submodule or weight
        replaced before the first call).  After later captures, a parameter,
        buffer or submodule the forward registered under a new name (a
        cache made on the first call) is one the new graphs read, and no
        earlier graph read anything under that name, so it joins the
        captured state instead of raising at the next call.  One replaced
        under a name the state had does not: graphs captured before may
        read the old one, and the next call raises."""
        tensors, submodules = dict(_named_state(module)), _submodules(module)
        if not self.adopted:
            self.captured, self.submodules, self.adopted = tensors, submodules, True
        else:
            for name, tensor in tensors.items():
                self.captured.setdefault(name, tensor)
            for name, submodule in submodules.items():
                self.submodules.setdefault(name, submodule)
        _watch(module)


def _submodules(module: nn.Module) -> dict:
    """`module`'s submodules by name, weakly: the check is held by the spec,
    the spec by the graphs, the graphs by module.forward."""
    return {name: weakref.ref(m) for name, m in module.named_modules() if m is not module}


def _named_state(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


# Note [Which registrations re-check graphed modules]
# Q: A graph reads the tensors a module's parameters and buffers were at
#    capture.  What tells cgraph that one was replaced, without a walk of
#    every graphed module's parameters on every call?
# A: torch's global registration hooks: any registration moves the native
#    core's module_epoch, and a graphed module calls its StateCheck on its
#    next call only when the epoch moved (graphed.c, resolve_module).  The
#    check walks the parameters (about 100 us for a decoder layer, in
#    Python) only after a registration that can replace a tensor a graph
#    reads: a parameter or buffer registered on any module (any: a module
#    attached to a graphed one without a hook, by ModuleList.insert, is
#    not among those watched), or a submodule registered on a module inside
#    a graphed one.  A submodule registered elsewhere replaces nothing
#    inside a graphed module, and Hugging Face models do that on every
#    forward (self.layers[:n] registers every layer in a new ModuleList);
#    after one the check only compares the module's class with the
#    captured one, which fully_shard swaps while it replaces the
#    parameters without registering them.  Cost on the call path: a
#    decoder layer's forward replay took 205-260 us of host time in the
#    sharded per-layer step while every registration walked, 74-90 us
#    without the walk (measured at 16efb43, which skipped even the class
#    comparison, one Python call; benchmarks/README.md, sharded).  Modules
#    are kept by id, weakly: a module's own __eq__ or __hash__ (a dataclass
#    module's) is never asked.
_watched: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
# How many registrations so far could have replaced a graphed tensor; a
# StateCheck walks when this moved since its last walk.
_replacing = [0]


def _watch(module: nn.Module) -> None:
    for m in module.modules():
        _watched[id(m)] = m


# The modules inside graphed steps (Marks in cgraph/_step_checks.py), by id,
# weakly, and how many registrations, conversions or swaps on one of them
# so far could have replaced a tensor there: a step walks its modules again
# only after one of those, not after one anywhere (an AveragedModel outside
# the step re-registers its n_averaged buffer at every update).
_in_steps: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_step_replacing = [0]


def watch_for_steps(modules) -> int:
    """Counts changes on `modules` and their submodules from now on; returns
    the count now."""
    for root in modules:
        for m in root.modules():
            _in_steps[id(m)] = m
    return _step_replacing[0]


def step_replacing_epoch() -> int:
    return _step_replacing[0]


def _changed_in_a_step(module) -> None:
    if isinstance(module, nn.Module) and _in_steps.get(id(module)) is module:
        _step_replacing[0] += 1


def replaced_inside() -> None:
    """Something may have replaced tensors inside a graphed module (a
    registration there, or fully_shard on a GraphedModule): every graphed
    module walks its parameters on its next call."""
    _replacing[0] += 1
    _C.modules_changed()


def _registered_tensor(module: nn.Module, *_) -> None:
    replaced_inside()
    _changed_in_a_step(module)


def _registered_module(module: nn.Module, *_) -> None:
    _changed_in_a_step(module)
    if _watched.get(id(module)) is module:
        replaced_inside()
    else:
        _C.modules_changed()  # the class check only


nn.modules.module.register_module_parameter_registration_hook(_registered_tensor)
nn.modules.module.register_module_buffer_registration_hook(_registered_tensor)
nn.modules.module.register_module_module_registration_hook(_registered_module)


# Note [Sharding after graphing]
# Q: fully_shard replaces the parameters of the modules it manages without
#    registering them (FSDPParam writes module._parameters directly), and
#    swaps the class of only the module it is applied to.  Applied after
#    graphing to the root alone, or to a module inside a graphed one, it
#    fires no registration hook and leaves the graphed module's class as it
#    was: the graphs would go on reading the tensors they were captured
#    with, silently stale.  How does cgraph hear of it?
# A: FSDP has no hook for it, so cgraph wraps the constructor of FSDP's
#    parameter group, which fully_shard calls once per sharded module right
#    after replacing that module's parameters: while any module is graphed,
#    every graphed module then walks its parameters on its next call
#    (replaced_inside), finds the replaced ones and raises, naming the
#    recipe (shard first, then graph).  Sharding before graphing, the
#    recipe, meets no graphed module there; a second model sharded while a
#    first is graphed costs the first's graphed modules one walk each.
def _after_sharding(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        finally:  # also where it failed midway: the parameters done so far are replaced
            if len(_watched):
                replaced_inside()
    __init__.cgraph_wraps = init
    return __init__


# Note [Tensors swapped in without registration]
# torch.func.functional_call (and torch.nn.utils.stateless) swaps tensors
# into a module's _parameters and _buffers directly, for the duration of a
# call, firing no registration hook: a graphed module called inside would
# replay its captured weights, silently not the ones given.  cgraph wraps
# torch's swap and set functions: while any module is graphed, a swap makes
# every graphed module walk its parameters on its next call (the one inside
# raises, naming the fix; the one after the swap back passes), and a graphed
# step whose module it swapped on walks its modules before its next replay.
def _after_swapping(swap):
    @functools.wraps(swap)
    def wrapper(*args, **kwargs):
        try:
            return swap(*args, **kwargs)
        finally:
            # Compiled code swaps nothing at run time, and dynamo would
            # break its graph on the native call.
            if not torch.compiler.is_compiling():
                if len(_watched):
                    replaced_inside()
                if args:
                    _changed_in_a_step(args[0])  # the module swapped on, or converted
    wrapper.cgraph_wraps = swap
    return wrapper


def _watch_swaps() -> None:
    from torch.nn.utils import _named_member_accessor as accessor
    for name in ("swap_tensor", "set_tensor"):
        original = getattr(accessor, name, None)
        if original is not None:  # torch's own, wrapped once (as _watch_sharding does)
            setattr(accessor, name, _after_swapping(getattr(original, "cgraph_wraps", original)))


_watch_swaps()


# Note [Tensors swapped in without registration], continued: Module._apply
# (.to(), .half(), .float(), .cuda()) writes each converted buffer into
# _buffers directly, and a parameter's converted tensor into its .data.  A
# model graphed in bf16 whose fp32 buffer (a rotary embedding's inv_freq)
# was converted by a later model.to(torch.bfloat16) kept reading the old
# buffer, silently: its parameters, already bf16, did not move.  While any
# module is graphed, a conversion makes every graphed module walk its
# tensors on its next call; a conversion of a graphed step's module makes
# the step walk its modules before its next replay.
def _watch_conversions() -> None:
    apply = getattr(nn.Module._apply, "cgraph_wraps", nn.Module._apply)
    nn.Module._apply = _after_swapping(apply)


_watch_conversions()


def _watch_sharding() -> None:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # a torch without distributed, or with FSDP2 elsewhere
        return
    # torch's own constructor, wrapped once: a second import of cgraph (a
    # reload, or one after its modules left sys.modules) wraps it afresh,
    # so the wrapper tells the cgraph now in use.
    init = getattr(FSDPParamGroup.__init__, "cgraph_wraps", FSDPParamGroup.__init__)
    FSDPParamGroup.__init__ = _after_sharding(init)


_watch_sharding()
