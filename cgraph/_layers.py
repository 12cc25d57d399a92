"""graph_layers: a model's repeated blocks, each graphed, in one line.

Finding the blocks: the ``nn.ModuleList``, ``nn.Sequential`` or
``nn.ModuleDict`` of two or more children of one type that holds the most
parameters, as Hugging Face's ``model.model.layers`` and ``encoder.layer``,
timm's ``blocks``, a GPT's ``h`` and torchtitan's ``layers`` (a ModuleDict)
are.  An outer list of layers holds the parameters of any list inside
its layers (a mixture of experts' ``experts``), so it wins over them.  Where
the guess is not wanted, ``layers=`` names the list.  The blocks stay
where they are (their ``forward`` is replaced), so every name in the model
does too.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from . import _fsdp
from ._api import _same, graph_pool_handle, graphed_in_place, is_graphed
from ._log import log


class Blocks(NamedTuple):
    """The list of blocks graph_layers graphs, and where it sits."""

    path: str  # below the model (the module DDP wraps)
    container: nn.Module  # an nn.ModuleList, nn.Sequential or nn.ModuleDict
    blocks: tuple  # its blocks, in order

    @classmethod
    def of(cls, path: str, container: nn.Module) -> "Blocks":
        return cls(path, container, tuple(_children(container)))

    @property
    def where(self) -> str:
        """For messages: the path, quoted, or the model itself (path '')."""
        return f"'{self.path}'" if self.path else "the model itself"


def graph_layers(model: nn.Module, *, layers: str | nn.Module | None = None,
                 pool: Any = "shared", **make_graphed_kwargs) -> nn.Module:
    """Graph each of `model`'s repeated blocks as :func:`make_graphed` does,
    captured on its first call, and return `model`.

    Each block stays in its place, its ``forward`` replaced by its graphed
    callable (as :func:`make_graphed_callables` returns modules), so
    ``state_dict`` keys, parameter names and checkpoints are unchanged; a
    block's graphs are ``block.forward`` (``stats``, ``num_graphs``,
    ``reset()``, after which the block has its own forward again and can be
    graphed anew).

    ``layers``: the blocks' list, as a path below the model (``"model.layers"``,
    below the module a ``DistributedDataParallel`` wraps) or as the
    ``nn.ModuleList`` (``nn.Sequential``, ``nn.ModuleDict``) itself; by
    default the list of same-typed blocks holding the most parameters, or
    the model itself where it is such a list (``nn.Sequential(*blocks)``).
    ``pool``: ``"shared"`` (default) gives every block's graphs one new
    pool, as one ``pool=`` in
    :func:`make_graphed` does; ``None`` a pool per block; or a handle from
    :func:`graph_pool_handle`.  Other keywords go to :func:`make_graphed`
    (``buckets``, ``max_graphs``, ``num_warmup_iters``...).

    For FSDP2, ``fully_shard`` each block and the root first, as in the
    README's recipe; under DDP, either order works.  A Hugging Face model
    whose ``config.use_cache`` is on would build a KV cache in every forward
    and hand it to every block, and a graph replay cannot append to it: while
    the blocks are graphed, a forward call that leaves ``use_cache`` unset
    (training, evaluation) runs without a cache (logged); the config stays
    as it is, so checkpoints save it unchanged, and a call passing
    ``use_cache=True`` (``generate()``) keeps its cache and runs the blocks
    eagerly.  Logs what it graphed (logger ``cgraph``).

    Example::

        model = cgraph.graph_layers(AutoModelForCausalLM.from_config(config).cuda())
    """
    root = model.module if isinstance(model, DistributedDataParallel) else model
    if isinstance(getattr(root, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
        raise TypeError(
            "cgraph: graph_layers got a torch.compile'd model. Call graph_layers on the "
            "uncompiled model; to compile as well, compile each layer's forward first "
            "(layer.forward = torch.compile(layer.forward)): cgraph graphs compiled "
            "forwards.")
    found = _find(root, layers)
    _refuse(root, found)
    if pool == "shared":
        pool = graph_pool_handle()
    _graph_each(found.blocks, pool, make_graphed_kwargs)
    _cache_off(root, found.container, found.blocks)
    share = _parameter_count(found.container) / max(_parameter_count(root), 1)
    if layers is None:
        _warn_if_more_blocks(root, found, share)
    log.info("cgraph: graph_layers graphed %d %s blocks at %s (%.0f%% of the parameters), "
             "%s; each captures on its first call", len(found.blocks),
             type(found.blocks[0]).__name__, found.where, 100 * share,
             "one pool" if pool is not None else "a pool each")
    return model


def _graph_each(blocks: tuple, pool, make_graphed_kwargs: dict) -> None:
    """Every block graphed in place, or none: a failure puts each block back
    as it was (its class and its own forward)."""
    # Each distinct block once: a list may hold one block several times
    # (shared weights), graphed once and called at each place.
    blocks = list({id(block): block for block in blocks}.values())
    before = [(type(block), block.__dict__.get("forward")) for block in blocks]
    try:
        for block in blocks:
            _checkpointing_inside(block)
            graphed_in_place(block, pool=pool, **make_graphed_kwargs)
    except BaseException:
        for block, (cls, forward) in zip(blocks, before):
            block.__class__ = cls
            block.__dict__.pop("forward", None)
            if forward is not None:
                block.forward = forward
        raise


def graph_layers_once(model: nn.Module, who: str, **graph_layers_kwargs) -> bool:
    """graph_layers, for the framework callbacks (cgraph/transformers.py,
    cgraph/lightning.py): a model with graphed blocks already (a second
    fit, or blocks the user graphed) is left as it is, logged.  Whether it
    graphed them now."""
    if any(is_graphed(m) for m in model.modules()):
        log.info("cgraph: %s: %s has graphed blocks already; left as it is", who,
                 type(model).__name__)
        return False
    graph_layers(model, **graph_layers_kwargs)
    return True


def _find(root: nn.Module, layers) -> Blocks:
    if layers is None:  # nn.Sequential(*blocks): the model is the list
        blocks = root if _repeated(root) else _guess(root)
    elif isinstance(layers, str):
        try:
            blocks = root.get_submodule(layers)
        except AttributeError as e:
            raise ValueError(f"cgraph: graph_layers: {e}. Name the list of blocks by its "
                             "path below the model, as in model.named_modules().") from None
    elif isinstance(layers, nn.Module):
        blocks = layers
    else:
        raise TypeError(f"cgraph: graph_layers: layers= takes a path or an nn.ModuleList, "
                        f"got {type(layers).__name__}.")
    path = _path(root, blocks)
    if not path and not isinstance(root, _CONTAINERS):  # a list as the model: its blocks
        raise ValueError("cgraph: graph_layers: layers= names the model itself; name the list "
                         "of blocks inside it, or graph the model whole with cgraph.make_graphed.")
    if not isinstance(blocks, _CONTAINERS) or len(blocks) == 0:
        raise TypeError(f"cgraph: graph_layers: '{path}' is a {type(blocks).__name__}; it "
                        "takes a non-empty nn.ModuleList, nn.Sequential or nn.ModuleDict of "
                        "blocks.")
    found = Blocks.of(path, blocks)
    if any(is_graphed(block) for block in found.blocks):
        raise ValueError(f"cgraph: graph_layers: the blocks at {found.where} are graphed already "
                         "(some or all). Reset every one first (block.forward.reset() for each, "
                         "or cgraph.reset_all()), then graph them again.")
    return found


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _children(container: nn.Module) -> list:
    """A container's blocks in order, each place (a block held twice is
    listed twice): a ModuleDict's values."""
    return list(container.values() if isinstance(container, nn.ModuleDict) else container)


def _warn_if_more_blocks(root: nn.Module, found: Blocks, share: float) -> None:
    """A guess graphs one list: warns where the model's other lists of
    blocks hold a quarter of it or more together (an encoder beside a
    decoder, a ResNet's other stages), naming what to do."""
    candidates = dict(_named_candidates(root))
    # Not inside another list (one per path: a module reached twice keeps its first).
    top = {path: m for path, m in candidates.items() if m is not found.container
           and not any(path.rsplit(".", depth)[0] in candidates
                       for depth in range(1, path.count(".") + 1))}
    eager = sum(map(_parameter_count, top.values())) / max(_parameter_count(root), 1)
    others = list(top) if eager >= 0.25 else []
    if others:
        log.warning("cgraph: graph_layers guessed the blocks at %s, which hold %.0f%% of %s's "
                    "parameters. Other lists of repeated blocks run eagerly: %s; graph each "
                    "with graph_layers(model, layers='path'), one call per list.",
                    found.where, 100 * share, type(root).__name__, others)


class NoBlocks(ValueError):
    """graph_layers found no list of repeated blocks to graph."""


def _repeated(m: nn.Module) -> bool:
    """A list of two or more blocks of one type, with parameters."""
    return (isinstance(m, _CONTAINERS) and len(m) >= 2
            and len({type(child) for child in _children(m)}) == 1 and _parameter_count(m) > 0)


def _named_candidates(root: nn.Module) -> list:
    """(path, list) of each list of repeated blocks below the model."""
    return [(path, m) for path, m in root.named_modules() if m is not root and _repeated(m)]


def _guess(root: nn.Module) -> nn.Module:
    candidates = [m for _, m in _named_candidates(root)]
    if not candidates:
        raise NoBlocks(
            f"cgraph: graph_layers found no list of repeated blocks in {type(root).__name__} "
            "(an nn.ModuleList, nn.Sequential or nn.ModuleDict of two or more modules of "
            "one type, with "
            "parameters). Name them with layers='path.to.blocks', or graph the model whole "
            "with cgraph.make_graphed.")
    return max(candidates, key=_parameter_count)


def _refuse(root: nn.Module, found: Blocks) -> None:
    """Blocks graph_layers cannot graph, refused before anything changes,
    naming the fix."""
    if any(getattr(block, "_compiled_call_impl", None) is not None for block in found.blocks):
        # block.compile() compiles the call, which would run the graphed forward under dynamo
        raise ValueError(
            f"cgraph: graph_layers: the blocks at {found.where} were compiled with "
            "block.compile(), which compiles their call around the graphs. Compile their "
            "forward instead (block.forward = torch.compile(block.forward)): cgraph graphs "
            "compiled forwards.")
    # FSDP2 on the root alone gathers every block's parameters in the root's
    # forward, into memory freed after it: graphs of a block would read it
    # there.  Each block must be its own FSDP module (Note [FSDP2's unsharded
    # parameters in per-layer graphs] in cgraph/_fsdp.py).
    sharded = any(_fsdp.is_fsdp(m) for m in root.modules())
    if sharded and not all(_fsdp.is_fsdp(block) for block in found.blocks):
        raise ValueError(
            f"cgraph: graph_layers: the model is sharded by fully_shard, but the blocks at "
            f"{found.where} are not each sharded. Apply fully_shard to every block, then to "
            "the root, then call graph_layers (README, Sharded models).")


# Each module graph_layers turned the cache off for, and that hook's handle:
# one hook a module however often its blocks are graphed again.  Weakly: a
# dropped model takes its hook along.
_cache_hooks: "weakref.WeakKeyDictionary[nn.Module, RemovableHandle]" = \
    weakref.WeakKeyDictionary()


def _cache_off(root: nn.Module, container: nn.Module, blocks) -> None:
    """Hugging Face models (the root, or inside a LightningModule) build a
    KV cache per forward when config.use_cache is on, and hand it to every
    block, whose graphs cannot append to it (such a call runs the block
    eagerly).  Each module outside the blocks whose config says use_cache
    and whose forward takes it gets a forward pre-hook that turns the cache
    off in a call leaving use_cache unset, while the blocks are graphed.
    The config stays as it is: save_pretrained writes it to checkpoints,
    and generate() from them should keep its cache.  The hook checks the
    blocks at each call rather than being removed at the blocks' reset,
    which runs in the native core and knows nothing of it; a weak reference
    and an isinstance per model call (the first block, while it is
    graphed) cost nothing beside the model's forward."""
    inside = {id(m) for m in container.modules()}
    hooked = []
    for module in root.modules():
        config = getattr(module, "config", None)
        if id(module) in inside or getattr(config, "use_cache", False) is not True:
            continue
        position = _use_cache_position(module)
        if position is None:
            continue
        earlier = _cache_hooks.pop(module, None)
        if earlier is not None:  # blocks graphed again after a reset
            earlier.remove()
        hook = _NoCacheUnlessAsked(blocks, position)
        _cache_hooks[module] = module.register_forward_pre_hook(hook, with_kwargs=True)
        hooked.append(type(module).__name__)
    if hooked:
        log.info("cgraph: graph_layers: calls of %s that leave use_cache unset run without a "
                 "KV cache while the blocks are graphed (a graphed block cannot append to "
                 "one); config.use_cache stays True, and a call passing use_cache=True "
                 "(generate()) keeps its cache and runs the blocks eagerly",
                 ", ".join(hooked))


def _use_cache_position(module: nn.Module) -> int | None:
    """Where ``use_cache`` sits among the positional parameters of
    `module`'s forward (sys.maxsize where it is keyword-only), or None
    where the forward does not name it: a forward that takes it only
    through ``**kwargs`` may hand it on to code that does not."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a forward inspect cannot read
        return None
    for position, parameter in enumerate(parameters):
        if parameter.name == "use_cache":
            if parameter.kind is parameter.POSITIONAL_OR_KEYWORD:
                return position
            return sys.maxsize if parameter.kind is parameter.KEYWORD_ONLY else None
    return None


class _NoCacheUnlessAsked:
    """The forward pre-hook of _cache_off: ``use_cache=False`` where the call
    leaves it unset (absent, or None positionally or by keyword), while
    any block is graphed (one reset alone, as an error names it, leaves the
    others graphed); once none is (reset, or dropped), the hook removes
    itself.  It holds the blocks weakly: a list of blocks the
    user swapped out keeps no graphs alive through it, and the module it
    hooks is not held at all (no reference cycle).  A copy of the model
    (copy.deepcopy, pickle) runs its blocks eagerly (Note [Copying a graphed
    model] in cgraph/_api.py), so the hook is copied as one that does
    nothing.  The first such call without grad (evaluation, or the prefill
    of a hand-written decoding loop, whose next call would find no cache
    and lose the context) warns, once per model, naming use_cache=True."""

    __slots__ = ("blocks", "position", "warned")

    def __init__(self, blocks, position: int):
        self.blocks, self.position = tuple(map(weakref.ref, blocks)), position
        self.warned = False

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if not any(block is not None and is_graphed(block)
                   for block in (ref() for ref in self.blocks)):
            handle = _cache_hooks.pop(module, None)
            if handle is not None:
                handle.remove()
            return None
        at = self.position
        if len(args) > at:  # passed positionally
            if args[at] is not None:
                return None
            self._warn_without_grad(module)
            return args[:at] + (False,) + args[at + 1:], kwargs
        if kwargs.get("use_cache") is not None:
            return None
        self._warn_without_grad(module)
        return args, {**kwargs, "use_cache": False}

    def _warn_without_grad(self, module: nn.Module) -> None:
        if not self.warned and not torch.is_grad_enabled():
            self.warned = True
            log.warning(
                "cgraph: graph_layers: %s was called without grad and with use_cache unset: "
                "while its blocks are graphed such a call runs without a KV cache, so its "
                "output's past_key_values is None. A decoding loop that keeps the cache "
                "must pass use_cache=True (those calls run the blocks eagerly); an "
                "evaluation needs nothing. Warned once per model.", type(module).__name__)

    def __reduce__(self) -> tuple:
        return _copied, ()

    def __deepcopy__(self, memo: dict):
        return _copied_cache_hook


def _copied_cache_hook(*args, **kwargs) -> None:
    """_NoCacheUnlessAsked in a copy of the model: nothing to do."""
    return None


def _copied():
    """What unpickling a _NoCacheUnlessAsked gives."""
    return _copied_cache_hook


def _checkpointing_inside(block: nn.Module) -> None:
    """Hugging Face's gradient checkpointing, moved from around a block's
    call into the forward its graphs capture.  transformers before 5.23
    checkpoints in GradientCheckpointingLayer.__call__, around the module's
    call, and so around its graphed forward: a first call inside a
    reentrant checkpoint would capture under no_grad, and the recompute
    during backward would capture there.  The block's class becomes a
    subclass that checkpoints in ``forward``, as 5.23 and later do, and an
    instance ``forward`` (a compiled one) checkpoints the same way, each
    reading the block's flags whenever that forward runs: in warm-up, at
    capture and in eager calls.  A graph keeps what its capture read:
    checkpointing enabled or disabled after a block's capture changes its
    eager calls only, until ``reset()`` (a Python flag, baked in: README,
    Limits).  Inside the captured forward, checkpointing works as in any
    graphed callable and keeps its memory saving."""
    cls = type(block)
    if getattr(cls.__call__, "__qualname__", "") != "GradientCheckpointingLayer.__call__":
        return
    block.__class__ = _checkpointing_in_forward(cls)
    own = block.__dict__.get("forward")
    if own is not None:
        # A partial, not a closure: copy.deepcopy and pickle copy its block and
        # forward with the model (a closure would be shared with a copy).
        block.forward = _CheckpointedForward(block, own)
    log.info("cgraph: graph_layers: %s checkpoints inside its graphs (transformers' gradient "
             "checkpointing, moved from around the call into forward)", cls.__name__)


class _CheckpointedForward:
    """A block's own instance forward (a compiled one), checkpointed as
    transformers' GradientCheckpointingLayer.__call__ does it, with the
    forward's signature.  A copy of the block (copy.deepcopy, pickle) is of
    the block's own class, which checkpoints around its call, so it gets
    the forward itself back: checkpointing it again would nest."""

    def __init__(self, block: nn.Module, forward):
        functools.update_wrapper(self, forward)
        self._block, self._forward = block, forward

    def __call__(self, *args, **kwargs):
        return _maybe_checkpointed(self._block, self._forward, args, kwargs)

    def __reduce__(self) -> tuple:
        return _same, (self._forward,)


def _maybe_checkpointed(block: nn.Module, forward, args: tuple, kwargs: dict):
    """`forward(*args, **kwargs)`, checkpointed as transformers'
    GradientCheckpointingLayer.__call__ does it, where the block's flags
    say so now."""
    if not (block.gradient_checkpointing and block.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    if kwargs.get("use_cache"):  # no cache under checkpointing, as transformers has it
        kwargs["use_cache"] = False
    if not getattr(block, "_can_checkpoint_with_cache", False):
        # past_key_value: the name older transformers versions' layers take.
        for name in ("past_key_values", "past_key_value", "layer_past"):
            if kwargs.get(name) is not None:
                kwargs[name] = None
    return block._gradient_checkpointing_func(functools.partial(forward, **kwargs), *args)


@functools.cache
def _checkpointing_in_forward(cls: type) -> type:
    """`cls` with transformers' GradientCheckpointingLayer.__call__ logic in
    ``forward`` (cls's own, looked up at each call) and
    ``nn.Module.__call__`` as its call."""
    @functools.wraps(cls.forward)
    def forward_with_checkpointing(self, *args, **kwargs):
        return _maybe_checkpointed(self, functools.partial(cls.forward, self), args, kwargs)

    def __reduce_ex__(self, protocol):
        # A copy (copy.deepcopy, pickle) is of cls itself, which checkpoints
        # around its call as transformers does; this class, made here under
        # cls's name, cannot be pickled by name.
        return _new_of, (cls,), self.__getstate__()

    namespace = {"__call__": nn.Module.__call__, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__, "forward": forward_with_checkpointing,
                 "__reduce_ex__": __reduce_ex__}
    if hasattr(cls, "_orig_cls_mro_index"):  # FSDP2's FSDP<cls>: its original class sits
        namespace["_orig_cls_mro_index"] = cls._orig_cls_mro_index + 1  # one further now
    return type(cls.__name__, (cls,), namespace)


def _new_of(cls: type):
    """An instance of `cls` without state yet, which the copy's state fills."""
    return cls.__new__(cls)


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _path(root: nn.Module, module: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is module:
            return name
    raise ValueError(f"cgraph: graph_layers: the {type(module).__name__} given as layers= is "
                     f"not inside the model ({type(root).__name__}).")
