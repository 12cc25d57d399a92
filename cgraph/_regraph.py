"""Graphs captured after the first: for a call that none of a callable's
graphs takes (another shape, constant, autocast or grad mode, train/eval,
a parameter unfrozen since, a call outside inference_mode of a graph with
inference tensors),
for a second call before the first one's backward, and for the first call of
a callable graphed without samples.  The native core decides every such call
and calls on_miss only to capture, where it says: Note [Several graphs per
callable] in csrc/graphed.c."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
from torch.utils import _pytree as pytree

from . import _C, _fsdp, _log
from ._buckets import holds_nested
from ._capture import CaptureOptions, graph
from ._describe import Target, draft, holds_cache


class Regraph:
    """on_miss of one graphed callable: captures one more forward/backward
    pair for the call at hand, with the callable's options, where the
    native core's CaptureSite says (the pool, and whether to warm up in it
    and keep the activations), and returns it; the core adopts it."""

    __slots__ = ("target", "options")

    def __init__(self, target: Target, options: CaptureOptions):
        self.target = target
        self.options = options

    def __call__(self, graphed: _C.Graphed, args: tuple, kwargs: dict,
                 site: _C.CaptureSite) -> _C.Graphed | None:
        """The Graphed captured for this call, with one graph; None for a
        call that runs eagerly: one carrying a transformers Cache (a graphed
        layer of a model that generate() calls), or a nested tensor
        (nn.TransformerEncoder's layers in evaluation, a padding mask
        given), which no graph can take."""
        if holds_cache((args, kwargs)):
            _log.cache_call_eager(graphed)
            return None
        if holds_nested(pytree.tree_leaves((args, kwargs))):
            _log.nested_call_eager(graphed)
            return None
        module = self.target.callable()
        started = time.perf_counter()
        try:
            captured, samples = self._captured(graphed, module, args, kwargs, site)
        except BaseException as exc:
            if _fsdp.is_fsdp(module) and not _asked_again(exc, site):
                _fsdp.after_failed_layer_capture(module)
            raise
        _log.captured(graphed, captured, "a second call before the first one's backward"
                      if site.pending else "a call no graph takes", samples,
                      time.perf_counter() - started)
        return captured

    def _captured(self, graphed: _C.Graphed, module, args: tuple, kwargs: dict,
                  site: _C.CaptureSite) -> tuple:
        """The capture itself: (the Graphed with its one graph, the samples)."""
        _check_device(graphed, (args, kwargs))
        if _fsdp.is_fsdp(module):  # inside its forward: FSDP has just all-gathered
            _fsdp.home_parameters(module, graphed)
        # allow_unused_input=False checks the callable once, at its first
        # graph: a later one (eval mode, where a train-only auxiliary head
        # reads no parameter) leaves the unused parameters without grad, as
        # eager does, rather than raising in the middle of training.
        options = self.options if graphed.num_graphs == 0 else \
            self.options._replace(allow_unused_input=True)
        with self._samples(args, kwargs, site.pool) as samples:
            (captured,) = graph([draft(self.target, *samples, set())], site.pool, options,
                                warm_in_pool=site.warm_in_pool,
                                keep_activations=site.keep_activations)
        return captured, samples

    @contextlib.contextmanager
    def _samples(self, args: tuple, kwargs: dict, pool: tuple[int, int]) -> Iterator[tuple]:
        """The call's (args, kwargs) as a capture in `pool` takes them:
        every tensor copied, so that the caller's stay the caller's."""
        yield pytree.tree_map_only(torch.Tensor, _sample_of, (args, kwargs))


def _asked_again(exc: BaseException, site: _C.CaptureSite) -> bool:
    """Whether the core asks on_miss again for this call, the layer still
    inside FSDP's forward: a warm-up that left state in a pool of the
    callable's own (site.asks_again), which recover_from_warm_up
    (csrc/graphed.c) drops to capture in a fresh pool."""
    return getattr(exc, "kind", None) == "warmup_state" and bool(site.asks_again)


def regraphing(target: Target, options: CaptureOptions, max_graphs: int,
               first: _C.Graphed | None = None,
               shared_pool: tuple[int, int] | None = None, casts: bool = False) -> _C.Graphed:
    """A graphed callable that captures a graph for each call its graphs do
    not take, up to ``max_graphs`` (past that, calls run eagerly, counted
    and logged once).  ``first``: its first graph, just captured (it is
    taken from that Graphed); without it, the first call captures.
    ``shared_pool``: the pool its first graph shares with other callables'
    graphs, which its later graphs stay out of: they could reuse memory
    another callable's pending backward still needs.  ``casts``: a call of
    another floating dtype is cast into a graph that takes it otherwise, as
    torch's drop-in does (the drop-in's); else it gets a graph of its own."""
    return _C.new_graphed(Regraph(target, options), max_graphs, first=first,
                          shared_pool=shared_pool, eager=target.run_eagerly, casts=casts)


def _check_device(graphed: _C.Graphed, call) -> None:
    """A graph per device is not what anyone wants: a tensor on another
    device than the first graph's is a mistake, raised as the first graph
    would raise it."""
    spec = graphed.spec
    if spec is None:
        return
    for t in pytree.tree_leaves(call):
        if isinstance(t, torch.Tensor) and t.device != torch.device("cuda", spec.device):
            raise ValueError(
                f"cgraph: an argument of shape {tuple(t.shape)} is on {t.device}, but the "
                f"graphs run on cuda:{spec.device}. Move it to that device first.")


def _sample_of(t: torch.Tensor) -> torch.Tensor:
    """A copy of a call's tensor to capture with: the caller's tensor stays
    the caller's (a graph's static inputs are its own memory)."""
    return t.detach().clone().requires_grad_(t.requires_grad)
