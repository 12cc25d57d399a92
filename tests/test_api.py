"""CPU tests: import, torch parity of the public signature, argument checks.
They run in CI (no GPU); argument checks happen before any CUDA call."""

import inspect

import pytest
import torch

import cgraph
from _helpers import assert_equal


def test_public_names():
    for name in ("make_graphed_callables", "make_graphed", "GraphedModule",
                 "CaptureError", "graph_pool_handle"):
        assert hasattr(cgraph, name), name
    assert issubclass(cgraph.CaptureError, RuntimeError)
    assert issubclass(cgraph.GraphedModule, torch.nn.Module)


def test_signature_matches_torch():
    """torch's parameters come first, in order, with the same kinds and
    defaults; cgraph may only add parameters after them."""
    ours = list(inspect.signature(cgraph.make_graphed_callables).parameters.values())
    theirs = list(inspect.signature(torch.cuda.make_graphed_callables).parameters.values())
    assert len(ours) >= len(theirs)
    for mine, torch_param in zip(ours, theirs):
        assert mine.name == torch_param.name
        assert mine.kind == torch_param.kind
        assert mine.default == torch_param.default, mine.name
    for extra in ours[len(theirs):]:
        # Parameters of newer torch releases, or keyword-only extras.
        assert extra.kind == inspect.Parameter.KEYWORD_ONLY or extra.name in (
            "capture_error_mode", "enable_annotations"), extra.name


def test_graphed_type_is_not_constructible():
    with pytest.raises(TypeError):
        cgraph.Graphed()


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(capture_error_mode="loud"), ValueError, "capture_error_mode"),
        (dict(num_warmup_iters=-1), ValueError, "num_warmup_iters"),
        (dict(pool="mine"), TypeError, "pool must be"),
        (dict(enable_annotations=True), ValueError, "enable_annotations"),
        (dict(kept_outputs="keep"), ValueError, "kept_outputs must be one of"),
        (dict(kept_outputs="alias", guard_outputs=True), ValueError, "disagree"),
    ],
)
def test_bad_options_are_refused(kwargs, error, text):
    with pytest.raises(error, match=text):
        cgraph.make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),), **kwargs)


def test_sample_args_must_be_a_tuple():
    with pytest.raises(TypeError, match=r"write \(x,\)"):
        cgraph.make_graphed_callables(torch.nn.Linear(4, 4), torch.randn(2, 4))


def test_unsupported_sample_arg_is_named():
    def f(x, scale):
        return x * scale

    with pytest.raises(TypeError, match="'scale'.*object"):
        cgraph.make_graphed_callables(f, (torch.randn(2), object()))


def test_constants_and_keywords_are_described_in_leaf_order():
    from cgraph._describe import Constant, Target, draft

    def f(x, n, *, mask, dtype):
        return x

    x, mask = torch.zeros(2), torch.ones(2)
    fields = draft(Target.of(0, f), (x, 3), {"mask": mask, "dtype": torch.float16}, set()).fields
    spec = cgraph._C.CallableSpec(**fields, device=0)
    assert list(spec.kwargs) == ["dtype", "mask"]  # sorted: calls flatten in this order
    assert spec.kw_names == ("dtype", "mask")
    assert spec.tensors == (x, mask) and spec.names == ("x", "mask") and not spec.flat
    assert spec.constants == (Constant(1, "n", 3), Constant(2, "dtype", torch.float16))
    assert spec.constants[0].name == "n" and spec.function is f and spec.module is None


def test_a_module_is_held_weakly_by_its_spec():
    """module.forward holds the Graphed, which holds the spec: a strong
    reference back would keep the module alive until the cycle collector."""
    from cgraph._describe import Target, draft

    layer = torch.nn.Linear(4, 4)
    fields = draft(Target.of(0, layer), (torch.randn(2, 4),), None, set()).fields
    spec = cgraph._C.CallableSpec(**fields, device=0)
    assert spec.module() is layer and spec.function is None and spec.training
    assert spec.eager is type(layer).forward and spec.eager_takes_module
    assert spec.params == tuple(layer.parameters()) and spec.flat


def test_a_module_spec_keeps_the_submodules_that_read_their_mode():
    """Note [Submodules' modes in per-module graphs]: a Dropout's and a
    BatchNorm's mode is baked into a graph, a Linear's is not; the module's
    own mode is `training`."""
    from cgraph._describe import Target, draft

    drop, norm = torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), drop, torch.nn.Sequential(norm))
    norm.eval()
    fields = draft(Target.of(0, model), (torch.randn(2, 4),), None, set()).fields
    spec = cgraph._C.CallableSpec(**fields, device=0)
    assert spec.modes == ((drop, norm), (True, False)) and spec.training
    assert cgraph._C.modes_are(*spec.modes)
    norm.train()
    assert not cgraph._C.modes_are(*spec.modes)
    function = draft(Target.of(0, len), (torch.zeros(1),), None, set()).fields
    assert function["modes"] == ((), ())
    for bad in ((), ((drop,), ()), ([drop], [True]), None):
        with pytest.raises(TypeError, match="modes must be"):
            cgraph._C.CallableSpec(**dict(fields, modes=bad, device=0))


@pytest.mark.parametrize("max_graphs, casts", [(None, True), (1, False), (8, False)])
@pytest.mark.parametrize("pool", [None, (0, 7)])
def test_make_graphed_casts_another_floating_dtype_only_under_torchs_rules(
        monkeypatch, max_graphs, casts, pool):
    """make_graphed without samples: max_graphs=None keeps torch's rules, its
    cast of another floating dtype into the graph too (new_graphed casts=);
    otherwise such a call gets a graph of its own."""
    from cgraph import _C, _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    made, real = [], _C.new_graphed

    def new_graphed(on_miss, max_graphs, **kwargs):
        made.append(kwargs["casts"])
        return real(on_miss, max_graphs, **kwargs)

    monkeypatch.setattr(_C, "new_graphed", new_graphed)  # _regraph's and _group's
    cgraph.make_graphed(torch.nn.Linear(4, 4), max_graphs=max_graphs, pool=pool)
    assert made == [casts]


def test_callable_spec_refuses_missing_unknown_and_mistyped_fields():
    from cgraph._describe import Target, draft

    fields = dict(draft(Target.of(0, len), (torch.zeros(1),), None, set()).fields, device=0)
    with pytest.raises(TypeError, match="missing field 'device'"):
        cgraph._C.CallableSpec(**{k: v for k, v in fields.items() if k != "device"})
    with pytest.raises(TypeError, match="unknown field"):
        cgraph._C.CallableSpec(**fields, colour="red")
    with pytest.raises(TypeError, match="CallableSpec.tensors must be a tuple"):
        cgraph._C.CallableSpec(**dict(fields, tensors=[torch.zeros(1)]))
    with pytest.raises(TypeError, match="keyword arguments only"):
        cgraph._C.CallableSpec(1)
    for bad in ((), ((1, -2), 3), ((1, 2), -1), ([1], 3), ((1,), 2.0)):
        with pytest.raises(TypeError, match="rng_warmup must be None or a tuple"):
            cgraph._C.CallableSpec(**dict(fields, rng_warmup=bad))
    spec = cgraph._C.CallableSpec(**dict(fields, rng_warmup=((0, 8), 16)))
    assert spec.rng_warmup == ((0, 8), 16)
    for bad in ((), ((), {}, {}), ([], {}), ((), [])):  # walked in C unchecked
        with pytest.raises(TypeError, match="walk must be None or"):
            cgraph._C.CallableSpec(**dict(fields, walk=bad))
    # Walked in C beside the leaves, their names formatted into errors: a
    # name that is no str aborted the process before.
    for bad in (((1, 12345, 3),), ((2, "b", 0), (1, "a", 0)), ((-1, "a", 0),), ([1, "a", 0],)):
        with pytest.raises(TypeError, match="constants must hold"):
            cgraph._C.CallableSpec(**dict(fields, constants=bad))


def test_a_module_whose_own_pre_hook_recomputes_its_weight_is_refused_naming_the_fix():
    """torch.nn.utils.prune and the legacy weight_norm/spectral_norm set the
    weight in a forward pre-hook, which runs around the graphed module's
    calls, outside its graphs: refused, naming parametrize and prune.remove.
    Inside a graphed parent the hook runs in the graphs: described."""
    import warnings

    from torch.nn.utils import prune

    from cgraph._describe import Target, draft
    pruned = torch.nn.Linear(4, 4)
    prune.l1_unstructured(pruned, "weight", 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
        normed = torch.nn.utils.weight_norm(torch.nn.Linear(4, 4))
    for module, kind in ((pruned, "L1Unstructured"), (normed, "WeightNorm")):
        with pytest.raises(ValueError, match=rf"{kind} that recomputes its weight.*parametrize"):
            draft(Target.of(0, module), (torch.randn(2, 4),), None, set())
    parent = torch.nn.Sequential(pruned)
    assert draft(Target.of(0, parent), (torch.randn(2, 4),), None, set()).fields["module"]


def test_a_parameter_whose_grads_autograd_makes_in_another_dtype_is_refused():
    """param.grad_dtype (bf16 weights, float32 grads): eager's AccumulateGrad
    hands out grads of that dtype, a per-module graph would hand out the
    parameter's.  Refused, naming the parameter and make_graphed_step; a
    grad_dtype equal to the parameter's, or unset, is not."""
    from cgraph._describe import Target, draft
    module = torch.nn.Linear(4, 4).to(torch.bfloat16)
    x = (torch.randn(2, 4, dtype=torch.bfloat16),)
    module.weight.grad_dtype = torch.bfloat16
    module.bias.grad_dtype = None
    assert draft(Target.of(0, module), x, None, set()).fields["module"]
    module.weight.grad_dtype = torch.float32
    parent = torch.nn.Sequential(module)  # held: a Target holds a module weakly
    with pytest.raises(ValueError, match=r"parameter '0.weight' of module 0 \(Sequential\) "
                                         r"has grad_dtype torch.float32.*make_graphed_step"):
        draft(Target.of(0, parent), x, None, set())


def test_samples_sharing_memory_get_their_own_static_buffers():
    from cgraph._describe import Target, draft

    x = torch.randn(2, 4, requires_grad=True)
    claimed = set()
    first = draft(Target.of(0, torch.nn.Linear(4, 4)), (x,), None, claimed).fields
    second = draft(Target.of(1, torch.nn.Linear(4, 4)), (x, x[0]), None, claimed).fields
    assert first["tensors"] == (x,) and first["args"][0] is x  # the first use keeps the sample
    a, b = second["tensors"]
    assert second["args"] == (a, b)  # the callable is called with the same tensors
    for t in (a, b):
        assert t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        assert t.requires_grad
    assert torch.equal(a, x) and torch.equal(b, x[0])


def test_a_sample_that_is_a_slice_of_more_memory_gets_a_static_buffer_of_its_own():
    """X[:4] as a sample: every later call's arguments would be copied into
    X's first rows (torch's graphs do that); an expanded sample cannot be
    written at all.  A sample that is its whole storage stays the sample."""
    from cgraph._describe import Target, draft

    data = torch.randn(16, 4)
    whole, row = torch.randn(4, 4).t(), torch.randn(1, 4).expand(4, 4)
    fields = draft(Target.of(0, lambda a, b, c: a), (data[:4], whole, row), None, set()).fields
    sliced, kept, expanded = fields["tensors"]
    assert kept is whole and torch.equal(sliced, data[:4]) and torch.equal(expanded, row)
    for t in (sliced, expanded):
        assert t.untyped_storage().data_ptr() not in (data.untyped_storage().data_ptr(),
                                                       row.untyped_storage().data_ptr())
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_a_graphed_module_walks_its_parameters_only_when_one_may_have_been_replaced(
        monkeypatch):
    """Note [Which registrations re-check graphed modules]: a submodule
    registered outside every graphed module (Hugging Face's layers[:n] on
    every forward) costs a class comparison, no walk; a class swap
    (fully_shard, which registers nothing), a parameter or buffer registered
    anywhere, or a submodule registered inside, costs a walk, which raises
    on a replaced tensor, and again on every later call."""
    from cgraph import _describe
    walks = []
    real = _describe._named_state

    def counting(module):
        walks.append(module)
        return real(module)

    monkeypatch.setattr(_describe, "_named_state", counting)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    check = _describe.StateCheck(0, block)
    walks.clear()
    torch.nn.ModuleList([block])[:1]  # elsewhere, holding it
    check(block)
    assert walks == []
    block.__class__ = type("Swapped", (torch.nn.Sequential,), {})  # nothing replaced
    check(block)
    check(block)
    assert walks == [block]
    torch.nn.Linear(2, 2)  # anywhere: might be attached without a hook (ModuleList.insert)
    check(block)
    assert len(walks) == 2
    block.extra = torch.nn.Module()  # inside, and empty: passes, watched from then on
    check(block)
    assert len(walks) == 3
    with torch.no_grad():  # a tensor registered on the new submodule
        block.extra.register_buffer("scale", torch.ones(1))
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"'extra\.scale' was added to graphed module 0"):
            check(block)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4))
    check = _describe.StateCheck(1, fresh)
    torch.nn.ModuleList([fresh])[:1]
    fresh.__class__ = type("Sharded", (torch.nn.Sequential,), {})  # as fully_shard does
    fresh[0]._parameters["weight"] = torch.nn.Parameter(torch.zeros(4, 4))  # no hook runs
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"'0\.weight' of graphed module 1"):
            check(fresh)


def test_a_submodule_replaced_or_deleted_after_capture_raises_one_added_passes():
    """StateCheck: a Dropout replaced by an Identity holds no tensor, but
    the graphs would go on running the dropout; a deleted submodule too.
    One replaced before the first capture (make_graphed without samples)
    is what that capture ran; one attached under a new name ran in no
    capture and passes, as one the forward made during its capture (adopt)
    does."""
    from cgraph import _describe
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    check = _describe.StateCheck(0, block)  # make_graphed(block): no capture yet
    block[1] = torch.nn.Identity()  # before the first call
    check.adopt(block)  # the first capture, of the Identity
    check(block)
    block.loss = torch.nn.MSELoss()  # under a new name
    check(block)
    block[1] = torch.nn.Dropout(0.5)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"submodule '1' of graphed module 0 .*replaced"):
            check(block)
    other = torch.nn.Module()
    other.inner = torch.nn.Sequential(torch.nn.GELU())
    check = _describe.StateCheck(1, other)
    check.adopt(other)  # the first capture
    other.inner.made = torch.nn.ReLU()  # in a later warm-up or capture
    check.adopt(other)
    check(other)
    del other.inner.made  # registers nothing: seen at the next registration anywhere
    torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"submodule 'inner\.made' of graphed module 1 .*deleted"):
        check(other)


def test_a_tensor_the_forward_registered_during_its_capture_is_adopted_a_later_one_raises():
    """StateCheck.adopt, called after each capture: a buffer the forward
    registered under a new name there (a cache made on the first call) is
    one the graphs read, not a replacement; a name added after that capture,
    or a tensor replaced under a name it had, still raises.  The GPU test:
    tests/test_replay.py, buffer_registered_on_the_first_call."""
    from cgraph import _describe
    block = torch.nn.Linear(4, 4)
    check = _describe.StateCheck(0, block)
    block.register_buffer("cache", torch.ones(4))  # in warm-up or capture
    check.adopt(block)
    check(block)
    check(block)
    block.register_buffer("later", torch.ones(4))  # after the capture
    with pytest.raises(RuntimeError, match=r"'later' was added to graphed module 0"):
        check(block)
    other = torch.nn.Linear(4, 4)
    check = _describe.StateCheck(1, other)
    other.register_buffer("cache", torch.ones(4))
    check.adopt(other)
    other.register_buffer("cache", torch.zeros(4))  # a second capture replaced it
    check.adopt(other)
    with pytest.raises(RuntimeError, match=r"'cache' of graphed module 1"):
        check(other)


def test_tensors_swapped_in_by_functional_call_are_seen_by_the_check():
    """Note [Tensors swapped in without registration] (cgraph/_describe.py):
    torch.func.functional_call swaps parameters in without a registration
    hook; the graphed module called inside raises instead of replaying its
    captured weights, and passes again once they are swapped back."""
    from cgraph import _describe
    block = torch.nn.Linear(4, 4)
    check = _describe.StateCheck(0, block)
    seen = []

    def checked(module, args):
        try:
            check(module)
        except RuntimeError as e:
            seen.append(str(e))

    block.register_forward_pre_hook(checked)
    other = {"weight": torch.zeros(4, 4), "bias": torch.zeros(4)}
    torch.func.functional_call(block, other, (torch.randn(2, 4),))
    assert len(seen) == 1 and "'weight' of graphed module 0" in seen[0]
    assert "functional_call" in seen[0]
    check(block)  # the parameters swapped back: the same tensors again


def test_a_buffer_converted_by_module_to_is_seen_by_the_check():
    """Note [Tensors swapped in without registration], continued: a bf16
    model's fp32 buffer (a rotary inv_freq) converted by model.to(bf16)
    after graphing is replaced without a registration, its parameters
    unmoved; the check walks after any conversion and names it."""
    from cgraph import _describe
    block = torch.nn.Linear(4, 4).to(torch.bfloat16)
    block.register_buffer("inv_freq", torch.ones(2))
    check = _describe.StateCheck(0, block)
    check(block)
    block.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"'inv_freq' of graphed module 0 .*replaced.*"
                                           r"module.to\(\) or .half\(\) converting a buffer"):
        check(block)


def test_a_tensor_added_after_capture_is_named_as_added():
    """A buffer registered after capture under a new name: the graphs never
    read it, though the forward may; named as added, not replaced."""
    from cgraph import _describe
    block = torch.nn.Linear(4, 4)
    check = _describe.StateCheck(0, block)
    block.register_buffer("scale", torch.ones(4))
    with pytest.raises(RuntimeError, match=r"'scale' was added to graphed module 0 \(Linear\) "
                                           r"after capture.*before graphing"):
        check(block)


def test_modules_are_watched_by_identity():
    """The registration hooks run for every module anywhere: one whose class
    has a value __eq__ and so no __hash__ (a dataclass) is still built and
    given submodules while cgraph is imported."""
    import dataclasses  # (import cgraph installed the hooks: cgraph._describe)

    @dataclasses.dataclass(eq=True)
    class Scaled(torch.nn.Module):
        factor: float = 2.0

        def __post_init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

    model = Scaled()
    model.other = torch.nn.Linear(2, 2)
    assert isinstance(model.other, torch.nn.Linear)


def test_sample_kwargs_must_be_dicts():
    with pytest.raises(TypeError, match="sample_kwargs of callable 0 must be a dict"):
        cgraph.make_graphed(torch.nn.Linear(4, 4), (torch.randn(2, 4),), sample_kwargs=[1])
    layers = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    samples = ((torch.randn(2, 4),), (torch.randn(2, 4),))
    with pytest.raises(ValueError, match="sample_kwargs must be a tuple of 2"):
        cgraph.make_graphed_callables(layers, samples, sample_kwargs=({},))


def test_tuple_of_callables_needs_matching_samples():
    layers = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="2 tuples"):
        cgraph.make_graphed_callables(layers, ((torch.randn(2, 4),),))


def test_not_callable():
    with pytest.raises(TypeError, match="not callable"):
        cgraph.make_graphed(42, (torch.randn(2),))


def _hooked_layer(seen: list):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4).cuda()
    layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    layer.register_forward_hook(lambda m, args, out: out + 1)
    layer.register_full_backward_hook(lambda m, gin, gout: seen.append(gout[0].clone()))
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["make_graphed", "drop-in"])
def test_module_hooks_run_around_every_call(how):
    """torch refuses a module with hooks; cgraph runs them on every call,
    outside the graphs, as eager does (FSDP2's hooks are such hooks)."""
    seen, seen_eager = [], []
    layer, eager = _hooked_layer(seen), _hooked_layer(seen_eager)
    sample = (torch.randn(2, 4, device="cuda", requires_grad=True),)
    graphed = (cgraph.make_graphed(layer, sample) if how == "make_graphed"
               else cgraph.make_graphed_callables(layer, sample))
    for _ in range(3):
        x = torch.randn(2, 4, device="cuda", requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, ref = graphed(x), eager(x_eager)
        assert_equal(out, ref, "output")
        out.square().sum().backward()
        ref.square().sum().backward()
        assert_equal(x.grad, x_eager.grad, "input grad")
    assert len(seen) == len(seen_eager) == 3
    for got, want in zip(seen, seen_eager):
        assert_equal(got, want, "grad seen by the backward hook")
    assert_equal(layer.weight.grad, eager.weight.grad, "weight grad")


def test_trainable_buffer_is_refused():
    layer = torch.nn.Linear(4, 4)
    layer.register_buffer("scale", torch.ones(4, requires_grad=True))
    with pytest.raises(ValueError, match="buffer"):
        cgraph.make_graphed(layer, (torch.randn(2, 4),))


@pytest.mark.gpu
def test_autocast_cache_setting_is_left_as_found():
    with torch.autocast("cuda", cache_enabled=True):
        cgraph.make_graphed(torch.nn.Linear(4, 4).cuda(), (torch.randn(2, 4, device="cuda"),))
        assert torch.is_autocast_cache_enabled()


def test_capture_session_patches_are_removed_even_after_an_error():
    """Note [Patches during capture] in cgraph/_capture.py: every patch is
    undone when the session ends, also when warm-up or capture raised."""
    from cgraph import _capture

    originals = (torch.cuda.get_rng_state, torch.cuda.set_rng_state, torch.manual_seed,
                 torch.cuda.manual_seed, torch.autograd.backward)
    with pytest.raises(KeyError):
        with _capture.capture_session(()):
            assert torch.cuda.get_rng_state is not originals[0]
            assert torch.manual_seed is not originals[2]
            raise KeyError("the capture failed")
    assert (torch.cuda.get_rng_state, torch.cuda.set_rng_state, torch.manual_seed,
            torch.cuda.manual_seed, torch.autograd.backward) == originals


def test_a_buffer_assigned_anew_in_a_set_up_keeps_its_tensor_where_alike():
    """Note [A buffer assigned anew during set-up] (cgraph/_capture.py), on
    the CPU: inside a capture session a buffer assigned a tensor of its own
    shape, dtype and device keeps its tensor, with the new values; one of
    another shape, or one that requires grad, is replaced as in eager, and
    so is every buffer once the session is over."""
    from cgraph import _capture

    module = torch.nn.Module()
    module.register_buffer("ema", torch.zeros(3))
    module.register_buffer("table", torch.zeros(2))
    ema, table = module.ema, module.table
    with _capture.capture_session(()):
        module.ema = 0.5 * module.ema + torch.ones(3)
        assert module.ema is ema and torch.equal(ema, torch.ones(3))
        module.table = torch.ones(4)  # a cache that grows
        assert module.table is not table and module.table.shape == (4,)
        module.ema = torch.ones(3, requires_grad=True) * 2
        assert module.ema is not ema
        module.register_buffer("new", torch.ones(1))  # a new name: registered as it is
        module.ema = ema
        module.register_buffer("a", torch.zeros(2))
        module.register_buffer("b", torch.ones(2))
        module.a, module.b = module.b, module.a  # a swap: replaced, as in eager
        assert module.a.tolist() == [1.0, 1.0] and module.b.tolist() == [0.0, 0.0]
        module.original = module.table  # an alias attribute (HF's original_inv_freq)
        module.table = torch.full((4,), 5.0)
        assert module.original.tolist() == [1.0] * 4, "the alias keeps its values"
        with torch.inference_mode():
            module.register_buffer("frozen", torch.zeros(2))
        module.frozen = torch.ones(2)  # an inference tensor takes no copy: replaced
        assert not module.frozen.is_inference()
    module.ema = torch.full((3,), 7.0)  # outside a set-up: eager's replacement
    assert module.ema is not ema and torch.equal(ema, torch.ones(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_clear_error_without_cuda():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        cgraph.make_graphed(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(RuntimeError, match="no CUDA device"):
        cgraph.graph_pool_handle()


@pytest.mark.parametrize("backend, says", [
    ("cudaMallocAsync", r"PYTORCH_CUDA_ALLOC_CONF \(or PYTORCH_ALLOC_CONF\) selects the "
                        r"cudaMallocAsync backend.*Remove backend:cudaMallocAsync"),
    ("pluggable", r"allocator is 'pluggable' \(a pluggable allocator\).*no "
                  r"change_current_allocator")])
def test_an_allocator_other_than_torch_s_native_one_is_refused_naming_its_fix(
        monkeypatch, backend, says):
    """Graphs live in the native allocator's private pools: another backend
    is refused before anything runs, each with its own fix (a pluggable
    allocator was told to remove backend:cudaMallocAsync before)."""
    from cgraph import _api
    monkeypatch.setattr(_api._C, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)
    with pytest.raises(RuntimeError, match=says):
        cgraph.graph_pool_handle()


def test_leaf_names_come_from_forward_signature():
    from cgraph._describe import Target, leaf_names

    class M(torch.nn.Module):
        def forward(self, x, batch):
            return x

    batch = {"mask": torch.zeros(1), "ids": [torch.zeros(1)]}
    names = leaf_names(Target.of(0, M()).signature, (torch.zeros(1), batch))
    assert names == ["x", "batch['mask']", "batch['ids'][0]"]  # pytree keeps dict order


def test_buckets_are_checked_and_sorted():
    from cgraph._buckets import normalize

    assert normalize([16, 8, 8]) == {0: (8, 16)}
    assert normalize({1: [256, 128], 0: (4,)}) == {0: (4,), 1: (128, 256)}
    for bad in ([], [0], {"a": [1]}, {0: []}, [True], "8", 8):
        with pytest.raises(ValueError, match="buckets must be sizes"):
            normalize(bad)


def test_a_step_refuses_optimizers_it_cannot_capture_naming_the_fix(monkeypatch):
    from cgraph import _step
    from cgraph._step import _check_capturable

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="LBFGS evaluates its closure.*outside the graphed"):
        _check_capturable(torch.optim.LBFGS(params), scaled=False)
    with pytest.raises(ValueError, match="SparseAdam has no capturable form.*outside"):
        _check_capturable(torch.optim.SparseAdam(params), scaled=False)
    _check_capturable(torch.optim.Adam(params), scaled=False)
    _check_capturable(torch.optim.SGD(params, lr=0.1), scaled=False)
    _check_capturable(torch.optim.Adagrad(params), scaled=False)  # cgraph steps it
    # A scaler with an optimizer that is not fused: a conditional node where
    # this torch and CUDA have them, else refused.
    monkeypatch.setattr(_step._C, "conditional_nodes", lambda: True)
    _check_capturable(torch.optim.Adam(params), scaled=True)
    monkeypatch.setattr(_step._C, "conditional_nodes", lambda: False)
    with pytest.raises(ValueError, match=r"GradScaler.*Adam\(\.\.\., fused=True\)"):
        _check_capturable(torch.optim.Adam(params), scaled=True)
    with pytest.raises(ValueError, match=r"NAdam has no fused form.*Adam, AdamW or SGD"):
        _check_capturable(torch.optim.NAdam(params), scaled=True)  # it has no fused=


def test_a_group_made_capturable_is_saved_as_built_and_loads_on_the_cpu():
    """Note [Capturable optimizers]: the graph needs capturable=True, but a
    checkpoint saved meanwhile records the group as its user built it:
    loaded into a CPU copy, it steps (torch refuses capturable=True off the
    GPU).  A group built capturable is saved so."""
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.Adam([{"params": params}, {"params": [torch.nn.Parameter(torch.randn(2))],
                                                  "capturable": True}], lr=1e-3)
    step = cgraph.make_graphed_step(lambda: None)
    for group in opt.param_groups:
        step._capturable(opt, group)
    assert all(g["capturable"] for g in opt.param_groups)
    saved = opt.state_dict()
    assert [g["capturable"] for g in saved["param_groups"]] == [False, True]
    copy = torch.optim.Adam([torch.nn.Parameter(torch.randn(3))], lr=1e-3)
    saved["param_groups"] = saved["param_groups"][:1]
    copy.load_state_dict(saved)
    copy.param_groups[0]["params"][0].grad = torch.ones(3)
    copy.step()


def test_an_lr_the_step_sets_itself_is_refused_at_capture():
    """group["lr"] = ... inside the step replaces the device lr the capture
    hands the optimizer: the graph would bake that value in.  Refused as the
    capture's device lrs are put back."""
    from cgraph._step import _Group
    group = {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1}
    step = cgraph.make_graphed_step(lambda: None)
    step.groups = [_Group(group, torch.tensor(0.1), 0.1, {}, ())]
    with step._device_lrs():
        assert isinstance(group["lr"], torch.Tensor)
    assert group["lr"] == 0.1
    with pytest.raises(RuntimeError, match=r"sets the learning rate.*after the graphed step"):
        with step._device_lrs():
            group["lr"] = 0.05
    assert group["lr"] == 0.1  # put back all the same
    # Another group's device lr is no lr of the step's own: ZeRO's step
    # copies its groups' values into its inner optimizer's.
    inner = {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1}
    step.groups.append(_Group(inner, torch.tensor(0.1), 0.1, {}, ()))
    with step._device_lrs():
        inner["lr"] = group["lr"]
    assert inner["lr"] == 0.1


def test_rprop_s_lr_is_neither_a_device_tensor_nor_compared():
    """Rprop reads lr only where it makes a parameter's state, on the host:
    its lr stays the group's own (a float or a tensor, not refused), and a
    scheduler changing it does not recapture (it changes nothing once the
    state exists, in eager too)."""
    step = cgraph.make_graphed_step(lambda: None)
    for lr in (0.01, torch.tensor(0.01)):
        opt = torch.optim.Rprop([torch.nn.Parameter(torch.zeros(2))], lr=lr)
        g = step._capturable(opt, opt.param_groups[0])
        assert g.lr is None and "lr" not in g.baked and opt.param_groups[0]["capturable"]


def test_a_step_refuses_an_optimizer_of_parameters_off_the_gpu():
    """FSDP2's CPU offload keeps parameters on the CPU: a graph would step
    them once, at capture."""
    from cgraph._step import _check_on_the_gpu

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="parameter 0 of param group 0 of AdamW is on cpu.*"
                                         "outside the graphed step"):
        _check_on_the_gpu(torch.optim.AdamW(params))
    _check_on_the_gpu(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2),
                                                            requires_grad=False)]))  # frozen


def test_a_refused_recapture_drops_the_graph_it_would_have_replaced():
    """A captured step captures again when a hyperparameter baked into its
    graph changes; refused then (here: an optimizer with no capturable form
    since), the old graph is freed as a capture frees it: kept, it would
    hold its pool, and replay a step now refused once the hyperparameter was
    set back.  On the CPU: a stand-in for the graph, the refusal comes first."""
    class Graph:
        is_reset = False

        def reset(self):
            self.is_reset = True

    step = cgraph.make_graphed_step(lambda x: None)
    old = step.graphed = Graph()
    step.static = "the old capture's inputs"
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))])
    step.optimizers.add(lbfgs)  # as its warm-up finds it (held weakly)
    with pytest.raises(ValueError, match="LBFGS"):
        step._capture([torch.zeros(2)], None)
    assert old.is_reset and (step.graphed, step.static) == (None, None)


@pytest.mark.parametrize("make, device_lr", [
    (lambda ps: torch.optim.RMSprop(ps, foreach=False), False),
    (lambda ps: torch.optim.Adadelta(ps, foreach=False), False),
    (lambda ps: torch.optim.RMSprop(ps, foreach=True), True),
    (lambda ps: torch.optim.Adam(ps, foreach=False), True),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), False),
])
def test_a_step_gives_the_lr_as_a_tensor_only_to_steps_that_read_it_on_the_device(
        make, device_lr):
    """Single-tensor RMSprop and Adadelta turn a tensor lr back into a
    number (alpha=-lr): a host read.  Their lr stays baked into the graph."""
    from cgraph._step import GraphedStep
    opt = make([torch.nn.Parameter(torch.zeros(2))])
    group = GraphedStep._capturable(None, opt, opt.param_groups[0])
    assert (group.lr is not None) == device_lr
    assert ("lr" in group.baked) != device_lr


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adagrad(ps, lr=torch.tensor(0.1)),
    lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1)),
    lambda ps: torch.optim.RMSprop(ps, lr=torch.tensor(0.1), foreach=False),
], ids=["adagrad", "sgd", "rmsprop-single-tensor"])
def test_a_tensor_lr_a_step_would_read_as_a_number_is_refused(make):
    """An LR scheduler changes a tensor lr in place: baked into the graph as
    a number, the change would go unseen."""
    from cgraph._step import GraphedStep
    opt = make([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="tensor lr.*Pass lr as a float"):
        GraphedStep._capturable(None, opt, opt.param_groups[0])


def test_repr_of_a_callable_with_no_graph_yet():
    graphed = cgraph._C.new_graphed(lambda *a: False)
    assert repr(graphed) == "<cgraph.Graphed: no graph yet (captures on its first call)>"
    assert graphed.num_graphs == 0 and graphed.specs == [] and graphed.pools == []
    graphed.reset()
    assert repr(graphed) == "<cgraph.Graphed: reset>" and graphed.is_reset


def test_a_layer_sharing_a_pool_runs_eagerly_when_first_called_inside_a_backward():
    """A callable graphed without samples with a pool= whose first call
    comes inside a backward (a checkpoint's recompute) runs it eagerly: no
    capture runs inside autograd's backward (Note [One pool for separately
    graphed callables] in cgraph/_group.py)."""
    from cgraph._capture import CaptureOptions
    from cgraph._describe import Target
    from cgraph._group import graphed_layer

    layer = torch.nn.Linear(4, 4)
    graphed = graphed_layer(Target.of(0, layer), (0, 987654), CaptureOptions(3, False, 0, 0), 8)
    x = torch.randn(2, 4)
    seen = []

    class CallsTheLayerInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(graphed(x))
            return grad

    CallsTheLayerInBackward.apply(torch.randn(2, requires_grad=True)).sum().backward()
    torch.testing.assert_close(seen[0], layer(x), rtol=0, atol=0)
    assert graphed.stats["eager_on_miss"] == 1 and graphed.num_graphs == 0


def test_on_miss_is_told_where_to_capture_and_must_return_the_graph():
    """A call no graph takes reaches on_miss with the call and one record,
    the CaptureSite the native core chose (a fresh pool here: no graph
    yet), and on_miss returns the Graphed it captured, which the core
    adopts (Note [Several graphs per callable] in csrc/graphed.c).
    Anything else is a bug, refused; nothing ran eagerly."""
    seen = []

    def on_miss(graphed, args, kwargs, site):
        seen.append((args, kwargs, site))
        return "not a Graphed"

    graphed = cgraph._C.new_graphed(on_miss, 2)
    with pytest.raises(TypeError, match="not a Graphed with the one graph just captured"):
        graphed(1, x=2)
    ((args, kwargs, site),) = seen
    assert args == (1,) and kwargs == {"x": 2}
    assert isinstance(site, cgraph._C.CaptureSite) and len(site.pool) == 2, site
    assert (site.warm_in_pool, site.keep_activations, site.pending, site.asks_again) == \
        (False, False, False, False)
    assert graphed.num_graphs == 0 and graphed.stats["eager_on_miss"] == 0


def test_a_layer_captures_in_its_pool_and_a_warm_up_state_there_refuses_for_good():
    """A layer graphed one by one with a pool= is told to capture in that
    pool, warming up there and keeping its activations (no graph of the pool
    is pending); a warm-up that left state there (CaptureError kind
    "warmup_state") cannot be dropped with its graphs, so the native core
    raises it again at every later call no graph takes, without capturing
    (Note [Warm-up in the pool] in csrc/aten_setup.cpp)."""
    seen = []

    def on_miss(graphed, args, kwargs, site):
        seen.append(site)
        error = cgraph.CaptureError("cgraph: a warm-up left state in the pool")
        error.kind = "warmup_state"
        raise error

    pool = (0, 987655)
    graphed = cgraph._C.new_graphed(on_miss, 8, shared_pool=pool, layer=True,
                                    eager=lambda args, kwargs: None)
    for _ in range(2):
        with pytest.raises(cgraph.CaptureError, match="left state") as raised:
            graphed(torch.zeros(2))
        assert raised.value.kind == "warmup_state"
    assert len(seen) == 1, seen
    assert (seen[0].pool, seen[0].warm_in_pool, seen[0].keep_activations,
            seen[0].asks_again) == (pool, True, True, False)
    assert graphed.num_graphs == 0 and set(graphed.stats.values()) == {0}



# CaptureError.kind's values, in the native core's order: public, users compare them.
FAILURE_KINDS = ("other", "sync", "invalidated", "unjoined", "wrong_thread", "legacy_stream",
                 "host_copy", "nested_graphs", "seed_read", "rng_changed", "rng_regions",
                 "reentrant_leaf", "warmup_state")


def test_failure_kinds_come_from_one_table_that_explain_and_the_step_read():
    """C names each kind once (CG_FAILURE_KINDS in csrc/cgraph.h): _C gives
    the names by kind and each kind's int, and explain and the graphed step
    take the names they share with CaptureError from there."""
    from cgraph import _explain, _step

    assert cgraph._C.FAILURE_KINDS == FAILURE_KINDS
    for kind, name in enumerate(FAILURE_KINDS):
        assert getattr(cgraph._C, f"FAILURE_{name.upper()}") == kind, name
    assert (_explain._SYNC, _explain._HOST_COPY, _explain._RNG_CHANGED,
            _explain._SEED_READ) == ("sync", "host_copy", "rng_changed", "seed_read")
    assert _step._RNG_REGIONS == "rng_regions"


# Graphed.stats' keys, in order: the engines' counters, the Graphed's own, graphs.
STATS = ("forward", "backward", "grads_copied", "grads_added", "grads_slow",
         "copied_in_graph", "copied_before", "written_back", "outputs_copied",
         "outputs_invalidated",
         "input_grads_copied", "param_grads_copied", "eager_pending", "eager_past_limit",
         "eager_on_miss", "args_flattened", "graphs")


def test_stats_counters_are_declared_once_and_each_documented():
    """Graphed.stats and its docstring come from one declaration per counter
    (CG_STATS_COUNTERS in csrc/cgraph.h, GRAPHED_COUNTERS in graphed.c):
    every key users read is there, starting at 0, with a line of its own."""
    stats = cgraph._C.new_graphed(lambda *a: False).stats
    assert tuple(stats) == STATS and set(stats.values()) == {0}, stats
    doc = cgraph.Graphed.stats.__doc__
    for name in STATS:
        assert f"\n  {name}: " in doc, (name, doc)


def test_a_set_up_on_a_second_thread_is_refused_while_one_is_under_way():
    """Note [One set-up at a time] (cgraph/_capture.py): set-ups nest on
    their thread, and inside a backward (autograd runs a CUDA one on a
    thread of its own: a checkpointed recompute calling a graphed layer
    there); another thread's raises, naming the fix, until the first ends."""
    import threading
    from cgraph._capture import one_setup_at_a_time
    inside, leave = threading.Event(), threading.Event()

    class SetsUpInItsBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            with one_setup_at_a_time():  # nested: inside a backward
                return grad

    def first():
        with one_setup_at_a_time(), one_setup_at_a_time():  # nested on its own thread
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="another thread is warming up.*Graph from one "
                                               "thread"):
            with one_setup_at_a_time():
                pass
        SetsUpInItsBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    finally:
        leave.set()
        thread.join(30)
    with one_setup_at_a_time():  # free again
        pass


def test_a_seed_during_a_capture_is_refused_naming_the_call(monkeypatch):
    """Item 3 of Note [Patches during capture], the seeds: torch.manual_seed
    refused while a stream captures (rng_changed), and seeding as torch does
    otherwise (as in a warm-up)."""
    from cgraph import _C, _capture

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with _capture._rng_hooks():
        torch.manual_seed(3)
        assert torch.initial_seed() == 3
        capturing[0] = True
        with pytest.raises(_C.Refusal, match="torch.*manual_seed was called") as info:
            torch.manual_seed(4)
        assert info.value.args[1] == _C.FAILURE_RNG_CHANGED
    assert torch.initial_seed() == 3


# ---- copies of graphed models: Note [Copying a graphed model] ----------------


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu()


class _Hooked(_Block):
    """A block whose own forward is an instance attribute (as a compiled
    forward is), not the class's."""

    def __init__(self):
        super().__init__()
        self.forward = self.doubled

    def doubled(self, x):
        return 2 * _Block.forward(self, x)


_HOOK_CALLS = []


def _count_call(module, args, out):
    _HOOK_CALLS.append(module)


def _copies(model):
    import copy
    import pickle
    return {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model))}


def _eager_out(block, x):
    """What `block` computes eagerly, graphed or not."""
    return (block.__dict__.get("_cgraph_own_forward") or type(block).forward.__get__(block))(x)


@pytest.mark.parametrize("kind", ["in place", "in place with buckets", "own forward"])
def test_a_copy_of_a_model_with_graphed_blocks_runs_its_own_blocks_eagerly(monkeypatch, kind):
    """copy.deepcopy (an EMA copy) and pickle (torch.save(model)) of a model
    whose blocks graph_layers graphed: each copied block runs the forward it
    had before graphing, on the copy's parameters, and is not graphed; the
    original keeps its graphs."""
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    model = torch.nn.Sequential(_Hooked() if kind == "own forward" else _Block(), _Block())
    for block in model:
        cgraph._api.graphed_in_place(block, **({"buckets": [8]} if "buckets" in kind else {}))
    x = torch.randn(3, 4)
    for how, twin in _copies(model).items():
        assert not any(cgraph._api.is_graphed(b) for b in twin), how
        assert all(cgraph._api.is_graphed(b) for b in model), how
        for block, theirs in zip(twin, model):
            assert block.linear.weight is not theirs.linear.weight
            forward = block.forward  # of the copy, not the original
            assert (forward.module() if isinstance(forward, cgraph._api.ClassForward)
                    else forward.__self__) is block, how
            assert_equal(block(x), _eager_out(theirs, x), f"{how}: copied block")
        with torch.no_grad():
            twin[0].linear.weight.add_(1.0)  # the copy's own parameters
        assert not torch.equal(twin[0](x), _eager_out(model[0], x)), how


def test_a_copy_of_a_graphed_module_is_an_eager_copy_with_its_names(monkeypatch):
    """make_graphed's GraphedModule, with and without hooks on the module:
    its copy is an EagerCopy of the copied module (the hooks run around it),
    with the original's state_dict keys; a graphed function refuses to be
    copied, naming the fix."""
    import copy
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    plain, hooked = _Block(), _Block()
    _HOOK_CALLS.clear()
    hooked.register_forward_hook(_count_call)  # a module-level function: picklable
    x = torch.randn(3, 4)
    for module in (plain, hooked):
        graphed = cgraph.make_graphed(module)
        for how, twin in _copies(graphed).items():
            assert type(twin) is _api.EagerCopy and not cgraph._api.is_graphed(twin.module), how
            assert list(twin.state_dict()) == list(graphed.state_dict()), how
            assert twin.linear is twin.module.linear  # attributes read through, as the original's
            assert_equal(twin(x), _Block.forward(module, x), how)
    assert len(_HOOK_CALLS) == 2  # the copies' calls went through the copied hooks
    fn = cgraph.make_graphed(lambda t: t * 2)
    with pytest.raises(TypeError, match="cannot be copied or pickled.*state_dict"):
        copy.deepcopy(fn)


# ---- another thread while one sets up: Note [One set-up at a time] -----------


def _on_a_thread(fn):
    """fn() on another thread: what it raised, or None."""
    import threading
    raised = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: B036 (handed back to the test)
            raised.append(e)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None


def test_another_threads_backward_during_a_set_up_is_not_checked_as_a_region():
    """The reentrant-region check (Note [Reentrant regions]) patches
    torch.autograd.backward for the whole process during a set-up: another
    thread's loss.backward() then is not the set-up's, and trains as
    always; a .backward() inside a backward (a reentrant region's) is still
    checked."""
    import types
    from cgraph import _capture
    w = torch.randn(3, requires_grad=True)  # neither an argument nor a parameter
    x = torch.randn(3, requires_grad=True)

    class Region(torch.autograd.Function):  # what a reentrant checkpoint's backward does
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            with torch.enable_grad():
                torch.autograd.backward((w * 3).sum())
            return grad

    with _capture._reentrant_regions_checked([types.SimpleNamespace(tensors=(x,), params=())]):
        assert _on_a_thread(lambda: (w * 2).sum().backward()) is None
        assert_equal(w.grad, torch.full((3,), 2.0), "the other thread's grad")
        with pytest.raises(cgraph._C.Refusal, match="use_reentrant"):
            Region.apply(x).sum().backward()


def test_another_threads_reduce_overhead_model_runs_during_a_set_up(monkeypatch):
    """torch.compile's cudagraph trees are refused inside a set-up (item 7
    of Note [Patches during capture]); on another thread, not capturing,
    they run."""
    from torch._inductor import cudagraph_trees
    from cgraph import _capture
    ran = []
    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "_run",
                        lambda self, *args: ran.append(args) or "ran", raising=True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no GPU here
    manager = object.__new__(cudagraph_trees.CUDAGraphTreeManager)
    with _capture.one_setup_at_a_time(), _capture._cudagraph_trees_refused():
        assert _on_a_thread(lambda: cudagraph_trees.CUDAGraphTreeManager._run(manager, 1)) is None
        with pytest.raises(cgraph._C.Refusal, match="reduce-overhead"):
            cudagraph_trees.CUDAGraphTreeManager._run(manager, 2)
    assert ran == [(1,)]


def test_a_module_graphed_in_place_is_refused_when_graphed_again_without_a_reset(monkeypatch):
    """A drop-in cell run twice in a notebook: the module's forward is a
    graphed callable, whose graphs new ones would replay inside their
    capture. Refused before anything runs, naming the fix, and reported by
    explain; after a reset it graphs again."""
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    block = _Block()
    _api.graphed_in_place(block)
    for graph_again in (lambda: cgraph.make_graphed(block),
                        lambda: cgraph.make_graphed_callables(block, (torch.randn(3, 4),))):
        with pytest.raises(ValueError, match=r"module 0 \(_Block\) is graphed already.*reset"):
            graph_again()
    problems = cgraph.explain(block, (torch.randn(3, 4),)).problems
    assert any("graphed already" in p.message and "reset" in p.fix for p in problems)
    block.forward.reset()
    assert "forward" not in block.__dict__
    cgraph.make_graphed(block)  # its own forward again: graphed anew


def test_one_module_twice_in_the_drop_in_is_refused_and_copies_of_a_twice_installed_one_work(
        monkeypatch):
    """make_graphed_callables((m, m), ...) would replace m's forward twice,
    keeping the first graphed callable as its own forward: refused, naming
    the fix, before anything runs. A module installed twice anyway copies
    with its class's forward rather than recursing through the first."""
    import copy
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    block = _Block()
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="callable 1 is the module callable 0 is.*Pass it once"):
        cgraph.make_graphed_callables((block, block), ((x,), (x,)))
    for _ in range(2):
        graphed = cgraph.make_graphed(lambda t: t)
        _api._install_forward(block, graphed, graphed)
    twin = copy.deepcopy(block)
    assert isinstance(twin.forward, _api.ClassForward)
    assert_equal(twin(x), _Block.forward(block, x), "the copy's output")


def test_a_copied_blocks_forward_keeps_the_class_forwards_signature(monkeypatch):
    """What binds a call to the copy (the Trainer's column pruning, a later
    graphing of it) reads the class forward's signature."""
    import copy
    import inspect
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)

    class Masked(_Block):
        def forward(self, x, mask=None, use_cache=False):
            return _Block.forward(self, x)

    block = Masked()
    _api.graphed_in_place(block)
    twin = copy.deepcopy(block)
    assert list(inspect.signature(twin.forward).parameters) == ["x", "mask", "use_cache"]


def test_a_graphed_module_writes_the_wrapped_module_s_names_through():
    """graphed.head = nn.Linear(...) used to land on the wrapper, shadowing
    the wrapped module's head, which the graphs kept using, and adding a
    second set of keys to state_dict.  Written through, the graphs' check
    of the wrapped module sees it (and refuses a replacement after
    capture); the wrapper's own names (its mode, its module) stay its own,
    and a new name goes on the wrapper."""
    from cgraph._api import GraphedModule
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    model.scale = 2.0
    graphed = GraphedModule(model, cgraph._C.new_graphed(lambda *a: False))
    graphed.scale = 3.0
    setattr(graphed, "0", head := torch.nn.Linear(4, 3))
    assert model.scale == 3.0 and model[0] is head and "scale" not in graphed.__dict__
    assert list(graphed.state_dict()) == ["module.0.weight", "module.0.bias"]
    graphed.eval()
    assert not graphed.training and not model.training
    graphed.note = "mine"
    assert graphed.__dict__["note"] == "mine" and not hasattr(model, "note")
    del graphed.scale, graphed.note
    assert not hasattr(model, "scale") and "note" not in graphed.__dict__
