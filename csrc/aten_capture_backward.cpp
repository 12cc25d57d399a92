// aten_capture_backward.cpp -- the backward graph's capture: the ways in
// for incoming grads at its head, the callable's backward, and the
// parameter-grad tails at its end (Notes [Incoming grads] and [Parameter
// gradients] in aten_backward.cpp).
#include "aten_engine.hpp"
#include "tensor_lists.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <mutex>
#include <unordered_map>

namespace cgraph {
namespace {

// The operation tensor_lists.cu applies to `dst` and `src` for a tail (add
// or copy), if it can: the same dtype, memory a memcpy could copy, and for
// an add a floating type it adds.
std::optional<cg_list_op> list_op(bool add, const at::Tensor& dst, const at::Tensor& src) {
  if (dst.scalar_type() != src.scalar_type() || !dst.is_non_overlapping_and_dense() ||
      !memcpy_copies(dst, src)) {
    return std::nullopt;
  }
  if (!add) {
    return CG_LIST_COPY;
  }
  switch (dst.scalar_type()) {
    case at::kFloat:
      return CG_LIST_ADD_F32;
    case at::kDouble:
      return CG_LIST_ADD_F64;
    case at::kHalf:
      return CG_LIST_ADD_F16;
    case at::kBFloat16:
      return CG_LIST_ADD_BF16;
    default:
      return std::nullopt;
  }
}

}  // namespace

void launch_list(bool add, const std::vector<at::Tensor>& stores,
                 const std::vector<at::Tensor>& sources) {
  std::map<cg_list_op, std::vector<cg_list_item>> lists;
  std::vector<at::Tensor> aten_stores, aten_sources;
  for (size_t j = 0; j < stores.size(); ++j) {
    if (const auto op = list_op(add, stores[j], sources[j])) {
      lists[*op].push_back({stores[j].data_ptr(), sources[j].const_data_ptr(),
                            stores[j].nbytes()});
    } else {
      aten_stores.push_back(stores[j]);
      aten_sources.push_back(sources[j]);
    }
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  for (const auto& [op, items] : lists) {
    C10_CUDA_CHECK(cg_list_apply(op, items.data(), items.size(), stream));
  }
  if (!aten_stores.empty()) {
    add ? at::_foreach_add_(aten_stores, aten_sources)
        : at::_foreach_copy_(aten_stores, aten_sources);
  }
}

namespace {

// The memory of a store this backward capture computes in place: the grad
// itself where it is a tensor of its own laid out like the parameter (as
// eager's .grad would be: nothing else, not an incoming grad, another grad
// or a view's base, refers to it), else a copy recorded into the capture.
at::Tensor grad_memory(const at::Tensor& g, const at::Tensor& param) {
  const c10::Storage& storage = g.storage();
  if (g.use_count() == 1 && storage.use_count() == 1 && g.storage_offset() == 0 &&
      storage.nbytes() == g.nbytes() && !g.requires_grad() &&
      g.scalar_type() == param.scalar_type() && g.device() == param.device() &&
      g.sizes().equals(param.sizes()) && g.strides().equals(param.strides())) {
    return g;
  }
  at::NoGradGuard no_grad;
  at::Tensor own = at::empty_like(param, at::MemoryFormat::Preserve);
  own.copy_(g);
  return own;
}

// The deleter of non-owning views: never called (their context is null),
// only compared.  (aten_workspace.cpp's owns_nothing marks its aliases.)
void views_only(void*) {}

}  // namespace

at::Tensor non_owning_view(const at::Tensor& t) {
  return at::for_blob(const_cast<void*>(t.const_data_ptr()), t.sizes())
      .strides(t.strides())
      .context(nullptr, &views_only)
      .options(t.options())
      .target_device(t.device())  // else ATen asks the driver where the memory is
      .make_tensor();
}

bool is_non_owning_view(const at::Tensor& t) {
  return t.has_storage() && t.storage().data_ptr().get_deleter() == &views_only;
}

std::vector<at::Tensor> Engine::differentiable_outputs() const {
  std::vector<at::Tensor> diff;
  for (const Output& o : outputs) {
    if (o.requires_grad) {
      diff.push_back(o.buffer);
    }
  }
  return diff;
}

void Engine::capture_backward(at::cuda::MempoolId_t pool_id, cudaStreamCaptureMode mode) {
  note_capture_views_kept();
  const std::vector<at::Tensor> diff = differentiable_outputs();
  adopt_hidden_leaves(diff);
  backward.note_exists(!diff.empty() && !grad_targets().empty());
  if (backward.exists()) {
    allocate_grad_stores();
    capture_begin(CG_BACKWARD, pool_id, mode);
    try {
      record_backward(diff);
    } catch (...) {
      abandon_capture(CG_BACKWARD);
      throw;
    }
    capture_end(CG_BACKWARD);
    release_grad_in_buffers();
    free_input_grads();
    for (Param& p : params) {
      if (!p.grad.defined()) {  // no grad flows to it
        p.store.reset();
        p.owns_store = false;
      } else if (p.owns_store) {
        share_grad_store(p.tensor, caller_stream, p.store);
        p.store->ledger = member.ledger();
      }
    }
  }
  forget_capture_autograd();
}

// Inside the backward capture: the incoming grads' ways in, the callable's
// backward, and the tails.  The grad buffers are allocated inside the
// capture, so they live in the graph pool, as its temporaries once the
// capture ends (release_grad_in_buffers).
void Engine::record_backward(const std::vector<at::Tensor>& diff) {
  std::vector<at::Tensor> grad_outs;
  for (Output& o : outputs) {
    if (o.requires_grad) {
      o.grad_in = capture_grad_in(at::empty_like(o.buffer));
      grad_outs.push_back(o.grad_in->buffer);
    }
  }
  // Kept activations stay with the forward capture's autograd history:
  // Note [Layers captured one by one into one pool] (aten_pool.cpp).
  const std::vector<at::Tensor> grads = run_backward(diff, grad_outs, member.keeps_activations());
  size_t next = 0;
  for (Input& in : inputs) {
    if (in.requires_grad) {
      in.grad = grads[next++];
    }
  }
  for (Param& p : params) {
    if (!p.requires_grad) {
      continue;
    }
    const at::Tensor& g = grads[next++];
    if (g.defined() && p.owns_store) {
      p.store = std::make_shared<GradStore>(grad_memory(g, p.tensor),
                                            member.captured_at(CG_BACKWARD));
    }
    p.grad = !g.defined() ? at::Tensor() : non_owning_view(p.owns_store ? p.store->memory : g);
  }
  capture_param_grad_tails();
}

// Whether this backward capture computes the grads of the parameters no
// other graph has a store for in place (Note [Parameter gradients]).  Not
// with kept_outputs='alias', which moves nothing, nor for a layer captured
// one by one into a shared pool (keep_activations): the backwards of the
// layers before it, captured before it, replay after it in every pass and
// would move its grads every step.
bool Engine::computes_grads_in_place() const {
  return kept_outputs != CG_KEEP_ALIAS && !member.keeps_activations();
}

// Before the backward capture, outside it: for each parameter that requires
// grad, the store another graph made for it; else this capture will compute
// it in place (owns_store), or a regular store, laid out like the parameter
// (AccumulateGrad's layout contract) on the stream that will read it as
// param.grad.  Those the backward leaves without
// a grad are released after the capture.  A regular store is left unfilled
// (a fill launch per parameter is set-up time): every path of Note
// [Parameter gradients] writes a store before it hands it out, and adds into
// it only once handed out.
void Engine::allocate_grad_stores() {
  prune_grad_stores();  // once per capture: the stores of graphs freed since
  const bool in_place = computes_grads_in_place();
  for (Param& p : params) {
    if (!p.requires_grad) {
      continue;
    }
    p.store = grad_store_for(p.tensor, caller_stream, /*regular=*/!in_place);
    p.owns_store = !p.store && in_place;
    if (p.store && !p.store->in_pool()) {  // found by its place in a home: by itself too
      share_grad_store(p.tensor, caller_stream, p.store);
    }
    if (!p.store && !p.owns_store) {
      c10::cuda::CUDAStreamGuard on_caller(caller_stream);
      p.store = std::make_shared<GradStore>(
          at::empty_like(p.tensor, at::MemoryFormat::Preserve), /*allocated_at=*/0);
      share_grad_store(p.tensor, caller_stream, p.store);
    }
  }
}

// Note [One grad store per parameter]
// Q: A callable with several graphs (a shape each), or a parameter that
//    several graphed callables read: why do their backward graphs write one
//    store for it, not one each?
// A: A store is a parameter-sized tensor that lives as long as its graphs:
//    one per graph made the eight graphs of a model with eight shapes hold
//    eight copies of its grads (the varlen benchmark's 60 MiB beyond eager
//    on gpt-6).  Sharing one is exact because every path of Note [Parameter
//    gradients] decides at each replay, from .grad and from who holds the
//    store, whether to copy into it, add into it or leave it alone: the
//    copy tail runs only while nobody holds the store (GradStore::unheld),
//    the add tail only into a .grad that is the store's, so a second
//    graph's backward in the same step accumulates into what the first
//    handed out, as AccumulateGrad would.  The first graph's store is the
//    grad it computes, in its pool; the graphs sharing it were captured
//    after it, so they write it only through their tails, and the ledger of
//    its pool (aten_pool.cpp) moves what it handed out away from the graphs
//    captured before it, even once that first graph is gone.  The registry
//    holds stores weakly: they go with the last graph that writes them.
//    FSDP2's layers of one layout (Note [FSDP2's unsharded parameters in
//    per-layer graphs] in cgraph/_fsdp.py) go further: their unsharded
//    parameters are lent one home, and a regular store is shared by every
//    parameter lent the same place in it, a store per parameter of one layer
//    in place of one per parameter of every layer (0.28 GiB of bf16 grads on
//    the sharded benchmark's 220M-parameter Llama).  Exact for the same
//    reason: FSDP's post-backward, which runs as soon as a layer's backward
//    has its input grads, sets .grad to None and copies the grads into its
//    reduce-scatter input on the stream the graphs replay on, then drops
//    them, so the next layer's copy tail finds the store unheld; where
//    somebody still holds them (FSDP accumulating without reduce-scatter in
//    the parameters' dtype, a post-backward deferred to the root's final
//    callback) the next layer finds it held and takes the general path into
//    fresh memory, as eager allocates.  Only regular stores are found so: a
//    pool store lies in its first layer's pool, which the other layers'
//    backwards may write only once that layer's pass is over.  A regular
//    store is found by the parameter too, as any store is, by graphs of the
//    layer that compute grads in place (a second pass's, captured elsewhere).
namespace {

// The registry of Note [One grad store per parameter]: a store per
// parameter (or place in an FSDP home) and stream, held weakly.
struct GradStores {
  struct Key {
    const void* what;  // the parameter's TensorImpl, or its place in a home
    bool home;
    c10::StreamId stream;
    bool operator==(const Key& o) const {
      return what == o.what && home == o.home && stream == o.stream;
    }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.what) ^ (std::hash<int64_t>()(k.stream) << 1) ^
             static_cast<size_t>(k.home);
    }
  };
  std::mutex mutex;
  std::unordered_map<Key, std::weak_ptr<GradStore>, Hash> stores;
};

GradStores& grad_stores() {
  static GradStores registry;
  return registry;
}

// A regular store of a parameter lent an FSDP home is found by its place in
// the home (an empty parameter has none of its own); any store by the
// parameter.
GradStores::Key key_of(const at::Tensor& param, const c10::cuda::CUDAStream& stream,
                       bool regular) {
  const void* home = regular && param.numel() > 0 ? lent_from_home(param) : nullptr;
  if (home != nullptr) {
    return {home, true, stream.id()};
  }
  return {param.unsafeGetTensorImpl(), false, stream.id()};
}

}  // namespace

void prune_grad_stores() {
  GradStores& r = grad_stores();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.stores.begin(); it != r.stores.end();) {
    it = it->second.expired() ? r.stores.erase(it) : std::next(it);
  }
}

std::shared_ptr<GradStore> grad_store_for(const at::Tensor& param,
                                          const c10::cuda::CUDAStream& stream, bool regular) {
  GradStores& r = grad_stores();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.stores.find(key_of(param, stream, regular));
  auto store = it == r.stores.end() ? nullptr : it->second.lock();
  if (store && store->memory.sizes().equals(param.sizes()) &&
      store->memory.strides().equals(param.strides()) &&
      store->memory.scalar_type() == param.scalar_type()) {
    return store;
  }
  return nullptr;
}

void share_grad_store(const at::Tensor& param, const c10::cuda::CUDAStream& stream,
                      const std::shared_ptr<GradStore>& store) {
  GradStores& r = grad_stores();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.stores[key_of(param, stream, /*regular=*/false)] = store;
  if (!store->in_pool()) {
    r.stores[key_of(param, stream, /*regular=*/true)] = store;
  }
}

// During the backward capture, once it has the parameter grads: the two
// tails that turn them into param.grad, recorded as optional segments at the
// end of the backward graph (tail_copy writes the stores, tail_add adds into
// them; a replay runs at most one).  The grads are temporaries of the
// graph, whose memory later graphs reuse: Param::grad views them, read by
// the general path right after a replay.
void Engine::capture_param_grad_tails() {
  std::vector<at::Tensor> stores, sources;
  size_t num_grad_params = 0;
  for (const Param& p : params) {
    if (!p.grad.defined()) {  // frozen at capture, or unused (allow_unused_input)
      continue;
    }
    ++num_grad_params;
    if (!p.owns_store) {  // the graph computed an owned store's grad in place
      stores.push_back(p.store->memory);
      sources.push_back(p.grad);
    }
  }
  at::NoGradGuard no_grad;
  const SegmentId copy = bwd->capture_segment([&] { launch_list(false, stores, sources); });
  const SegmentId add = bwd->capture_segment([&] { launch_list(true, stores, sources); });
  backward.note_tails(copy, add, num_grad_params);
}

void CapturedBackward::note_exists(bool exists) {
  exists_ = exists;
}

void CapturedBackward::note_tails(SegmentId copy, SegmentId add, size_t num_grad_params) {
  tail_copy_ = copy;
  tail_add_ = add;
  num_grad_params_ = num_grad_params;
}

// After the backward capture: the incoming-grad buffers become temporaries
// of the backward graph (Note [Incoming grads] in aten_backward.cpp).  The
// graph keeps their addresses; the pool gets their blocks back, for later
// captures.  An input's grad that is one of them (an output's grad passed
// straight through) keeps its block allocated as input grads do (until
// free_input_grads frees them all: Note [Input grads freed at their capture]
// in aten_pool.cpp); a parameter's grad there is a non-owning view, a
// temporary read only within the replay and right after it, as it is
// elsewhere.
void Engine::release_grad_in_buffers() {
  for (Output& o : outputs) {
    if (o.grad_in) {
      o.grad_in->buffer = non_owning_view(o.grad_in->buffer);
    }
  }
}

// During the backward capture, before the callable's backward: the ways the
// graph fills the buffer of one incoming grad itself (Note [Incoming grads]):
// a copy of the grad, a broadcast of its one element, or zeros.
GradIn Engine::capture_grad_in(const at::Tensor& buffer) {
  at::NoGradGuard no_grad;
  GradIn in;
  in.buffer = buffer;
  in.copy = bwd->capture_copy_in(buffer);
  in.scalar = at::empty({}, buffer.options());
  in.element = bwd->capture_copy_in(in.scalar);
  in.broadcast = bwd->capture_segment([&] { buffer.copy_(in.scalar.expand(buffer.sizes())); });
  in.zero = bwd->capture_segment([&] { buffer.zero_(); });
  return in;
}

// After the backward capture the static outputs' autograd history is dead
// weight: it keeps the capture's nodes alive, among them the sample inputs'
// AccumulateGrad nodes, which remember the capture stream and make autograd
// warn (and sync) when a later call's backward reaches them.  With
// keep_activations it is what holds the activations, until released (Note
// [Layers captured one by one into one pool]); no static output has it.
// The outputs' nodes hold it, not the outputs, whose memory may then go
// back to the pool before the activations do (Note [An output freed once
// its reader has captured], aten_pool.cpp).
void Engine::forget_capture_autograd() {
  for (Output& o : outputs) {
    if (member.keeps_activations() && backward.exists() && o.requires_grad) {
      // Its grad_fn, or a leaf's accumulator (the leaf is a parameter or an input).
      member.keep_history(torch::autograd::impl::gradient_edge(o.buffer).function);
    }
    o.buffer = o.buffer.detach();
  }
}

}  // namespace cgraph
