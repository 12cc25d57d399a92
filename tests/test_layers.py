"""cgraph.graph_layers on the CPU: which blocks it finds, how it replaces
them (make_graphed itself is stood in for: it needs a GPU), and what it
refuses.  Training equality on a GPU is in tests/test_transformers.py."""

import functools
import inspect
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import cgraph
from _helpers import StandIn, collector_off, tiny_llama
from cgraph import _layers


class Block(nn.Module):
    def __init__(self, width=8, experts=0):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        return self.linear(x).relu() + x


class GPT(nn.Module):
    """Embedding larger than any block, blocks larger together."""

    def __init__(self, depth=4, experts=0):
        super().__init__()
        self.embed = nn.Embedding(64, 8)
        self.blocks = nn.ModuleList(Block(experts=experts) for _ in range(depth))
        self.heads = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 2)])  # one type, fewer params

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.heads[1](self.heads[0](h))


def test_the_list_of_repeated_blocks_with_most_parameters_is_found():
    model = GPT()
    found = _layers._find(model, None)
    assert found.path == "blocks" and found.container is model.blocks
    assert found.blocks == tuple(model.blocks)


def test_an_outer_list_wins_over_the_lists_inside_its_blocks():
    assert _layers._find(GPT(experts=4), None).path == "blocks"


class EncoderDecoder(nn.Module):
    """Two stacks of blocks, as T5 and BART have."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList(Block() for _ in range(2))
        self.decoder = nn.ModuleList(Block(width=8, experts=1) for _ in range(3))


def test_a_guess_warns_where_other_stacks_of_blocks_run_eagerly(stand_in, caplog):
    """The guess graphs one list; the other stack, or a list of blocks given
    as the model (its largest inner list taken), is named with the fix."""
    model = EncoderDecoder()
    with caplog.at_level(logging.WARNING, logger="cgraph"):
        cgraph.graph_layers(model)
    assert "guessed the blocks at 'decoder'" in caplog.text
    assert "['encoder']; graph each with graph_layers(model, layers='path')" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgraph"):
        cgraph.graph_layers(model, layers="encoder")  # named: no guess, no warning
        cgraph.graph_layers(GPT())  # one stack: nothing to say
    assert caplog.text == ""



def test_a_model_that_is_a_list_of_blocks_has_each_block_graphed(stand_in):
    """nn.Sequential(*blocks), or a model's list passed as the model: its
    blocks, not the largest list inside the first of them (the experts)."""
    blocks = GPT(experts=4).blocks
    cgraph.graph_layers(blocks)
    assert [b for b, _ in stand_in] == list(blocks)
    assert _layers._find(nn.Sequential(*[Block() for _ in range(3)]), None).path == ""


class Titan(nn.Module):
    """torchtitan's layout: the blocks in an nn.ModuleDict keyed "0", "1", ..."""

    def __init__(self, depth=3):
        super().__init__()
        self.embed = nn.Embedding(64, 8)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(depth)})

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.layers.values():
            h = block(h)
        return h


def test_a_module_dict_of_blocks_is_found_and_graphed_block_by_block(stand_in):
    model = Titan()
    found = _layers._find(model, None)
    assert found.path == "layers" and found.blocks == tuple(model.layers.values())
    cgraph.graph_layers(model)
    assert [b for b, _ in stand_in] == list(model.layers.values())
    other = Titan()
    cgraph.graph_layers(other, layers="layers")
    assert [b for b, _ in stand_in[3:]] == list(other.layers.values())


def test_each_block_is_graphed_in_place_with_one_shared_pool(stand_in):
    model = GPT()
    blocks = list(model.blocks)
    assert cgraph.graph_layers(model, num_warmup_iters=2) is model
    assert list(model.blocks) == blocks
    assert all(isinstance(b.forward, StandIn) for b in model.blocks)
    assert [b for b, _ in stand_in] == blocks
    assert all(kw == {"pool": (0, 77), "num_warmup_iters": 2} for _, kw in stand_in)


def test_pool_none_gives_each_block_its_own(stand_in):
    cgraph.graph_layers(GPT(), pool=None)
    assert all(kw["pool"] is None for _, kw in stand_in)


def test_layers_by_path_or_by_module(stand_in):
    model = GPT()
    cgraph.graph_layers(model, layers="heads")
    assert [b for b, _ in stand_in] == list(model.heads)
    other = GPT()
    cgraph.graph_layers(other, layers=other.heads)
    assert len(stand_in) == 4


def test_a_sequential_of_blocks_is_found(stand_in):
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(Block(), Block(), Block()))
    cgraph.graph_layers(model)
    assert [b for b, _ in stand_in] == list(model[1])


def test_ddp_models_are_graphed_inside(stand_in, mesh):
    ddp = nn.parallel.DistributedDataParallel(GPT())
    assert cgraph.graph_layers(ddp) is ddp
    assert [b for b, _ in stand_in] == list(ddp.module.blocks)


def test_a_hugging_face_cache_is_turned_off_and_logged(stand_in, caplog):
    """Off in the calls that leave use_cache unset (tested below), not in
    the config, which checkpoints save."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, use_cache=True)
    model = transformers.LlamaForCausalLM(config)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        cgraph.graph_layers(model)
    assert model.config.use_cache is True
    assert [b for b, _ in stand_in] == list(model.model.layers)
    text = caplog.text
    assert text.count("leave use_cache unset run without a KV cache") == 1, text
    assert "calls of LlamaForCausalLM, LlamaModel that" in text, text
    assert "graphed 2 LlamaDecoderLayer blocks at 'model.layers'" in text, text


@pytest.mark.parametrize("build, path", [
    ("BertConfig", "bert.encoder.layer"), ("GPT2Config", "transformer.h")])
def test_hugging_face_layer_lists_are_found(build, path):
    transformers = pytest.importorskip("transformers")
    if build == "BertConfig":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    assert _layers._find(model, None).path == path


@pytest.mark.parametrize("layers, error, match", [
    ("blocks.9", ValueError, "path below the model"),
    ("embed", TypeError, "'embed' is a Embedding"),
    (7, TypeError, "takes a path or an nn.ModuleList"),
    ("", ValueError, "names the model itself"),
])
def test_wrong_layers_are_refused_saying_what_it_takes(layers, error, match, stand_in):
    with pytest.raises(error, match=match):
        cgraph.graph_layers(GPT(), layers=layers)
    assert stand_in == []


def test_a_list_outside_the_model_is_refused(stand_in):
    with pytest.raises(ValueError, match="not inside the model"):
        cgraph.graph_layers(GPT(), layers=nn.ModuleList([Block(), Block()]))


def test_a_model_without_repeated_blocks_is_refused():
    with pytest.raises(ValueError, match="no list of repeated blocks.*layers="):
        cgraph.graph_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_a_compiled_model_is_refused_naming_the_order():
    with pytest.raises(TypeError, match=r"uncompiled model.*torch.compile\(layer.forward\)"):
        cgraph.graph_layers(torch.compile(GPT()))


def test_graphing_twice_is_refused(stand_in):
    model = GPT()
    cgraph.graph_layers(model)
    for layers in ("blocks", None):  # not the next list of blocks either
        with pytest.raises(ValueError, match="graphed already"):
            cgraph.graph_layers(model, layers=layers)
    assert len(stand_in) == 4


def test_a_graphed_block_is_recognised():
    block = Block()
    assert not cgraph._api.is_graphed(block)
    block.forward = cgraph._api.Bucketed.__new__(cgraph._api.Bucketed)
    assert cgraph._api.is_graphed(block)


def test_fsdp_on_the_root_alone_is_refused_naming_the_recipe(mesh, stand_in):
    from torch.distributed.fsdp import fully_shard
    model = GPT()
    fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match="fully_shard to every block, then to the root"):
        cgraph.graph_layers(model)
    assert stand_in == []


def test_fsdp_blocks_are_graphed(mesh, stand_in):
    from torch.distributed.fsdp import fully_shard
    model = GPT()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cgraph.graph_layers(model)
    assert len(stand_in) == 4


def test_every_name_in_the_model_stays_as_it_was(stand_in):
    """The blocks stay in place: state_dict keys and parameter names (which
    optimizer and distributed checkpoints use) are those of the model
    before graphing, and checkpoints load both ways."""
    model, fresh = GPT(), GPT()
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    cgraph.graph_layers(model)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    model.load_state_dict(fresh.state_dict())  # strict
    fresh.load_state_dict(model.state_dict())


def test_a_graphed_hugging_face_model_saves_what_from_pretrained_loads(stand_in, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    cgraph.graph_layers(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(3)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for (name, p), q in zip(loaded.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_graphed_in_place_makes_the_graphed_callable_the_blocks_forward(monkeypatch):
    """make_graphed's wrapper calls the graphed callable (a block without
    hooks) or the block (with hooks: make_graphed has made the graphed
    callable its forward then); in place, the block's forward is it."""
    from cgraph import _api

    class Graphed:  # weakly referable, as a cgraph.Graphed
        pass

    graphed = Graphed()

    def make_graphed(block, **kwargs):
        if _api._has_hooks(block):
            block.forward = graphed
            return SimpleNamespace(forward=block.__call__, _graphed=graphed)
        return SimpleNamespace(forward=graphed, _graphed=graphed)

    monkeypatch.setattr(_api, "make_graphed", make_graphed)
    plain, hooked = Block(), Block()
    hooked.register_forward_pre_hook(lambda module, args: None)
    for block in (plain, hooked):
        assert _api.graphed_in_place(block, pool=None) is block
        assert block.__dict__["forward"] is graphed


class GradientCheckpointingLayer(Block):
    """transformers' GradientCheckpointingLayer before 5.23, abridged:
    checkpointing around the module's call."""

    gradient_checkpointing = False

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(
                functools.partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)


CheckpointedAroundCall = GradientCheckpointingLayer


def counting_checkpoint(checkpointed: list):
    def checkpoint(fn, *args):
        checkpointed.append(fn)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return checkpoint


def checkpoints_of(run, checkpointed: list) -> int:
    """How often `run` checkpoints, none of them around a graphed call."""
    checkpointed.clear()
    run()
    around = [fn for fn in checkpointed if getattr(fn.func, "__func__", None) is nn.Module.__call__]
    assert not around, "checkpointed around the graphed call"
    return len(checkpointed)


def checkpointed_blocks(n: int, enabled: bool, checkpointed: list) -> nn.Module:
    model = nn.Sequential(*(CheckpointedAroundCall() for _ in range(n)))
    for block in model:
        block.gradient_checkpointing = enabled
        block._gradient_checkpointing_func = counting_checkpoint(checkpointed)
    holder = nn.Module()
    holder.blocks = model
    return holder


def test_checkpointing_around_a_blocks_call_moves_into_its_forward(stand_in):
    """Around the call it would wrap the graphed forward (a capture under
    no_grad, then one during backward); inside, it is captured.  The flags
    are read at each call: disabling and enabling later work too."""
    checkpointed = []
    holder = checkpointed_blocks(2, True, checkpointed)
    model = holder.blocks
    cgraph.graph_layers(holder)
    assert all(type(b).__call__ is nn.Module.__call__ and isinstance(b, CheckpointedAroundCall)
               and isinstance(b.forward, StandIn) for b in model)
    assert list(inspect.signature(type(model[0]).forward).parameters) == ["self", "x"]
    x = torch.randn(3, 8, requires_grad=True)
    assert checkpoints_of(lambda: model(x).sum().backward(), checkpointed) == 2  # inside
    with torch.no_grad():
        assert checkpoints_of(lambda: model(x), checkpointed) == 0
    for block in model:
        block.gradient_checkpointing = False
    assert checkpoints_of(lambda: model(x), checkpointed) == 0
    for block in model:
        block.gradient_checkpointing = True
    assert checkpoints_of(lambda: model(x), checkpointed) == 2
    model.eval()
    assert checkpoints_of(lambda: model(x), checkpointed) == 0


def test_checkpointing_enabled_after_graphing_is_inside_too(stand_in):
    checkpointed = []
    holder = checkpointed_blocks(2, False, checkpointed)
    cgraph.graph_layers(holder)
    for block in holder.blocks:
        block.gradient_checkpointing = True  # as gradient_checkpointing_enable() sets it
    x = torch.randn(3, 8, requires_grad=True)
    assert checkpoints_of(lambda: holder.blocks(x).sum().backward(), checkpointed) == 2


def test_a_blocks_own_forward_is_kept_and_checkpointed(stand_in):
    """A compiled forward (here any instance forward) is what the graphs
    capture: it checkpoints as the class's would."""
    checkpointed, own = [], []
    holder = checkpointed_blocks(2, True, checkpointed)
    for block in holder.blocks:
        def forward(x, block=block, inner=block.forward):  # as torch.compile(block.forward)
            own.append(block)
            return inner(x)
        block.forward = forward
    cgraph.graph_layers(holder)
    x = torch.randn(3, 8, requires_grad=True)
    assert checkpoints_of(lambda: holder.blocks(x).sum().backward(), checkpointed) == 2
    # each block's own forward: in the forward, and again in the backward's recompute
    assert [own.count(block) for block in holder.blocks] == [2, 2]


def test_checkpointing_turns_a_cache_off_as_transformers_does():
    from cgraph._layers import _maybe_checkpointed
    block = CheckpointedAroundCall()
    block.gradient_checkpointing = True
    block._gradient_checkpointing_func = lambda fn, *args: fn(*args)
    seen = []
    _maybe_checkpointed(block, lambda x, **kw: seen.append(kw), (torch.ones(1),),
                        {"use_cache": True, "past_key_values": object(), "layer_past": None})
    assert seen == [{"use_cache": False, "past_key_values": None, "layer_past": None}]


def test_checkpointing_already_inside_forward_is_left_as_it_is(stand_in):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    layer_class = type(model.model.layers[0])
    if layer_class.__call__ is not nn.Module.__call__:
        pytest.skip("this transformers checkpoints around __call__ (before 5.23)")
    classes = [type(layer) for layer in model.model.layers]
    cgraph.graph_layers(model)
    assert [type(layer) for layer in model.model.layers] == classes


def test_a_failure_halfway_leaves_every_block_as_it_was(monkeypatch):
    """Classes and forwards (a block's own forward included) as they were;
    the cache setting too."""
    def graphed_in_place(block, **kwargs):
        if len(done) == 2:
            raise RuntimeError("capture failed")
        block.forward = StandIn(block)
        done.append(block)
        return block

    done = []
    monkeypatch.setattr(_layers, "graphed_in_place", graphed_in_place)
    monkeypatch.setattr(_layers, "graph_pool_handle", lambda: (0, 1))
    model = nn.Sequential(*(CheckpointedAroundCall() for _ in range(3)))
    own = model[0].forward = model[2].forward = lambda x: x
    holder = nn.Module()
    holder.blocks = model
    holder.config = SimpleNamespace(use_cache=True)
    with pytest.raises(RuntimeError, match="capture failed"):
        cgraph.graph_layers(holder)
    assert all(type(b) is CheckpointedAroundCall for b in model)
    assert [b.__dict__.get("forward") for b in model] == [own, None, own]
    assert holder.config.use_cache is True


def test_blocks_compiled_whole_are_refused_naming_their_forward(stand_in):
    model = GPT()
    for block in model.blocks:
        block.compile()
    with pytest.raises(ValueError, match=r"block.forward = torch.compile\(block.forward\)"):
        cgraph.graph_layers(model)
    assert stand_in == []


def test_real_graphs_in_place_before_their_first_call(monkeypatch):
    """The real graph_layers on the CPU, up to the first call (which would
    capture): each block's forward is a cgraph.Graphed, names unchanged."""
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    model = GPT()
    names = [n for n, _ in model.named_parameters()]
    cgraph.graph_layers(model, pool=None)
    graphed = [block.forward for block in model.blocks]
    assert all(isinstance(g, cgraph.Graphed) and g.num_graphs == 0 for g in graphed)
    assert all(_api.is_graphed(block) for block in model.blocks)
    assert [n for n, _ in model.named_parameters()] == names


def test_a_reset_puts_the_blocks_own_forward_back_to_be_graphed_again(monkeypatch):
    """reset_all before re-graphing a model (its docstring): each block's
    forward is its own again (the class's, or one set on the instance
    before graphing), so graph_layers takes the model again."""
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    model = GPT()
    own = model.blocks[1].forward = functools.partial(Block.forward, model.blocks[1])
    cgraph.graph_layers(model, pool=None)
    first = [block.forward for block in model.blocks]
    cgraph.reset_all()
    assert all("forward" not in block.__dict__ for i, block in enumerate(model.blocks) if i != 1)
    assert model.blocks[1].forward is own and not any(map(_api.is_graphed, model.blocks))
    cgraph.graph_layers(model, pool=None)
    again = [block.forward for block in model.blocks]
    assert all(isinstance(g, cgraph.Graphed) and g not in first for g in again)
    first[0].reset()  # reset already: its block's forward is another's now, left as it is
    assert model.blocks[0].forward is again[0]


def test_a_dropped_model_drops_its_graphed_blocks_without_gc(monkeypatch):
    """What reset needs to give a block its own forward back is held weakly:
    the graphs (and their pools, on a GPU) go with the model."""
    import gc
    import weakref
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    model = GPT()
    model.blocks[0].forward = functools.partial(Block.forward, model.blocks[0])  # a cycle
    cgraph.graph_layers(model, pool=None)
    graphed = [weakref.ref(block.forward) for block in model.blocks]
    with collector_off():
        del model
        alive = [g() is not None for g in graphed]
    # Block 0's own forward is bound to it (a reference cycle, as eager's is): the collector's.
    assert alive == [True, False, False, False]
    gc.collect()
    assert all(g() is None for g in graphed)


class DynamicCache:  # as transformers names its caches
    def __init__(self):
        self.appended = 0


class CachedBlock(Block):
    def forward(self, x, past_key_values=None):
        if past_key_values is not None:
            past_key_values.appended += 1  # what a replay would skip
        return super().forward(x)


def test_a_call_carrying_a_cache_runs_eagerly_and_is_counted(monkeypatch, caplog):
    """generate() calls a model's graphed layers with a transformers Cache,
    which they append to: such a call runs eagerly (no capture), counted in
    eager_on_miss and logged once, where it used to raise."""
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    block = CachedBlock()
    graphed = cgraph.make_graphed(block)
    x, cache = torch.randn(2, 8), DynamicCache()
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for _ in range(2):
            out = graphed(x, past_key_values=cache)
            torch.testing.assert_close(out, block.linear(x).relu() + x, rtol=0, atol=0)
    assert cache.appended == 2
    assert graphed.stats["eager_on_miss"] == 2 and graphed.num_graphs == 0
    assert caplog.text.count("carrying a transformers Cache") == 1
    assert cgraph._describe.holds_cache(((x,), {"caches": (None, [cache])}))  # nested too


def test_a_reset_gives_fsdp_its_parameters_back_even_if_logging_fails(monkeypatch):
    """A block graphed in place is reset through its forward (a
    cgraph.Graphed), not a GraphedModule: the native reset event releases
    the FSDP homes its graphs borrowed."""
    from cgraph import _api
    released = []
    monkeypatch.setattr(_api._fsdp, "release", released.append)

    def failing_log(event, graphed):
        raise RuntimeError("log failed")

    class Reset:  # weakly referable, as a cgraph.Graphed
        pass

    graphed = Reset()
    _api._on_event("progress", graphed)
    assert released == []
    monkeypatch.setattr(_api._log, "on_event", failing_log)
    with pytest.raises(RuntimeError, match="log failed"):
        _api._on_event("reset", graphed)
    assert released == [graphed]


# ---- the KV cache: off in calls that leave use_cache unset, the config kept ----


def caches_seen(layers) -> list:
    """For each call of each layer from now on: whether it carried a Cache,
    and the use_cache it was given."""
    seen = []

    def record(layer, args, kwargs):
        seen.append((cgraph._describe.holds_cache((args, kwargs)), kwargs.get("use_cache")))

    for layer in layers:
        layer.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def test_a_hugging_face_forward_leaving_use_cache_unset_gives_the_blocks_no_cache(
        stand_in, tmp_path):
    """Training and evaluation forwards (use_cache absent, or None by keyword
    or positionally) hand the graphed blocks no cache; a call asking for one
    (use_cache=True, as generate() passes it) gets it; the config keeps
    use_cache=True, and so does the checkpoint save_pretrained writes."""
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(transformers)
    cgraph.graph_layers(model)
    assert model.config.use_cache is True
    seen = caches_seen(model.model.layers)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    model(ids, use_cache=None)
    with torch.no_grad():
        model.eval()(ids, None, None, None, None, None, None)  # use_cache=None positionally
    assert seen == [(False, False)] * 6
    seen.clear()
    model(ids, use_cache=True)
    model(ids, None, None, None, None, None, True)
    assert seen == [(True, True)] * 4
    assert all(layer.forward.calls == 5 for layer in model.model.layers)
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["use_cache"] is True



def test_a_call_without_grad_that_leaves_use_cache_unset_warns_once_naming_the_fix(
        stand_in, caplog):
    """A hand-written decoding loop's prefill (no grad, use_cache unset)
    would get no cache back, and its next call would lose the context:
    the first such call warns, once per model, naming use_cache=True;
    training calls do not."""
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(transformers)
    cgraph.graph_layers(model)
    ids = torch.randint(0, 64, (2, 8))
    with caplog.at_level(logging.WARNING, logger="cgraph"):
        model(input_ids=ids, labels=ids).loss.backward()
        assert "use_cache unset" not in caplog.text
        with torch.no_grad():
            out = model(ids)
            model(ids)
    assert out.past_key_values is None
    assert caplog.text.count("must pass use_cache=True") == 1, caplog.text


def test_generate_through_graphed_hugging_face_layers_keeps_its_cache(stand_in):
    """generate() passes use_cache itself (True by default), so the hook
    leaves its calls be: every layer call carries the cache (and runs the
    block eagerly on a GPU)."""
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(transformers).eval()
    cgraph.graph_layers(model)
    seen = caches_seen(model.model.layers[:1])
    ids = torch.randint(0, 64, (1, 5))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                   do_sample=False, pad_token_id=0)
    assert seen == [(True, True)] * 3

class CacheModel(nn.Module):
    """As a Hugging Face model: a config saying use_cache, and a cache built
    per call and handed to each block where use_cache (or, unset, the
    config) says so."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)
        self.blocks = nn.ModuleList(CachedBlock() for _ in range(2))

    def forward(self, x, use_cache=None):
        cache = DynamicCache() if (self.config.use_cache if use_cache is None
                                   else use_cache) else None
        for block in self.blocks:
            x = block(x, past_key_values=cache)
        return x, cache


def test_the_cache_hook_leaves_a_call_that_asks_and_goes_after_a_reset(stand_in):
    """Positionally or by keyword, a use_cache the caller gave is kept.
    Graphed again after a reset, the model has one hook, not two; once the
    blocks are reset, calls get the config's cache again and the hook
    removes itself, not while one block alone was reset (as an error
    names it: the others stay graphed, and a cache would send them eager)."""
    model, x = CacheModel(), torch.randn(2, 8)
    cgraph.graph_layers(model)
    assert model(x)[1] is None and model(x, None)[1] is None
    assert model(x, use_cache=True)[1].appended == 2 and model(x, True)[1].appended == 2
    assert model(x, False)[1] is None
    for block in model.blocks:
        block.forward.reset()
    cgraph.graph_layers(model)
    assert len(model._forward_pre_hooks) == 1 and model(x)[1] is None
    model.blocks[0].forward.reset()  # one block alone: the others are graphed still
    assert model(x)[1] is None and len(model._forward_pre_hooks) == 1
    model.blocks[1].forward.reset()
    assert model(x)[1].appended == 2  # the config's cache: the blocks run their own forward
    assert len(model._forward_pre_hooks) == 0 and model not in _layers._cache_hooks


def test_the_cache_hook_keeps_no_model_alive(stand_in):
    """The hook holds the blocks weakly, and the model not at all: a
    dropped model goes without the garbage collector (its blocks' stand-ins
    are bound to them, a cycle of their own)."""
    import weakref
    model = CacheModel()
    cgraph.graph_layers(model)
    model(torch.randn(2, 8))
    dropped = weakref.ref(model)
    with collector_off():
        del model
        assert dropped() is None


def test_a_model_without_use_cache_in_its_forward_or_config_gets_no_hook(stand_in):
    """Only a forward naming use_cache takes it (one with **kwargs alone may
    hand it to code that does not); blocks never get the hook."""
    model = GPT()
    model.config = SimpleNamespace(use_cache=True)
    cgraph.graph_layers(model)
    cached = CacheModel()
    cached.config.use_cache = False
    cgraph.graph_layers(cached)
    assert not model._forward_pre_hooks and not cached._forward_pre_hooks
    assert not any(block._forward_pre_hooks for block in [*model.blocks, *cached.blocks])


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_the_cache_hook_works_under_ddp_and_on_an_fsdp_root(wrap, mesh, stand_in):
    """DDP calls the module it wraps, whose hook turns the cache off; an
    FSDP2 root keeps its own hooks beside it, and nothing refuses a hooked
    root (only a graphed module's hooks matter to cgraph)."""
    from torch.distributed.fsdp import fully_shard
    model, x = CacheModel(), torch.randn(2, 8)
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    cgraph.graph_layers(model)
    assert model(x)[1] is None and model(x, use_cache=True)[1].appended == 2
    inner = model.module if wrap == "ddp" else model
    assert inner.config.use_cache is True and len(stand_in) == 2


# ---- copies of a model with graphed blocks: Note [Copying a graphed model] ----


def _copies(model):
    import copy
    import io
    import pickle
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model)),
            "torch.save": torch.load(buffer, weights_only=False)}


def _copies_go_without_the_collector(model) -> bool:
    """Whether each kind of copy of `model`, dropped, is freed at once (no
    reference cycle through its forwards)."""
    import weakref
    with collector_off():  # from before the copies: a cycle must not be collected early
        gone = [weakref.ref(twin) for twin in _copies(model).values()]
        return all(g() is None for g in gone)


def test_a_hugging_face_model_with_graphed_layers_copies_and_saves_as_eager(monkeypatch):
    """torch.save(model) and copy.deepcopy after graph_layers (really
    graphed, not stand-ins; nothing is called on the original, so nothing
    captures): the copy's layers run eagerly, its cache hook does nothing,
    its logits are eager's, bitwise, and it goes when dropped, without the
    collector."""
    transformers = pytest.importorskip("transformers")
    import copy
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    model = tiny_llama(transformers)
    eager = copy.deepcopy(model)
    cgraph.graph_layers(model, pool=None)
    ids = torch.randint(0, 64, (2, 6))
    for how, twin in _copies(model).items():
        assert not any(_api.is_graphed(layer) for layer in twin.model.layers), how
        assert all(_api.is_graphed(layer) for layer in model.model.layers), how
        assert twin.config.use_cache is True, how
        hooks = [h for m in twin.modules() for h in m._forward_pre_hooks.values()]
        assert hooks and all(h is _layers._copied_cache_hook for h in hooks), how
        out = twin(ids, use_cache=True)
        assert out.past_key_values is not None, how  # the copy keeps its cache
        assert torch.equal(out.logits, eager(ids).logits), how
    del twin, out
    assert _copies_go_without_the_collector(model)


def _doubled(block, x):
    return 2 * Block.forward(block, x)


def test_checkpointed_blocks_copy_as_their_own_class_and_forward(monkeypatch):
    """transformers before 5.23: graph_layers moves checkpointing into a
    class made for the block, and wraps an instance forward.  A copy (and a
    pickle, which cannot name the made class) is of the block's own class,
    and its own forward runs on the copy's weights, not the original's."""
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    holder = nn.Module()
    holder.blocks = nn.Sequential(*(CheckpointedAroundCall() for _ in range(2)))
    for block in holder.blocks:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False)
    holder.blocks[0].forward = functools.partial(_doubled, holder.blocks[0])  # picklable
    cgraph.graph_layers(holder, pool=None)
    assert type(holder.blocks[0]) is not CheckpointedAroundCall  # the made class
    x = torch.randn(3, 8, requires_grad=True)
    for how, twin in _copies(holder).items():
        blocks = twin.blocks
        assert all(type(b) is CheckpointedAroundCall for b in blocks), how
        with torch.no_grad():
            for b in blocks:
                b.linear.weight.zero_()
        expected = [2 * (blocks[0].linear.bias.relu() + x), blocks[1].linear.bias.relu() + x]
        for i, b in enumerate(blocks):
            out = b(x)
            out.sum().backward()  # checkpointed as transformers does it, around the call
            torch.testing.assert_close(out, expected[i].expand_as(out), rtol=0, atol=0,
                                       msg=f"{how}: block {i}")


def test_a_copied_checkpointed_block_with_its_own_forward_checkpoints_once(monkeypatch):
    """Its copy is of the block's own class, which checkpoints around its
    call, and gets the own forward itself back, not the forward graph_layers
    checkpointed: one checkpoint per call, as an uncopied eager block."""
    import copy
    from cgraph import _api
    monkeypatch.setattr(_api, "_require_cuda", lambda: None)
    checkpointed = []
    holder = checkpointed_blocks(2, True, checkpointed)
    holder.blocks[0].forward = functools.partial(_doubled, holder.blocks[0])
    cgraph.graph_layers(holder, pool=None)
    twin = copy.deepcopy(holder)
    x = torch.randn(3, 8, requires_grad=True)
    checkpointed.clear()
    twin.blocks(x).sum().backward()
    assert len(checkpointed) == 2  # once per block
    import pickle
    block = holder.blocks[1]
    block._gradient_checkpointing_func = functools.partial(  # picklable
        torch.utils.checkpoint.checkpoint, use_reentrant=False)
    block.compile()  # a compiled call after graph_layers: still picklable
    assert type(pickle.loads(pickle.dumps(block))) is CheckpointedAroundCall


def test_a_block_listed_twice_is_graphed_once(stand_in):
    """nn.ModuleList([block] * 2), one block with shared weights: graphed
    once, called at each place."""
    block = Block()
    holder = nn.Module()
    holder.blocks = nn.ModuleList([block, block])
    cgraph.graph_layers(holder)
    assert len(stand_in) == 1 and isinstance(block.forward, StandIn)

