"""CPU tests of how a call's arguments become the tensors a graph replays
with: the native walk beside the samples (Note [Arguments walked in C] in
csrc/arguments.c) against torch's tree_flatten.  For each samples and call,
the spec as drafted and the same spec with the walk turned off give the
same answer (the same tensor objects, or the same error), and the walk
takes exactly the calls it should (`_C._call_tensors` says whether
tree_flatten was needed).  No CUDA: the spec and the argument check come
before any replay."""

import collections
import enum

import pytest
import torch
from torch.utils import _pytree as pytree

import cgraph
from cgraph._describe import Target, draft

CosSin = collections.namedtuple("CosSin", "cos sin")


class Mode(enum.IntEnum):
    ROTATE = 0


class AlwaysEqual(str):
    """A keyword whose == matches every name: torch's check passes it, the
    walk must not read it as the name its text is not."""

    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


def layer(x, **kwargs):
    return x


def spec_of(args, kwargs, walk=True, fn=layer):
    """The spec as drafted; walk=False: the same without the walk, so that
    tree_flatten decides every call."""
    fields = draft(Target.of(0, fn), args, kwargs, set()).fields
    if not walk:
        fields["walk"] = None
    return cgraph._C.CallableSpec(**fields, device=0)


def answer(spec, args, kwargs):
    """The tensors the call replays with (as objects), or its error; and
    whether tree_flatten was needed (None on error)."""
    try:
        tensors, flattened = cgraph._C._call_tensors(spec, *args, **kwargs)
    except (TypeError, ValueError) as e:
        return (type(e), str(e)), None
    return [id(t) for t in tensors], flattened


t = [torch.full((2,), float(i)) for i in range(8)]
x, cos, sin, bias, mask = t[:5]

# Called as a Hugging Face decoder layer is.
HF = ((x,), dict(position_embeddings=(cos, sin), attention_mask=None, use_cache=False,
                 mode="rotate", extra={"bias": [bias], "scale": 2.0}))


def hf(**changes):
    kwargs = dict(HF[1], position_embeddings=(t[5], t[6]),
                  extra={"bias": [t[7]], "scale": 2.0})
    kwargs.update(changes)
    return (t[4],), kwargs


CASES = {
    # name: (call, walked): walked is whether the walk takes it
    "same structure, new tensors": (hf(), True),
    "a mask tensor where None was captured": (hf(attention_mask=mask), True),
    "another float constant": (hf(extra={"bias": [t[7]], "scale": 3.0}), True),
    "an int where a bool was captured": (hf(use_cache=0), True),
    "the embeddings as a list": (hf(position_embeddings=[cos, sin]), False),
    "the embeddings as a named tuple": (hf(position_embeddings=CosSin(cos, sin)), False),
    "a tensor where a tuple was captured": (hf(position_embeddings=cos), False),
    "None where a dict was captured": (hf(extra=None), False),
    "a dict's keys in another order": (hf(extra={"scale": 2.0, "bias": [t[7]]}), False),
    "a tuple where a list was captured": (hf(extra={"bias": (t[7],), "scale": 2.0}), False),
    "an IntEnum where a str was captured": (hf(mode=Mode.ROTATE), False),
    "a parameter for a tensor": (((torch.nn.Parameter(t[4]),), hf()[1]), False),
    "a keyword that is a str subclass": (
        (hf()[0], {AlwaysEqual("mode") if k == "mode" else k: v for k, v in hf()[1].items()}),
        False),
    "a str subclass keyword equal to every name": (
        (hf()[0], {AlwaysEqual("zzz") if k == "mode" else k: v for k, v in hf()[1].items()}),
        False),
    "one positional argument too many": (((t[4], t[5]), hf()[1]), False),
}


@pytest.mark.parametrize("name", CASES)
def test_the_walk_answers_as_tree_flatten(name):
    (args, kwargs), walked = CASES[name]
    walk, flatten = spec_of(*HF), spec_of(*HF, walk=False)
    assert walk.walk is not None and flatten.walk is None
    got, flattened = answer(walk, args, kwargs)
    want, _ = answer(flatten, args, kwargs)
    assert got == want
    if flattened is not None:
        assert flattened == (not walked)


def test_the_answers_are_what_each_call_deserves():
    """The walk and tree_flatten agreeing is worth little if both are wrong:
    a few cases read out."""
    ok, flattened = answer(spec_of(*HF), *hf())
    # keywords by name: attention_mask, extra (bias, scale), mode, position_embeddings
    assert ok == [id(t[4]), id(t[7]), id(t[5]), id(t[6])] and flattened is False
    (error, text), _ = answer(spec_of(*HF), *hf(attention_mask=mask))
    # A tensor is named by its type: its repr would fill the message, and a
    # CUDA tensor's syncs (built and dropped on every lookup across graphs).
    assert error is ValueError and "'attention_mask' was captured as None, got a Tensor" in text
    (error, text), _ = answer(spec_of(*HF), *hf(mode="plain"))
    assert error is ValueError and "'mode' was captured as 'rotate', got 'plain'" in text
    captured = spec_of((x,), dict(dtype=torch.float16))  # a value of the baked one's type
    (error, text), _ = answer(captured, (x,), dict(dtype=torch.bfloat16))
    assert error is ValueError and "captured as torch.float16, got torch.bfloat16" in text
    (error, text), _ = answer(spec_of(*HF), *hf(position_embeddings=[cos, sin]))
    assert error is TypeError and "structured as" in text


SAMPLES = {
    # name: (samples, a call structured as them, a call that is not)
    "a torch.Size": (((x, torch.Size([2, 3])), {}), ((x, torch.Size([2, 3])), {}),
                     ((x, (2, 3)), {})),
    "a named tuple": (((x,), dict(pe=CosSin(cos, sin), use_cache=False)),
                      ((x,), dict(pe=CosSin(sin, cos), use_cache=False)),
                      ((x,), dict(pe=cos, use_cache=False))),
    "an OrderedDict": (((x,), dict(d=collections.OrderedDict(a=cos, b=None))),
                       ((x,), dict(d=collections.OrderedDict(a=sin, b=None))),
                       ((x,), dict(d=sin))),
    "a dict with int keys": (((x,), dict(d={1: cos})), ((x,), dict(d={1: sin})),
                             ((x,), dict(d={2: sin}))),
}


@pytest.mark.parametrize("name", SAMPLES)
def test_samples_the_walk_cannot_follow_are_always_flattened(name):
    """Their containers are not exact tuples, lists or dicts with str keys,
    or come back from tree_unflatten as another type (torch.Size as a
    tuple): every call of theirs goes to tree_flatten, whose answer stands
    (a call putting a leaf where such a container was used to be read with
    too few leaves, past the end of the list)."""
    samples, like, unlike = SAMPLES[name]
    spec = spec_of(*samples)
    assert spec.walk is None
    tensors, flattened = answer(spec, *like)
    assert flattened is True and len(tensors) == len(spec.tensors)
    (error, text), _ = answer(spec, *unlike)
    assert error in (TypeError, ValueError), text


def test_a_tensor_subclass_registered_as_a_pytree_node_is_flattened_by_torch():
    class Pair(torch.Tensor):
        pass

    pytree.register_pytree_node(
        Pair, lambda p: ([p.as_subclass(torch.Tensor)], None),
        lambda leaves, _: leaves[0].as_subclass(Pair))
    try:
        walk, flatten = spec_of(*HF), spec_of(*HF, walk=False)
        args, kwargs = hf(position_embeddings=(cos.as_subclass(Pair), sin))
        got, flattened = answer(walk, args, kwargs)
        assert got == answer(flatten, args, kwargs)[0]
        assert got[0] is TypeError and flattened is None
    finally:
        pytree._deregister_pytree_node(Pair)


def test_flat_calls_are_not_walked():
    """A call of tensors only takes the flat path before any walk."""
    assert spec_of((x, cos), {}).walk is None
    assert spec_of((x, [cos]), {}).walk is not None and spec_of((x,), {"m": None}).walk is not None


def test_a_callable_that_changes_its_samples_in_place_does_not_change_the_walk():
    """Warm-up and capture call the callable with the spec's own args and
    kwargs; the walk compares calls with a copy of its own, so what the
    callable does to them (a dict re-keyed, a list appended to) changes
    nothing here."""
    def rekeys(x, opts):
        opts["mask"] = opts.pop("mask")
        return x

    def appends(x, acc):
        acc.append(x)
        return x

    rekeyed = spec_of((x,), {"opts": {"mask": mask, "bias": bias}}, fn=rekeys)
    rekeys(*rekeyed.args, **rekeyed.kwargs)  # as warm-up calls it
    (error, text), _ = answer(rekeyed, (x,), {"opts": {"bias": bias, "mask": mask}})
    assert error is TypeError and "structured as" in text
    assert answer(rekeyed, (x,), {"opts": {"mask": mask, "bias": bias}}) == (
        [id(x), id(mask), id(bias)], False)
    grown = spec_of((x, [cos]), {}, fn=appends)
    appends(*grown.args, **grown.kwargs)
    (error, text), _ = answer(grown, (x, [cos, sin]), {})
    assert error is TypeError and "structured as" in text


def test_defaults_are_stripped_before_the_walk():
    """Arguments the samples left out, passed with their defaults, are
    dropped first (cg_strip_defaults), as a graphed call drops them."""
    def with_default(x, opts, scale=1.0):
        return x

    spec = spec_of((x, {"a": cos}), {}, fn=with_default)
    assert answer(spec, (x, {"a": sin}), {"scale": 1.0}) == ([id(x), id(sin)], False)
    (error, text), _ = answer(spec, (x, {"a": sin}), {"scale": 2.0})
    assert error is ValueError and "'scale'" in text


def test_samples_nested_too_deep_to_compare_are_flattened(monkeypatch):
    """Where comparing the rebuilt samples with in_spec recurses too deep
    (some hundreds of levels), calls go to tree_flatten, as before the
    walk, instead of the description failing."""
    def too_deep(tree):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(cgraph._describe.pytree, "tree_structure", too_deep)
    spec = spec_of(*HF)
    monkeypatch.undo()
    assert spec.walk is None
    assert answer(spec, *hf())[1] is True


def test_a_float_constant_is_told_by_its_sign_and_a_nan_is_itself():
    """-0.0 == 0.0 in Python, but 1/c and copysign read the sign a graph
    baked in; NaN != NaN, but a NaN passed again is the value captured."""
    def scaled(x, c, d=0.0):
        return x * c

    spec = spec_of((x, 0.0), {}, fn=scaled)
    assert answer(spec, (x, 0.0), {})[0] == [id(x)]
    error, _ = answer(spec, (x, -0.0), {})
    assert error[0] is ValueError and "captured as 0.0, got -0.0" in error[1], error
    nan = spec_of((x, float("nan")), {}, fn=scaled)
    assert answer(nan, (x, float("nan")), {})[0] == [id(x)]
    np = pytest.importorskip("numpy")  # a float subclass: the same rule
    spec = spec_of((x, np.float64(0.0)), {}, fn=scaled)
    assert answer(spec, (x, np.float64(-0.0)), {})[0][0] is ValueError
    assert answer(spec_of((x, np.float64("nan")), {}, fn=scaled), (x, np.float64("nan")),
                  {})[0] == [id(x)]
    left_out = spec_of((x, 1.0), {}, fn=scaled)
    error, _ = answer(left_out, (x, 1.0, -0.0), {})
    assert error[0] is ValueError and "'d' is -0.0" in error[1]
    assert answer(left_out, (x, 1.0), {"d": 0.0})[0] == [id(x)]


def test_an_argument_captured_by_keyword_passed_positionally_is_named_by_type():
    """The message names the argument's type, never its repr (a CUDA
    tensor's would sync, in every entry that rejects the call), and says
    to pass it as the capture did."""
    def masked(x, mask=None, scale=None):
        return x

    error, _ = answer(spec_of((x,), {"mask": mask}, fn=masked), (x, mask), {})
    assert error[0] is TypeError and "argument 1 (a Tensor)" in error[1], error
    assert "as the capture did" in error[1] and "tensor(" not in error[1]


# ---- random samples and calls -------------------------------------------------

CONSTANTS = [None, True, False, 0, 1, 1.0, 0.0, -0.0, float("nan"), "a", "", 2]
ODD = [Mode.ROTATE, torch.float32, AlwaysEqual("a"), 1 + 0j, (), [], {}]


def random_tree(rng, depth=0):
    if depth > 3 or rng.random() < 0.45:
        return torch.zeros(1) if rng.random() < 0.5 else rng.choice(CONSTANTS)
    n = rng.randint(0, 3)
    kind = rng.choice(["tuple", "list", "dict", "dict"])
    if kind == "dict":
        return {rng.choice("abcde"): random_tree(rng, depth + 1) for _ in range(n)}
    items = [random_tree(rng, depth + 1) for _ in range(n)]
    return tuple(items) if kind == "tuple" else items


def random_call(rng, sample):
    """A call like `sample`, now and then unlike it: another container or
    leaf type, an item more or less, keys reordered."""
    r = rng.random()
    if isinstance(sample, torch.Tensor):
        return rng.choice([torch.zeros(1)] * 3 + [None, 1, True, torch.nn.Parameter(
            torch.zeros(1)), (torch.zeros(1),), []])
    if type(sample) in (tuple, list):
        items = [random_call(rng, c) for c in sample]
        if r < 0.05:
            return list(items) if type(sample) is tuple else tuple(items)
        if r < 0.08 and len(items) == 2:
            return CosSin(*items)
        if r < 0.10 and items:
            items.pop()
        elif r < 0.12:
            items.append(torch.zeros(1))
        elif r < 0.14:
            items.reverse()
        return type(sample)(items)
    if type(sample) is dict:
        items = [(k, random_call(rng, v)) for k, v in sample.items()]
        if r < 0.05:
            rng.shuffle(items)
        elif r < 0.07:
            return collections.OrderedDict(items)
        elif r < 0.09:
            items = [(AlwaysEqual(k), v) for k, v in items]
        elif r < 0.11 and items:
            items.pop()
        elif r < 0.13:
            items.append(("z", torch.zeros(1)))
        return dict(items)
    return sample if r < 0.5 else rng.choice(CONSTANTS + ODD)


def test_random_calls_get_tree_flatten_s_answers():
    """Seeded random samples (tuples, lists, dicts, empties, tensors,
    constants) and calls derived from them: the walk answers each as
    tree_flatten does, and takes a good share of them."""
    import random

    rng, walked, calls = random.Random(0), 0, 0

    def varargs(x, *args, **kwargs):
        return x

    for _ in range(300):
        args = tuple(random_tree(rng) for _ in range(rng.randint(1, 3)))
        kwargs = {k: random_tree(rng) for k in rng.sample("pqrs", rng.randint(0, 3))}
        try:
            walk = spec_of(args, kwargs, fn=varargs)
        except (TypeError, ValueError):  # samples cgraph refuses (a tensor that requires grad, ...)
            continue
        if walk.flat:
            continue
        flatten = spec_of(args, kwargs, walk=False, fn=varargs)
        for _ in range(5):
            call_args = tuple(random_call(rng, a) for a in walk.args)
            items = [(k, random_call(rng, v)) for k, v in walk.kwargs.items()]
            rng.shuffle(items)
            got, flattened = answer(walk, call_args, dict(items))
            assert got == answer(flatten, call_args, dict(items))[0], (args, kwargs)
            calls += 1
            walked += flattened is False
    assert calls > 500 and walked > calls // 10, (calls, walked)
