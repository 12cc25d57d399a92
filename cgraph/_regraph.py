"""Graphs captured after the first: for a call that none of a callable's
graphs takes (another shape, constant, autocast or grad mode, train/eval),
for a second call before the first one's backward, and for the first call of
a callable graphed without samples.  The native core calls this as on_miss
and replays what it captured: Note [Several graphs per callable] in
csrc/graphed.c."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
from torch.utils import _pytree as pytree

from . import _C, _log
from ._capture import CaptureOptions, graph
from ._describe import Target, draft


class Regraph:
    """on_miss of one graphed callable: captures one more forward/backward
    pair for the call at hand, with the callable's options, up to
    ``max_graphs``; past that the call runs eagerly (graphed.c counts it)."""

    __slots__ = ("target", "options", "max_graphs", "shares_pool", "told", "refusal")

    def __init__(self, target: Target, options: CaptureOptions, max_graphs: int,
                 shares_pool: bool):
        self.target = target
        self.options = options
        self.max_graphs = max_graphs
        # The first graph's pool is shared with other callables (graphed
        # together, or pool=): later graphs stay out of it, or one could
        # reuse memory another callable's pending backward still needs.
        self.shares_pool = shares_pool
        self.told = False  # the limit is logged once
        # A warm-up left memory only C++ holds in a pool shared with other
        # callables (Note [Warm-up in the pool]): every later capture raises
        # it too, as the state it made is where that pool's graphs write.
        self.refusal: _C.CaptureError | None = None

    def __call__(self, graphed: _C.Graphed, args: tuple, kwargs: dict, pending: bool) -> bool:
        """True once a graph for this call is adopted by `graphed`; False:
        run the call eagerly."""
        if self.refusal is not None:
            raise self.refusal.with_traceback(None)
        if graphed.num_graphs >= self.max_graphs:
            self._tell_limit(graphed, pending)
            return False
        _check_device(graphed, (args, kwargs))
        started = time.perf_counter()
        pool, warm_in_pool, keep = self._pool(graphed, pending)
        with self._samples(args, kwargs, pool) as samples:
            try:
                (captured,) = graph([draft(self.target, *samples, set())], pool, self.options,
                                    warm_in_pool=warm_in_pool, keep_activations=keep)
            except _C.CaptureError as exc:
                if exc.kind != "warmup_state":
                    raise
                if pool == self._shared_pool(graphed):  # other callables' graphs use it
                    self.refusal = exc
                    raise
                # Warm-up kept memory in the pool that no move could free,
                # where the earlier graphs would overwrite it: they go
                # (captured again when needed), and this one is warmed up
                # outside any pool.
                _log.pool_dropped(graphed, graphed._drop_pool(pool))
                samples = pytree.tree_map_only(torch.Tensor, _sample_of, (args, kwargs))
                (captured,) = graph([draft(self.target, *samples, set())], _C.new_pool(),
                                    self.options)
        graphed._adopt(captured)
        _log.captured(graphed, "a second call before the first one's backward" if pending
                      else "a call no graph takes", samples, time.perf_counter() - started)
        return True

    def _pool(self, graphed: _C.Graphed, pending: bool) -> tuple[tuple[int, int], bool, bool]:
        """A pool of this callable's graphs where no graph has a backward
        pending (not the first graph's when that is shared), else a fresh
        one; whether to warm up in it (a pool of earlier idle graphs: Note
        [Warm-up in the pool]); and whether its captures keep their
        activations (cgraph/_group.py's do)."""
        idle = graphed._idle_pool(self._shared_pool(graphed))
        return (tuple(idle), True, False) if idle else (_C.new_pool(), False, False)

    def _shared_pool(self, graphed: _C.Graphed) -> tuple[int, int] | None:
        """The pool this callable shares with others, which later graphs
        stay out of: its first graph's, if shared."""
        return graphed.pool if self.shares_pool else None

    @contextlib.contextmanager
    def _samples(self, args: tuple, kwargs: dict, pool: tuple[int, int]) -> Iterator[tuple]:
        """The call's (args, kwargs) as a capture in `pool` takes them:
        every tensor copied, so that the caller's stay the caller's."""
        yield pytree.tree_map_only(torch.Tensor, _sample_of, (args, kwargs))

    def _tell_limit(self, graphed: _C.Graphed, pending: bool) -> None:
        if not self.told:
            self.told = True
            _log.past_limit(graphed, self.max_graphs, pending)


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
