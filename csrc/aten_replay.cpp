// aten_replay.cpp -- the replay path: checking and copying inputs, replaying
// the forward graph, and the autograd node that replays the backward graph.
//
// This is the product.  It runs on every call, so it stays short, allocates
// nothing it can avoid, and reads top to bottom: cg_engine_replay() for the
// forward, GraphedBackward::apply() for the backward.
#include "aten_engine.hpp"

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

namespace cgraph {
namespace {

namespace autograd = torch::autograd;
using TensorVec = c10::SmallVector<at::Tensor, 16>;

// Note [Parameter gradients]
// Q: How do parameter grads reach param.grad, and why not through autograd
//    as torch's make_graphed_callables does?
// A: torch returns its static grad buffer (detached) from backward, and
//    AccumulateGrad *steals* it as param.grad when .grad is None: the next
//    replay overwrites a .grad the user holds (pytorch issue 181723; micro-
//    batch accumulation goes wrong).  And an AccumulateGrad node per
//    parameter costs host time and a kernel launch each.
//    cgraph keeps one tensor per parameter, grad_store[j], and hands it out
//    as param.grad.  The backward graph ends with two optional segments
//    ("tails"), each one launch of tensor_lists.cu for all parameters of a
//    dtype (ATen's foreach ops for what it cannot take), and every replay
//    switches on at most one of them before it launches:
//      - every .grad is None and nobody else holds its grad_store: the copy
//        tail (grad_store = grad), then .grad = grad_store;
//      - every .grad is its grad_store (accumulation over micro-batches, or
//        zero_grad(set_to_none=False)): the add tail (grad_store += grad).
//    So parameter grads cost no launch of their own, and no graph beyond the
//    backward one is captured for them.
//    Anything else (a .grad the user assigned, a grad_store the user still
//    holds after zero_grad, some parameters frozen since capture, a partial
//    backward) takes the slow path: fused copies and adds from views of the
//    backward graph's grads, into fresh tensors where grad_store is held
//    elsewhere.  No path overwrites a tensor the user holds, and every path
//    computes what AccumulateGrad would, bit for bit.
//    The grads themselves are temporaries of the backward graph, so they
//    cost no memory between backwards.
//    A parameter with hooks (tensor hooks, post-accumulate-grad hooks, hooks
//    on its grad accumulator, which DDP registers) stays an ordinary autograd
//    edge: it gets a copy of its grad and AccumulateGrad runs the hooks.
bool delivered_by_autograd(const at::Tensor& p) {
  if (!autograd::impl::hooks(p).empty() || autograd::impl::post_acc_grad_hooks(p)) {
    return true;
  }
  const auto acc = autograd::impl::try_get_grad_accumulator(p);
  return acc && (!acc->pre_hooks().empty() || !acc->post_hooks().empty());
}

// Whether nobody but cgraph can reach `t` (or its memory).  A Python
// wrapper that only the tensor itself keeps alive does not count: torch
// preserves wrappers this way once Python has seen a tensor (as it has every
// .grad an optimizer read), and torch releases that carry
// impl::is_tensor_stealable, the test AccumulateGrad uses, know about it.
namespace ownership {
using namespace torch::autograd::impl;
template <class T>
auto only_python_wrapper_besides(const T& t, int) -> decltype(is_tensor_stealable(t, 1)) {
  return is_tensor_stealable(t, 1);
}
template <class T>
bool only_python_wrapper_besides(const T& t, long) {
  return t.use_count() == 1;
}
}  // namespace ownership

bool sole_owner(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->storage().use_count() == 1 &&
         ownership::only_python_wrapper_besides(t, 0);
}

// During a partial backward, whether it asks for parameter p's gradient.
bool named_by_partial_backward(const std::unordered_map<autograd::Node*,
                                   autograd::GraphTask::ExecInfo>& exec_info,
                               const at::Tensor& p) {
  const auto acc = autograd::impl::try_get_grad_accumulator(p);
  const auto it = acc ? exec_info.find(acc.get()) : exec_info.end();
  if (it == exec_info.end()) {
    return false;
  }
  TORCH_CHECK(!it->second.captures_,
              "cgraph: torch.autograd.grad with respect to a parameter of a graphed "
              "callable is not supported, because cgraph accumulates parameter grads "
              "itself (see Note [Parameter gradients]). Register a hook on that "
              "parameter before calling the graphed callable (p.register_hook(lambda g: g)) "
              "and its grad goes through autograd.");
  return it->second.should_execute();
}

// The slow path of Note [Parameter gradients].
void accumulate_param_grads_slowly(Engine& e, const std::vector<uint32_t>& fused,
                                   const std::unordered_map<autograd::Node*,
                                       autograd::GraphTask::ExecInfo>* partial) {
  TensorVec add_dst, add_src, copy_dst, copy_src;
  for (const uint32_t j : fused) {
    const at::Tensor& p = e.params[j];
    if (partial && !named_by_partial_backward(*partial, p)) {
      continue;
    }
    at::Tensor& grad = p.mutable_grad();
    if (grad.defined()) {
      add_dst.push_back(grad);
      add_src.push_back(e.grad_params[j]);
      continue;
    }
    const at::Tensor& store = e.grad_store[j];
    grad = sole_owner(store) ? store : at::empty_like(p, at::MemoryFormat::Preserve);
    copy_dst.push_back(grad);
    copy_src.push_back(e.grad_params[j]);
  }
  if (!copy_dst.empty()) {
    at::_foreach_copy_(copy_dst, copy_src);
  }
  if (!add_dst.empty()) {
    at::_foreach_add_(add_dst, add_src);
  }
}

// How a backward delivers the grads of the parameters cgraph accumulates
// (Note [Parameter gradients]).
enum class GradPath { None, CopyTail, AddTail, Slow };

// The partial backward running now (torch.autograd.grad, .backward(inputs=)),
// or nullptr for a full one.
const std::unordered_map<autograd::Node*, autograd::GraphTask::ExecInfo>* partial_backward() {
  const auto* exec_info = autograd::get_current_graph_task_exec_info();
  return exec_info && !exec_info->empty() ? exec_info : nullptr;
}

// Before the backward replay, since the tails are part of it: the path for
// the parameters in `fused` (those requiring grad, without hooks, with a
// grad at capture).
GradPath choose_grad_path(const Engine& e, const std::vector<uint32_t>& fused) {
  if (fused.empty()) {
    return GradPath::None;
  }
  bool all_fresh = !partial_backward() && fused.size() == e.num_tail_params;
  bool all_ours = all_fresh;
  for (size_t k = 0; k < fused.size() && (all_fresh || all_ours); ++k) {
    const uint32_t j = fused[k];
    const at::Tensor& grad = e.params[j].mutable_grad();
    const at::Tensor& store = e.grad_store[j];
    all_ours = all_ours && grad.unsafeGetTensorImpl() == store.unsafeGetTensorImpl();
    all_fresh = all_fresh && !grad.defined() && sole_owner(store);
  }
  return all_ours ? GradPath::AddTail : all_fresh ? GradPath::CopyTail : GradPath::Slow;
}

// After the backward replay: param.grad for the parameters in `fused`.
void deliver_param_grads(Engine& e, const std::vector<uint32_t>& fused, GradPath path) {
  switch (path) {
    case GradPath::None:
      return;
    case GradPath::AddTail:
      ++e.stats.grads_added;
      return;
    case GradPath::CopyTail:
      for (const uint32_t j : fused) {
        e.params[j].mutable_grad() = e.grad_store[j];
      }
      ++e.stats.grads_copied;
      return;
    case GradPath::Slow:
      accumulate_param_grads_slowly(e, fused, partial_backward());
      ++e.stats.grads_slow;
      return;
  }
}

// Copies each src into its dst: one launch for all of them.  Static inputs
// are the caller's sample tensors, often leaves that require grad: the copy
// is the graph's business, not autograd's.
void copy_all(const TensorVec& dst, const TensorVec& src) {
  at::NoGradGuard no_grad;
  if (dst.size() == 1) {
    dst[0].copy_(src[0]);
  } else if (!dst.empty()) {
    at::_foreach_copy_(dst, src);
  }
}

// Whether `src` must be copied into the static buffer `dst` (it lives
// elsewhere, or is laid out differently).  `src` may alias `dst` with other
// strides (a transpose of a square buffer): then it is cloned first.
bool needs_copy(const at::Tensor& dst, const at::Tensor& src, at::Tensor* staged) {
  const bool same_memory = src.const_data_ptr() == dst.const_data_ptr();
  if (same_memory && src.strides().equals(dst.strides())) {
    return false;
  }
  *staged = same_memory ? src.detach().clone() : src;
  return true;
}

// Note [Incoming grads]
// Q: How does an incoming grad reach the backward graph's buffer for it?
// A: As an argument reaches the forward's (Note [Argument copies inside the
//    graph]), with two more ways in, since autograd hands a backward node
//    grads that no memcpy can copy:
//      - dense, laid out as the buffer: the buffer's copy slot;
//      - every element one element in memory (the expanded grad of .sum(),
//        of a broadcast): the graph copies that element into a one-element
//        buffer (a second copy slot), then broadcasts it into the buffer (an
//        optional segment, one kernel);
//      - no grad at all (an output the loss does not use): an optional
//        segment zeroes the buffer;
//      - anything else (a transposed grad): ATen copies it before the replay.
//    Every replay sets all four, so the graph's own ways cost no ATen call
//    and no launch of their own.
bool aliases_one_element(const at::Tensor& t) {
  if (t.numel() <= 1) {
    return false;
  }
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) != 0) {
      return false;
    }
  }
  return true;
}

// Before the backward replay: sets every way into `buffer` for `grad`.
// Returns true if the caller must copy *staged into buffer before the replay.
bool route_incoming_grad(Engine& e, const Engine::GradIn& in, const at::Tensor& buffer,
                         const at::Tensor& grad, at::Tensor* staged) {
  Graph& g = *e.bwd;
  bool copy = false, element = false, zero = false, before = false;
  if (!grad.defined()) {
    zero = true;
  } else if (needs_copy(buffer, grad, staged)) {
    element = aliases_one_element(grad) && g.copy_in_from(in.element, grad.const_data_ptr());
    copy = !element && g.copy_in(in.copy, buffer, *staged);
    before = !element && !copy;
  }
  if (!copy) {
    g.skip_copy_in(in.copy);
  }
  if (!element) {
    g.skip_copy_in(in.element);
  }
  g.set_segment(in.broadcast, element);
  g.set_segment(in.zero, zero);
  e.stats.copied_in_graph += copy || element;
  return before;
}

// Whether argument i lives in another argument's static buffer (a caller
// passing one static input as another argument).  That buffer may be
// overwritten by its own copy first, so the argument is staged as a clone.
bool reads_another_input(const Engine& e, size_t i, const at::Tensor& src) {
  const c10::StorageImpl* storage = src.storage().unsafeGetStorageImpl();
  for (size_t j = 0; j < e.inputs.size(); ++j) {
    if (j != i && e.inputs[j].storage().unsafeGetStorageImpl() == storage) {
      return true;
    }
  }
  return false;
}

[[noreturn]] void raise_mismatch(const Engine& e, size_t i, const at::Tensor& got) {
  const at::Tensor& want = e.inputs[i];
  TORCH_CHECK_VALUE(false, "cgraph: argument '", e.input_names[i], "' has shape ",
                    got.sizes(), ", dtype ", got.scalar_type(), " on ", got.device(),
                    ", but the graph was captured with shape ", want.sizes(), ", dtype ",
                    want.scalar_type(), " on ", want.device(),
                    ". A CUDA graph replays fixed shapes and types: pass a tensor like the "
                    "sample (pad it to the captured shape), or graph the callable once per shape.");
}

// Note [Outputs of earlier calls]
// Q: The forward graph writes its outputs into the same memory on every
//    replay.  What happens to an output the caller kept from an earlier call?
// A: torch hands out the static outputs themselves, so a kept output silently
//    changes value at the next replay.  cgraph hands out, per call, tensors
//    with their own StorageImpl over the static memory (keeping that memory
//    alive), and at the next replay marks the earlier call's storages so that
//    any read of them, or of a view of them, raises an error that says what
//    happened (as torch.compile's cudagraph trees do).  Cost: one small host
//    allocation per output per call and no GPU work.  guard_outputs=False hands
//    out the static outputs unguarded, as torch does.
constexpr const char* kOverwrittenOutput =
    "cgraph: this tensor is an output of a graphed callable that has replayed since, "
    "which overwrote its memory. Clone outputs you keep across calls (out.clone()), or "
    "finish using them (including their backward) before calling the graphed callable again.";

at::Tensor guarded_alias(const at::Tensor& static_output) {
  auto* keep = new c10::Storage(static_output.storage());
  return at::for_blob(const_cast<void*>(keep->data()), static_output.sizes())
      .strides(static_output.strides())
      .storage_offset(static_output.storage_offset())
      .context(keep, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); })
      .options(static_output.options())
      // Named, or ATen asks the driver where the memory is (cudaPointerGetAttributes).
      .target_device(static_output.device())
      .make_tensor();
}

void invalidate_earlier_outputs(Engine& e) {
  for (const auto& weak : e.handed_out) {
    if (auto storage = weak.lock()) {
      storage->release_data_and_set_meta_custom_data_ptr_error_msg_(kOverwrittenOutput);
    }
  }
  e.handed_out.clear();
}

std::string describe_autocast(bool enabled, at::ScalarType dtype) {
  return enabled ? std::string("enabled (dtype ") + c10::toString(dtype) + ")" : "disabled";
}

[[noreturn]] void raise_autocast_mismatch(const Engine& e) {
  TORCH_CHECK(false, "cgraph: the graph was captured with CUDA autocast ",
              describe_autocast(e.autocast_enabled, e.autocast_dtype), " but is called with it ",
              describe_autocast(at::autocast::is_autocast_enabled(at::kCUDA),
                                at::autocast::get_autocast_dtype(at::kCUDA)),
              ". A graph replays the casts it captured: call it under the same autocast as "
              "the capture, or graph it again under this one.");
}

struct GraphedBackward final : autograd::Node {
  GraphedBackward(std::shared_ptr<Engine> engine, autograd::edge_list&& edges,
                  std::vector<int32_t>&& edge_sources, std::vector<uint32_t>&& fused_params)
      : autograd::Node(std::move(edges)),
        engine(std::move(engine)),
        generation(this->engine->generation),
        edge_sources(std::move(edge_sources)),
        fused_params(std::move(fused_params)) {}

  std::string name() const override { return "CGraphBackward"; }
  autograd::variable_list apply(autograd::variable_list&& grads) override;

  std::shared_ptr<Engine> engine;
  uint64_t generation;  // the forward replay this backward belongs to
  bool consumed = false;
  std::vector<int32_t> edge_sources;   // per next edge: input i >= 0, or ~j for parameter j
  std::vector<uint32_t> fused_params;  // parameters whose grads apply() accumulates
};

autograd::variable_list GraphedBackward::apply(autograd::variable_list&& grads) {
  Engine& e = *engine;
  TORCH_CHECK(e.alive, "cgraph: backward through a graphed callable that was reset() "
              "after this forward ran.");
  TORCH_CHECK(!consumed, "cgraph: a second backward through the same graphed call "
              "(retain_graph=True). The backward graph reuses the memory of the forward's "
              "activations, so each call supports one backward: call the graphed callable "
              "again before the next backward.");
  TORCH_CHECK(generation == e.generation, "cgraph: this graphed callable ran forward ",
              e.generation - generation, " more time(s) before this backward. A CUDA graph "
              "keeps one set of activations, so run each backward before the next forward "
              "of the same callable (graph one callable per micro-batch to keep several in "
              "flight).");
  consumed = true;

  // 1. Incoming grads into the static grad buffers, by the graph where it
  //    can: Note [Incoming grads].
  TensorVec dst, src;
  for (size_t slot = 0, k = 0; slot < e.outputs.size(); ++slot) {
    if (!e.output_requires_grad[slot]) {
      continue;
    }
    at::Tensor staged;
    if (route_incoming_grad(e, e.grad_ins[k], e.grad_outputs[slot], grads[k], &staged)) {
      dst.push_back(e.grad_outputs[slot]);
      src.push_back(std::move(staged));
    }
    ++k;
  }
  e.stats.copied_before += dst.size();
  copy_all(dst, src);

  // 2. Which tail of the graph delivers the parameter grads: Note
  //    [Parameter gradients].
  const GradPath path = choose_grad_path(e, fused_params);
  e.bwd->set_segment(e.tail_copy, path == GradPath::CopyTail);
  e.bwd->set_segment(e.tail_add, path == GradPath::AddTail);

  // 3. Replay.
  if (!e.rng.generators.empty()) {
    e.rng_before_backward_replay();
  }
  {
    RECORD_FUNCTION("cgraph::replay_backward_graph", std::vector<c10::IValue>());
    e.bwd->launch();
  }
  ++e.stats.backward;
  {
    RECORD_FUNCTION("cgraph::parameter_grads", std::vector<c10::IValue>());
    deliver_param_grads(e, fused_params, path);
  }

  // 4. Grads for the autograd edges.  Inputs: the static buffers themselves,
  //    still referenced here, so AccumulateGrad copies rather than steals.
  //    Hooked parameters: a copy, since their grads are graph temporaries.
  autograd::variable_list out(edge_sources.size());
  for (size_t m = 0; m < edge_sources.size(); ++m) {
    const int32_t s = edge_sources[m];
    out[m] = s >= 0 ? e.grad_inputs[s] : e.grad_params[~s].clone();
  }
  return out;
}

}  // namespace
}  // namespace cgraph

extern "C" PyObject* cg_engine_replay(cg_engine* engine, PyObject* const* args,
                                      Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  using namespace cgraph;
  RECORD_FUNCTION("cgraph::forward", std::vector<c10::IValue>());
  const std::shared_ptr<Engine>& shared = engine->ptr;
  Engine& e = *shared;
  TORCH_CHECK(e.alive, "cgraph: this graphed callable was reset(); graph the callable "
              "again to use it.");
  if (C10_UNLIKELY(at::autocast::is_autocast_enabled(at::kCUDA) != e.autocast_enabled ||
                   (e.autocast_enabled &&
                    at::autocast::get_autocast_dtype(at::kCUDA) != e.autocast_dtype))) {
    raise_autocast_mismatch(e);
  }
  const size_t n_in = e.inputs.size();
  TORCH_CHECK_TYPE(static_cast<size_t>(nargs) == n_in, "cgraph: the graph was captured "
                   "with ", n_in, " tensor argument(s), got ", nargs, ".");

  // 1. Check every input; gather the ones whose memory is not the static one.
  c10::SmallVector<const at::Tensor*, 16> args_grad;
  TensorVec dst, src;
  for (size_t i = 0; i < n_in; ++i) {
    PyObject* obj = args[i];
    TORCH_CHECK_TYPE(THPVariable_Check(obj), "cgraph: argument '", e.input_names[i],
                     "' is a ", Py_TYPE(obj)->tp_name, "; the graph was captured with a tensor.");
    const at::Tensor& t = THPVariable_Unpack(obj);
    const at::Tensor& s = e.inputs[i];
    if (C10_UNLIKELY(!t.sizes().equals(s.sizes()) || t.scalar_type() != s.scalar_type() ||
                     t.device() != s.device())) {
      raise_mismatch(e, i, t);
    }
    if (t.requires_grad()) {
      TORCH_CHECK(e.input_requires_grad[i], "cgraph: argument '", e.input_names[i],
                  "' requires grad, but its sample did not, so the backward graph computes "
                  "no grad for it. Graph again with a sample that requires grad.");
      args_grad.push_back(&t);
    } else {
      args_grad.push_back(nullptr);
    }
    at::Tensor staged;
    if (!needs_copy(s, t, &staged)) {
      e.fwd->skip_copy_in(i);
      continue;
    }
    if (C10_UNLIKELY(reads_another_input(e, i, t))) {
      staged = t.detach().clone();
    }
    if (e.fwd->copy_in(i, s, staged)) {
      ++e.stats.copied_in_graph;
    } else {
      dst.push_back(s);
      src.push_back(std::move(staged));
    }
  }
  bool params_need_grad = false;
  for (size_t j = 0; j < e.params.size(); ++j) {
    const at::Tensor& p = e.params[j];
    TORCH_CHECK(p.const_data_ptr() == e.param_ptrs[j], "cgraph: parameter ", j,
                " (shape ", p.sizes(), ") moved to new memory after capture (.to(), "
                ".data = ..., load_state_dict(assign=True)?); the graph would read the old "
                "memory. Graph the module again after moving it.");
    if (p.requires_grad()) {
      TORCH_CHECK(e.param_requires_grad[j], "cgraph: parameter ", j, " (shape ", p.sizes(),
                  ") requires grad, but did not at capture, so the backward graph computes "
                  "no grad for it. Graph the module again after unfreezing it.");
      params_need_grad = true;
    }
  }

  // 2. One copy launch for the moved inputs the graph does not copy itself,
  //    then the forward graph.
  e.stats.copied_before += dst.size();
  copy_all(dst, src);
  invalidate_earlier_outputs(e);
  {
    RECORD_FUNCTION("cgraph::replay_forward_graph", std::vector<c10::IValue>());
    if (e.rng.generators.empty()) {
      e.fwd->launch();
    } else {
      e.rng_before_forward_replay();
      e.fwd->launch();
      e.rng_after_forward_replay();
    }
  }
  ++e.generation;
  ++e.stats.forward;

  // 3. Outputs: aliases of the static outputs (Note [Outputs of earlier
  //    calls]), wired to a backward node when autograd will need one.
  bool any_arg_grad = false;
  for (const at::Tensor* t : args_grad) {
    any_arg_grad |= t != nullptr;
  }
  NodePtr node;
  if (e.has_bwd && (any_arg_grad || params_need_grad) && at::GradMode::is_enabled()) {
    autograd::edge_list edges;
    std::vector<int32_t> sources;
    std::vector<uint32_t> fused;
    for (size_t i = 0; i < n_in; ++i) {
      if (args_grad[i]) {
        edges.push_back(autograd::impl::gradient_edge(*args_grad[i]));
        sources.push_back(static_cast<int32_t>(i));
      }
    }
    for (size_t j = 0; j < e.params.size(); ++j) {
      const at::Tensor& p = e.params[j];
      if (!p.requires_grad() || !e.grad_params[j].defined()) {
        continue;
      }
      if (delivered_by_autograd(p)) {
        edges.push_back(autograd::impl::gradient_edge(p));
        sources.push_back(~static_cast<int32_t>(j));
      } else {
        fused.push_back(static_cast<uint32_t>(j));
      }
    }
    node = make_node<GraphedBackward>(shared, std::move(edges), std::move(sources),
                                      std::move(fused));
  }
  const auto n_out = static_cast<Py_ssize_t>(e.outputs.size());
  PyObject* result = PyTuple_New(n_out);
  if (!result) {
    throw python_error();
  }
  for (Py_ssize_t k = 0; k < n_out; ++k) {
    at::Tensor out;
    if (e.guard_outputs) {
      out = guarded_alias(e.outputs[k]);
      e.handed_out.push_back(out.storage().getWeakStorageImpl());
    } else {
      out = e.outputs[k].detach();
    }
    if (node && e.output_requires_grad[k]) {
      autograd::set_history(out, node);
    }
    PyObject* wrapped = THPVariable_Wrap(std::move(out));
    if (!wrapped) {
      Py_DECREF(result);
      throw python_error();
    }
    PyTuple_SET_ITEM(result, k, wrapped);
  }
  return result;
  END_HANDLE_TH_ERRORS_RET(nullptr)
}
