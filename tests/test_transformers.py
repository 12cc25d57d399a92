"""Hugging Face models with every layer graphed on its first call, inside
the real model (Note [Several graphs per callable] in csrc/graphed.c):
cgraph.make_graphed(layer) with no samples, so nothing about how the model
calls its layers is written down.  Trained for a few steps with sequence
lengths that change between steps and a short last batch; loss and every
parameter grad equal eager's (float32, eager attention: bitwise).  With
buckets, one graph per bucket serves every step; padded calls run kernels
of other sizes (cuBLAS picks its algorithm by size), so results are held
to a stated float32 tolerance instead."""

import copy

import pytest
import torch
from torch import nn

import cgraph
from _helpers import CUDA, assert_equal

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

# (batch, sequence length) per step: lengths change, the last batch is short.
STEPS = [(2, 16), (2, 16), (2, 12), (2, 16), (1, 12)]


def graph_layers(layers: nn.ModuleList, **options) -> nn.ModuleList:
    return nn.ModuleList(cgraph.make_graphed(layer, **options) for layer in layers)


def train(model, step_fn, seed):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for step, (batch, length) in enumerate(STEPS):
        torch.manual_seed(seed + step)
        opt.zero_grad(set_to_none=True)
        loss = step_fn(model, batch, length)
        loss.backward()
        losses.append(loss.detach())
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads


# Padded calls: float32 results of other kernel sizes, five AdamW steps on.
BUCKET_TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def assert_training_equal(graphed_run, eager_run, tolerance=None):
    """Bitwise, or within `tolerance` (torch.testing.assert_close's)."""
    def check(a, b, what):
        if tolerance is None:
            assert_equal(a, b, what)
        else:
            torch.testing.assert_close(a, b, **tolerance, msg=lambda m: f"{what}: {m}")
    for step, (loss, loss_e) in enumerate(zip(graphed_run[0], eager_run[0])):
        check(loss, loss_e, f"step {step}: loss")
    for step, (grads, grads_e) in enumerate(zip(graphed_run[1], eager_run[1])):
        for i, (g, g_e) in enumerate(zip(grads, grads_e)):
            if g is None and g_e is None:
                continue  # unused by the loss in both (BERT's pooler)
            check(g, g_e, f"step {step}: grad of parameter {i}")


def small_llama(attention: str, seed: int):
    """A random-initialised two-layer Llama, its cache off (as training sets it)."""
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attn_implementation=attention)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(CUDA)


def llama_step(model, batch, length):
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=CUDA)
    return model(input_ids=ids, labels=ids).loss


def test_llama_with_every_decoder_layer_graphed_trains_as_eager():
    model = small_llama("eager", seed=50)
    eager = copy.deepcopy(model)
    model.model.layers = graph_layers(model.model.layers)
    assert_training_equal(train(model, llama_step, 500), train(eager, llama_step, 500))
    shapes = {(b, n) for b, n in STEPS}
    for layer in model.model.layers:
        assert layer.num_graphs == len(shapes) and layer.stats["eager_past_limit"] == 0


def test_llama_layers_sharing_one_pool_train_as_eager():
    """Every decoder layer graphed on its own with one pool=: each layer
    captures on its first call with new shapes, every layer's graphs in
    that pool (Note [One pool for separately graphed callables] in
    cgraph/_group.py)."""
    model = small_llama("eager", seed=51)
    eager = copy.deepcopy(model)
    pool = cgraph.graph_pool_handle()
    model.model.layers = graph_layers(model.model.layers, pool=pool)
    assert_training_equal(train(model, llama_step, 600), train(eager, llama_step, 600))
    for layer in model.model.layers:
        stats = layer.stats
        assert {tuple(p) for p in layer._graphed.pools} == {tuple(pool)}, layer
        assert layer.num_graphs == len(set(STEPS)), layer
        assert stats["eager_on_miss"] == 0 and stats["forward"] == len(STEPS), stats
        assert stats["eager_pending"] == 0 and stats["eager_past_limit"] == 0, stats
        assert stats["args_flattened"] == 0, stats  # Note [Arguments walked in C]


def test_llama_layers_padded_to_sequence_buckets_train_as_eager():
    """Every decoder layer graphed with buckets for the sequence length,
    inside the real model.  SDPA attention with no padding mask is causal,
    so positions padded after the real ones cannot change them; the rotary
    tables and position ids are padded alike.  Lengths 12 and 16 share one
    graph per batch size.  (The batch is not bucketed here: the rotary
    tables are (1, T, d), so a batch of 1 would pad them too, into a graph
    of its own.)"""
    model = small_llama("sdpa", seed=52)
    eager = copy.deepcopy(model)
    model.model.layers = graph_layers(model.model.layers, buckets={1: [16]})
    assert_training_equal(train(model, llama_step, 700), train(eager, llama_step, 700),
                          BUCKET_TOLERANCE)
    for layer in model.model.layers:
        assert layer.num_graphs == len({batch for batch, _ in STEPS}), layer
        assert layer.stats["forward"] == len(STEPS) == layer.stats["backward"], layer.stats


def test_a_llama_generating_through_graphed_layers_runs_them_eagerly_as_eager():
    """generate() passes the layers a transformers Cache, which they append
    to: those calls run eagerly (counted in eager_on_miss, where they used
    to raise), after training steps that replayed graphs; eager's tokens."""
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=True, attn_implementation="eager")
    torch.manual_seed(55)
    model = transformers.LlamaForCausalLM(config).to(CUDA)
    eager = copy.deepcopy(model)
    eager.config.use_cache = False  # as graph_layers' hook makes the training calls
    cgraph.graph_layers(model)
    assert_training_equal(train(model, llama_step, 910), train(eager, llama_step, 910))
    ids = torch.randint(0, 128, (1, 8), device=CUDA)
    tokens = [m.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                do_sample=False, pad_token_id=0) for m in (model, eager)]
    assert torch.equal(tokens[0], tokens[1]), tokens
    for layer in model.model.layers:
        assert layer.forward.stats["eager_on_miss"] >= 4, layer.forward.stats  # a call a token
        assert layer.forward.stats["forward"] > 0  # the training steps replayed


def bert_step(model, batch, length):
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=CUDA)
    mask = torch.ones(batch, length, dtype=torch.long, device=CUDA)
    mask[0, length - 3:] = 0  # padding: the layers get a real attention mask
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return (hidden * hidden).mean()


def small_bert(seed: int, attention: str = "eager", **config):
    """A random-initialised two-layer BERT."""
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, attn_implementation=attention,
        **config)
    torch.manual_seed(seed)
    return transformers.BertModel(config).to(CUDA)


def test_bert_with_every_encoder_layer_graphed_trains_as_eager():
    """Dropout on (0.1): masks equal eager's call for call."""
    model = small_bert(51)
    eager = copy.deepcopy(model)
    model.encoder.layer = graph_layers(model.encoder.layer)
    assert_training_equal(train(model, bert_step, 600), train(eager, bert_step, 600))
    for layer in model.encoder.layer:
        assert layer.num_graphs == len(set(STEPS))


def test_bert_layers_padded_to_batch_buckets_train_as_eager():
    """BERT's attention is bidirectional, so only the batch is padded: the
    padded row's attention mask is zeros (attend everywhere), which touches
    that row alone.  Dropout off: a padded call draws masks for more rows
    than eager, so its random stream differs (as the docstring of
    make_graphed says)."""
    model = small_bert(53, "sdpa", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    eager = copy.deepcopy(model)
    model.encoder.layer = graph_layers(model.encoder.layer, buckets=[2])
    assert_training_equal(train(model, bert_step, 800), train(eager, bert_step, 800),
                          BUCKET_TOLERANCE)
    for layer in model.encoder.layer:
        assert layer.num_graphs == len({length for _, length in STEPS}), layer


def test_graph_layers_finds_and_graphs_llamas_decoder_layers_in_one_pool():
    """cgraph.graph_layers: the decoder layers found, graphed into one
    shared pool, the cache turned off (as it is in the eager twin)."""
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=True, attn_implementation="eager")
    torch.manual_seed(54)
    model = transformers.LlamaForCausalLM(config).to(CUDA)
    eager = copy.deepcopy(model)
    eager.config.use_cache = False
    names = [name for name, _ in model.named_parameters()]
    assert cgraph.graph_layers(model) is model and model.config.use_cache is True
    assert [name for name, _ in model.named_parameters()] == names  # blocks stay in place
    assert_training_equal(train(model, llama_step, 900), train(eager, llama_step, 900))
    pools = {tuple(p) for layer in model.model.layers for p in layer.forward.pools}
    assert len(pools) == 1, pools
    for layer in model.model.layers:
        graphed = layer.forward
        assert isinstance(graphed, cgraph.Graphed)
        assert graphed.num_graphs == len(set(STEPS)) and graphed.stats["eager_past_limit"] == 0


def test_graph_layers_finds_berts_encoder_layers():
    model = small_bert(55)
    eager = copy.deepcopy(model)
    cgraph.graph_layers(model)
    assert all(isinstance(layer.forward, cgraph.Graphed) for layer in model.encoder.layer)
    assert_training_equal(train(model, bert_step, 1000), train(eager, bert_step, 1000))


def t5_step(model, batch, length):
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=CUDA)
    return model(input_ids=ids).last_hidden_state.float().pow(2).mean()


def test_graph_layers_graphs_t5_blocks_that_return_none_beside_their_tensors():
    """T5's encoder blocks return (hidden, position_bias, None): the None
    comes back where the block put it (Note [None among the outputs] in
    cgraph/_describe.py); it was refused ("output 2 is a NoneType").  The
    position bias block 0 makes is block 1's input.  Dropout on."""
    config = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2,
                                   num_heads=4, d_kv=16)
    torch.manual_seed(56)
    model = transformers.T5EncoderModel(config).to(CUDA)
    eager = copy.deepcopy(model)
    seen = []
    model.encoder.block[0].register_forward_hook(lambda m, a, out: seen.append(out))
    cgraph.graph_layers(model, layers="encoder.block")
    assert_training_equal(train(model, t5_step, 1100), train(eager, t5_step, 1100))
    assert all(isinstance(block.forward, cgraph.Graphed) for block in model.encoder.block)
    assert all(block.forward.num_graphs >= 1 for block in model.encoder.block)
    assert len(seen[-1]) == 3 and seen[-1][2] is None, [type(x) for x in seen[-1]]


def test_falcon_blocks_with_sdpa_return_none_beside_their_hidden_states():
    """Falcon's decoder layers return (hidden, None) under SDPA.  Float32
    SDPA kernels: held to the float32 tolerance of BUCKET_TOLERANCE.  Not
    multi-query: its heads are split by indexing with a Python list, a copy
    from the host that no capture can hold (CaptureError host_copy)."""
    config = transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, use_cache=False,
                                       multi_query=False, attn_implementation="sdpa")
    torch.manual_seed(57)
    model = transformers.FalconForCausalLM(config).to(CUDA)
    eager = copy.deepcopy(model)
    cgraph.graph_layers(model)
    assert all(isinstance(layer.forward, cgraph.Graphed) for layer in model.transformer.h)
    assert_training_equal(train(model, llama_step, 1200), train(eager, llama_step, 1200),
                          BUCKET_TOLERANCE)
