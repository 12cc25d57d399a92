"""Callables graphed one by one without samples but with one ``pool=``: the
layers of a model, each ``cgraph.make_graphed(layer, pool=pool)``.  Their
calls are recorded, then captured together in that pool.

Note [One pool for separately graphed callables]
Q: Why not capture each layer on its first call, as a callable graphed on
   its own is?
A: One pool serves several graphs only when they are captured in the order
   they replay, forwards in call order and backwards in reverse (Note
   [Captures that share a pool] in csrc/aten_pool.cpp): a layer captured on
   its own captures its backward right after its forward, so the next
   layer's capture takes the memory of its activations, and the next layer
   could never replay while its backward is pending.  Each layer then needs
   a pool of its own, each holding its own temporaries and cached segments
   (six layers: six times the memory of one).  So the layers of a group run
   eagerly on a call no graph takes, each call recorded (its tensors
   copied, as a sample), until a layer already recorded is called again:
   the recorded calls were one pass through the model, and they are
   captured together, as make_graphed_callables captures a tuple, into the
   group's pool.  That call then replays, and so does every later pass
   with those shapes.  A pass with other shapes is recorded and captured
   the same way, into the same pool, beside the earlier graphs.
   Results are eager's throughout: recorded calls are eager calls.  A call
   whose graph may not replay now (its backward, or one it would overwrite,
   is pending: a second micro-batch's forward) gets an instance captured on
   its own in another pool, as for a callable graphed alone.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from . import _C, _log
from ._capture import CaptureOptions, graph
from ._describe import Target, draft
from ._regraph import Regraph, _check_device, _sample_of


class Recorded(NamedTuple):
    """One eager call of a member, to capture later."""

    member: "Member"
    graphed: "weakref.ref[_C.Graphed]"
    samples: tuple  # (args, kwargs), every tensor copied


class Group:
    """The callables graphed with one pool= and no samples, and the calls
    recorded since the group's last capture, in call order."""

    __slots__ = ("pool", "options", "recording", "__weakref__")

    def __init__(self, pool: tuple[int, int], options: CaptureOptions):
        self.pool = pool
        self.options = options
        self.recording: list[Recorded] = []

    def miss(self, member: "Member", graphed: _C.Graphed, args: tuple, kwargs: dict):
        """on_miss for a call no graph of `member` takes: True once the
        recorded calls are captured (ask again), else the call's result,
        run eagerly, in a 1-tuple (recorded when there is room)."""
        if any(r.member is member for r in self.recording):
            # A pass through the model is over: capture it, then look again.
            if self._capture():
                return True
        elif graphed.num_graphs < member.fallback.max_graphs and not _in_backward():
            _check_device(graphed, (args, kwargs))
            samples = pytree.tree_map_only(torch.Tensor, _sample_of, (args, kwargs))
            self.recording.append(Recorded(member, weakref.ref(graphed), samples))
        elif graphed.num_graphs >= member.fallback.max_graphs:
            return member.fallback(graphed, args, kwargs, False)  # past the limit: logged
        return (_run_eagerly(member.target, args, kwargs),)

    def _capture(self) -> bool:
        """Captures the recorded calls together, forwards in the order they
        ran and backwards in reverse, into the group's pool, and hands each
        graph to its callable.  False, keeping them, while that pool has a
        backward pending or autograd is running one (a checkpoint's
        recompute): the next miss tries again."""
        if _C.pool_busy(self.pool) or _in_backward():
            return False
        recording, self.recording = self.recording, []
        calls = [(r, g) for r in recording
                 if (g := r.graphed()) is not None and not g.is_reset]
        if not calls:
            return True
        started = time.perf_counter()
        claimed: set[int] = set()
        drafts = [draft(r.member.target, *r.samples, claimed) for r, _ in calls]
        captured = graph(drafts, self.pool, self.options)
        seconds = time.perf_counter() - started
        for (r, g), one in zip(calls, captured):
            g._adopt(one)
            _log.captured(g, "a pass recorded with the callables of its pool", r.samples,
                          seconds / len(calls))
        return True


class Member:
    """on_miss of one callable of a group."""

    __slots__ = ("group", "target", "fallback")

    def __init__(self, group: Group, target: Target, options: CaptureOptions,
                 max_graphs: int):
        self.group = group
        self.target = target
        # For a call whose graph may not replay now: an instance of its own.
        self.fallback = Regraph(target, options, max_graphs, shares_pool=True)

    def __call__(self, graphed: _C.Graphed, args: tuple, kwargs: dict, pending: bool):
        if pending:
            return self.fallback(graphed, args, kwargs, pending)
        return self.group.miss(self, graphed, args, kwargs)


# The group of each pool handle that callables graphed without samples share.
_groups: "weakref.WeakValueDictionary[tuple[int, int], Group]" = weakref.WeakValueDictionary()


def member(target: Target, pool: tuple[int, int], options: CaptureOptions,
           max_graphs: int) -> Member:
    """on_miss of a callable graphed without samples with this pool=."""
    group = _groups.get(pool)
    if group is None:
        group = _groups[pool] = Group(pool, options)
    elif group.options != options:
        raise ValueError(
            f"cgraph: callables graphed with pool={pool} are captured together, so they "
            f"need the same num_warmup_iters, allow_unused_input, capture_error_mode and "
            f"kept_outputs; got {options} here and {group.options} before.")
    return Member(group, target, options, max_graphs)


def _run_eagerly(target: Target, args: tuple, kwargs: dict) -> Any:
    """What the callable returns for this call without graphs."""
    fields = target.fields
    if fields["module"] is None:
        return fields["function"](*args, **kwargs)
    module = fields["module"]()
    if module is None:
        raise RuntimeError("cgraph: the graphed module no longer exists.")
    if fields["eager_takes_module"]:
        return fields["eager"](module, *args, **kwargs)
    return fields["eager"](*args, **kwargs)


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's
    recompute calls the layer again there)."""
    return torch._C._current_graph_task_id() != -1
