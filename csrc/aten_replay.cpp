// aten_replay.cpp -- the fourth place of the lifecycle, forward half: a
// graphed call's arguments checked and routed into the static inputs, the
// forward graph replayed, the backward node wired, the outputs handed out.
//
// This is the product.  It runs on every call, so it stays short, allocates
// nothing it can avoid, and reads top to bottom in replay() at the end of
// this file.  The backward half is aten_backward.cpp.
#include "aten_engine.hpp"

#include <ATen/MemoryOverlap.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <algorithm>

namespace cgraph {

void copy_all(const TensorVec& dst, const TensorVec& src) {
  // Static inputs are the caller's sample tensors, often leaves that require
  // grad: the copy is the graph's business, not autograd's.
  at::NoGradGuard no_grad;
  if (dst.size() == 1) {
    dst[0].copy_(src[0]);
  } else if (!dst.empty()) {
    at::_foreach_copy_(dst, src);
  }
}

bool needs_copy(const at::Tensor& dst, const at::Tensor& src, at::Tensor* staged) {
  const bool same_memory = src.const_data_ptr() == dst.const_data_ptr();
  if (same_memory && src.strides().equals(dst.strides())) {
    return false;
  }
  *staged = same_memory ? src.detach().clone() : src;
  return true;
}

namespace {

namespace autograd = torch::autograd;

// One call's arguments, checked and routed into the static inputs.
struct StagedCall {
  // Per input: the argument, if it requires grad (it gets a backward edge).
  c10::SmallVector<const at::Tensor*, 16> grad_args;
  bool any_grad_arg = false;
  bool ungraded_arg = false;  // one requires grad, unlike its sample
  // The arguments ATen copies before the replay, and where to.
  TensorVec dst, src;
  // Clones the graph copies from (an argument aliasing a static buffer):
  // alive until the launch, or a later allocation could reuse their memory.
  TensorVec clones;
  // The arguments the forward writes in place, and their static buffers:
  // copied back after the launch (Note [Arguments written in place]).
  TensorVec written_to, written_from;
};

[[noreturn]] void raise_mismatch(const Engine& e, size_t i, const at::Tensor& got) {
  const at::Tensor& want = e.inputs[i].buffer;
  TORCH_CHECK_VALUE(!e.inputs[i].in_place, "cgraph: argument '", e.inputs[i].name,
                    "' is not the output of the graphed callable this graph was captured "
                    "reading in place; call the callable, which captures a graph for it.");
  TORCH_CHECK_VALUE(!got.is_nested(), "cgraph: argument '", e.inputs[i].name,
                    "' is a nested tensor (nn.TransformerEncoder's fast path makes one from a "
                    "padded batch in evaluation), whose ragged shape no graph takes. Graph the "
                    "callable with make_graphed and max_graphs of 1 or more (such calls then "
                    "run eagerly), or turn that path off (encoder.use_nested_tensor = False).");
  TORCH_CHECK_VALUE(false, "cgraph: argument '", e.inputs[i].name, "' has shape ",
                    got.sizes(), ", dtype ", got.scalar_type(), " on ", got.device(),
                    ", but the graph was captured with shape ", want.sizes(), ", dtype ",
                    want.scalar_type(), " on ", want.device(),
                    ". A CUDA graph replays fixed shapes and types (another floating dtype is "
                    "cast): pass a tensor like the sample (pad it to the captured shape), or "
                    "graph the callable once per shape.");
}

[[noreturn]] void raise_autocast_mismatch(const Engine& e) {
  TORCH_CHECK(false, "cgraph: the graph was captured with CUDA autocast ",
              e.autocast.describe(), " but is called with it ", Autocast::current().describe(),
              ". A graph replays the casts it captured: call it under the same autocast as "
              "the capture, or graph it again under this one.");
}

// Whether argument i lives in another argument's static buffer (a caller
// passing one static input as another argument).  That buffer may be
// overwritten by its own copy first, so the argument is staged as a clone.
bool reads_another_input(const Engine& e, size_t i, const at::Tensor& src) {
  const c10::StorageImpl* storage = src.storage().unsafeGetStorageImpl();
  for (size_t j = 0; j < e.inputs.size(); ++j) {
    if (j != i && e.inputs[j].buffer.storage().unsafeGetStorageImpl() == storage) {
      return true;
    }
  }
  return false;
}

void check_call(const Engine& e, size_t nargs) {
  TORCH_CHECK(e.alive(), "cgraph: this graphed callable was reset(); graph the callable "
              "again to use it.");
  if (C10_UNLIKELY(!(Autocast::current() == e.autocast))) {
    raise_autocast_mismatch(e);
  }
  TORCH_CHECK(!at::GradMode::is_enabled() || e.grad_mode,
              "cgraph: the graph was captured under torch.no_grad() (it has no backward) but "
              "is called with grad enabled. Call it under torch.no_grad(), or graph it with "
              "grad enabled (or with max_graphs > 1, which captures a graph for each).");
  TORCH_CHECK(!e.inference_statics || c10::InferenceMode::is_enabled(),
              "cgraph: the graph was captured under torch.inference_mode(), or with samples "
              "made under it (its static tensors are inference tensors, which no call "
              "outside it may write), but is called outside it. Call it under "
              "inference_mode, or graph it outside inference_mode with samples made outside "
              "it (or with max_graphs > 1, which captures a graph for each).");
  TORCH_CHECK_TYPE(nargs == e.inputs.size(), "cgraph: the graph was captured with ",
                   e.inputs.size(), " tensor argument(s), got ", nargs, ".");
}

// Whether `t` may stand for input `in`: its shape and device, and its dtype
// or another floating one, which the copy into the static input casts (as
// torch's copy_ does; autograd casts the grad back).
bool fits(const Input& in, const at::Tensor& t) {
  if (C10_UNLIKELY(t.is_nested())) {  // ragged: no sizes to compare (cgraph/_regraph.py)
    return false;
  }
  const at::ScalarType have = t.scalar_type(), want = in.buffer.scalar_type();
  if (C10_UNLIKELY(in.in_place)) {  // Note [A layer reading the one before it in place]
    return have == want && t.const_data_ptr() == in.buffer.const_data_ptr() &&
           t.sizes().equals(in.buffer.sizes()) && t.strides().equals(in.buffer.strides());
  }
  return t.sizes().equals(in.buffer.sizes()) && t.device() == in.buffer.device() &&
         (have == want || (at::isFloatingType(have) && at::isFloatingType(want)));
}

const at::Tensor& check_argument(const Engine& e, size_t i, PyObject* obj) {
  const Input& in = e.inputs[i];
  TORCH_CHECK_TYPE(THPVariable_Check(obj), "cgraph: argument '", in.name, "' is a ",
                   Py_TYPE(obj)->tp_name, "; the graph was captured with a tensor.");
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (C10_UNLIKELY(!fits(in, t))) {
    raise_mismatch(e, i, t);
  }
  return t;
}

// Whether `t` lies in one of the engine's static outputs: an earlier
// call's output passed back (kept_outputs='alias'), which this replay
// writes as its own output.
bool in_static_output(const Engine& e, const at::Tensor& t) {
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  return std::any_of(e.outputs.begin(), e.outputs.end(), [&](const Output& out) {
    return out.buffer.storage().unsafeGetStorageImpl() == storage;
  });
}

// Argument i, which the forward writes in place (Note [Arguments written in
// place]): noted for the copy back unless it is the static input itself or
// an earlier output this replay rewrites (the output wins, as one memory
// cannot hold both); one eager could not write is refused before the
// replay, as eager refuses it before computing anything.
void note_written(Engine& e, size_t i, const at::Tensor& t, StagedCall& call) {
  const Input& in = e.inputs[i];
  if ((t.const_data_ptr() == in.buffer.const_data_ptr() &&
       t.strides().equals(in.buffer.strides())) || in_static_output(e, t)) {
    return;
  }
  TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "cgraph: argument '",
              in.name, "' is written in place by the callable, but more than one of its "
              "elements refers to one memory location (an expanded tensor), which eager "
              "refuses too. Pass a tensor of its own (.clone()).");
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), "cgraph: argument '",
              in.name, "' is written in place by the callable, but it is an inference tensor "
              "and the call is outside torch.inference_mode(), which eager refuses too. "
              "Call it inside inference_mode, or pass a normal tensor.");
  call.written_to.push_back(t);
  call.written_from.push_back(in.buffer);
}

// Routes argument i into its static input: by the graph's copy slot, by
// ATen before the replay, or not at all (it is the static input).
void stage_input(Engine& e, size_t i, const at::Tensor& t, StagedCall& call) {
  Input& in = e.inputs[i];
  at::Tensor staged;
  if (C10_UNLIKELY(in.written)) {
    note_written(e, i, t, call);
  }
  if (C10_UNLIKELY(t.scalar_type() != in.buffer.scalar_type())) {
    e.fwd->skip_copy_in(in.copy);  // a memcpy does not cast: ATen's copy_ does
    call.dst.push_back(in.buffer);
    call.src.push_back(t);
    return;
  }
  if (!needs_copy(in.buffer, t, &staged)) {
    e.fwd->skip_copy_in(in.copy);
    return;
  }
  if (C10_UNLIKELY(reads_another_input(e, i, t))) {
    staged = t.detach().clone();
  }
  if (e.fwd->copy_in(in.copy, in.buffer, staged)) {
    ++e.stats.copied_in_graph;
    if (C10_UNLIKELY(!staged.is_same(t))) {
      call.clones.push_back(std::move(staged));
    }
  } else {
    call.dst.push_back(in.buffer);
    call.src.push_back(std::move(staged));
  }
}

// 1. Every argument checked (unless accepts() just did) and routed (after
//    the earlier outputs are saved: Note [Outputs of earlier calls]).
void stage_inputs(Engine& e, PyObject* const* args, bool accepted, StagedCall& call) {
  for (size_t i = 0; i < e.inputs.size(); ++i) {
    const at::Tensor& t = accepted ? THPVariable_Unpack(args[i]) : check_argument(e, i, args[i]);
    call.grad_args.push_back(t.requires_grad() ? &t : nullptr);
    call.any_grad_arg |= t.requires_grad();
    call.ungraded_arg |= t.requires_grad() && !e.inputs[i].requires_grad;
    stage_input(e, i, t, call);
  }
}

// 2. Every parameter where the graphs read it.  Returns whether any
//    requires grad now.
bool check_params(const Engine& e) {
  e.check_param_memory(CG_FORWARD);
  bool need_grad = false;
  for (size_t j = 0; j < e.params.size(); ++j) {
    const Param& p = e.params[j];
    if (p.tensor.requires_grad()) {
      TORCH_CHECK(p.requires_grad, "cgraph: parameter ", j, " (shape ", p.tensor.sizes(),
                  ") requires grad, but did not at capture, so the backward graph computes "
                  "no grad for it. After unfreezing it, graph the callable again: reset these "
                  "graphs (graphed.reset(), or cgraph.reset_all() after graph_layers or "
                  "make_graphed_callables), then call make_graphed, graph_layers or "
                  "make_graphed_callables on it anew.");
      need_grad = true;
    }
  }
  return need_grad;
}

// Note [Outputs of earlier calls]
// Q: Each forward replay writes its outputs into the same memory.  What of one the caller
//    kept from an earlier call (a list of predictions, losses.append(loss), IPython's Out[],
//    a loss of two calls, a tensor autograd saved from it)?
// A: torch hands out the static outputs, so a kept one silently changes value.  cgraph hands
//    out per call tensors with their own StorageImpl over the static memory (keeping it
//    alive), watched weakly (HandedOut); before a replay overwrites it (Note [Captures that
//    share a pool]), each still alive (its storage, which views and saved tensors share)
//    moves out: a device-to-device copy on the caller's stream, then its DataPtr swapped
//    (move_to_own_memory), so every tensor over it keeps its value and address-independent
//    identity.  One nobody holds costs nothing (its weak reference is dead).  torch.compile's
//    cudagraph trees adopted the design in torch 2.14
//    (cudagraph_trees_generation_cloning="user_visible"); kept_outputs="error" makes such
//    storages unreadable instead, as cudagraph trees did before, and "alias" hands out the
//    static outputs, as torch does.  Checked with CGRAPH_DEBUG=1: HandedOut::outputs_lie_in()
//    in held_where_written().
constexpr const char* kOverwrittenOutput =
    "cgraph: this tensor is an output of a graphed callable whose memory a later replay, of "
    "that callable or of a graph sharing its memory pool, overwrote (kept_outputs='error'). "
    "Clone outputs you keep across calls "
    "(out.clone()), or graph with kept_outputs='copy' (the default) to keep their values.";

}  // namespace

// Before a backward replay too: between a call's forward and its backward,
// memory of a parameter can be freed and handed out again (FSDP2 reshards a
// module after its forward and gathers it again before its backward; for a
// module graphed inside another one's fully_shard, possibly elsewhere), and
// the backward graph would read whatever lies at the old address now.
void Engine::check_param_memory(cg_pass pass) const {
  for (size_t j = 0; j < params.size(); ++j) {
    const Param& p = params[j];
    if (C10_LIKELY(p.tensor.const_data_ptr() == p.data)) {
      continue;
    }
    TORCH_CHECK(pass == CG_FORWARD, "cgraph: parameter ", j, " (shape ", p.tensor.sizes(),
                ") is not where the backward graph reads it: its memory moved or was freed "
                "after this call's forward (fully_shard applied to a module around the graphed "
                "one, which frees it after the forward; set_unshard_in_backward(False); .to() "
                "or .data = ...), so the graph would read stale memory. Keep parameters where "
                "they are between a graphed call and its backward; under FSDP2, fully_shard "
                "each module you graph, then graph it.");
    TORCH_CHECK(false, "cgraph: parameter ", j, " (shape ", p.tensor.sizes(), ") moved to new "
                "memory after capture (.to(), .data = ..., load_state_dict(assign=True), "
                "fully_shard or parallelize_module after graphing?); the graph would read the "
                "old memory. Graph the module again after moving it; to shard a model, shard "
                "first (fully_shard every layer and the root), then graph each layer.");
  }
}

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

bool still_alias_of(const at::Tensor& alias, const at::Tensor& t) {
  return !alias.requires_grad() && alias.const_data_ptr() == t.const_data_ptr() &&
         alias.sizes().equals(t.sizes()) && alias.strides().equals(t.strides());
}

void move_to_own_memory(c10::DeviceIndex device, c10::StorageImpl& storage) {
  const size_t nbytes = storage.nbytes();
  c10::cuda::CUDAGuard guard(device);
  at::DataPtr own = c10::cuda::CUDACachingAllocator::get()->allocate(nbytes);
  if (nbytes > 0) {
    C10_CUDA_CHECK(cudaMemcpyAsync(own.get(), storage.data(), nbytes, cudaMemcpyDeviceToDevice,
                                   c10::cuda::getCurrentCUDAStream(device).stream()));
  }
  storage.set_data_ptr_noswap(std::move(own));  // drops its hold on the static memory
}

namespace {

// Whether nobody holds the tensors over `storage` (`uses` of them) but the
// tensors of `consumed` and, once, `ours` (the engine's own reference).
bool held_only_by(const c10::StorageImpl* storage, size_t uses, const at::Tensor* ours,
                  at::ArrayRef<at::Tensor> consumed) {
  struct Holder {
    const at::Tensor* tensor;
    size_t refs;
  };
  c10::SmallVector<Holder, 4> holders;  // the distinct tensors over `storage`
  const auto note = [&](const at::Tensor& t) {
    const at::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (!t.defined() || !impl->has_storage() ||
        impl->storage().unsafeGetStorageImpl() != storage) {
      return;
    }
    for (Holder& h : holders) {
      if (h.tensor->unsafeGetTensorImpl() == impl) {
        ++h.refs;
        return;
      }
    }
    holders.push_back({&t, 1});
  };
  if (ours != nullptr) {
    note(*ours);
  }
  for (const at::Tensor& t : consumed) {
    note(t);
  }
  for (const Holder& h : holders) {
    if (!held_at_most(*h.tensor, h.refs)) {
      return false;
    }
  }
  return uses == holders.size();
}

// Whether anybody but the engine and `consumed` holds Input::handed, a grad
// handed to autograd: a replay that writes its memory moves it first.
bool handed_held_elsewhere(const at::Tensor& handed, at::ArrayRef<at::Tensor> consumed) {
  return handed.defined() && !held_only_by(handed.storage().unsafeGetStorageImpl(),
                                           handed.storage().use_count(), &handed, consumed);
}

// Likewise for a watched storage (HandedOut), locked: the lock is one use.
bool watched_held_elsewhere(const c10::intrusive_ptr<c10::StorageImpl>& storage,
                            at::ArrayRef<at::Tensor> consumed) {
  return storage && !held_only_by(storage.get(), storage.use_count() - 1, nullptr, consumed);
}

// Whether Input::handed may be handed out again: nobody but the engine holds
// it, and nobody changed what it is.
bool reusable(const Input& in) {
  const at::Tensor& t = in.handed;
  return held_only_by(t.storage().unsafeGetStorageImpl(), t.storage().use_count(), &t, {}) &&
         still_alias_of(t, in.grad);
}


// Note [Arguments written in place]
// Q: A callable that writes an argument in place (a KV cache filled inside
//    forward, a counter bumped, x.relu_() on an input that needs no grad)
//    writes its static input when replayed, not the tensor the caller
//    passed; torch's make_graphed_callables leaves the caller's tensor as
//    it was, silently.  What does cgraph do?
// A: The forward capture compares each static input's version counter as
//    it began and as it ended (Engine::capture_begin, capture_end): a
//    counter that moved is an argument written in place (a view's write
//    moves its base's counter too).  After each replay whose argument is
//    not the static buffer itself, one copy (copy_all, on the caller's
//    stream, after the launch) writes the buffer back into it, so the
//    caller sees what eager leaves there; counted in stats["written_back"].
//    An argument that requires grad cannot be written in place with grad
//    enabled (its static input is a leaf that requires grad: the warm-up
//    raises, as eager does for a leaf), so no autograd history is skipped;
//    under no_grad, where eager writes a leaf too, it is copied back.  The
//    graph's own copy-in still runs first: a write of part of the argument
//    keeps the rest as passed.  After a replay on another stream, caller_stream
//    waits for the copies too.  An earlier output passed back
//    (kept_outputs='alias') is this replay's output as well: the output
//    wins, one memory cannot hold both.  An argument eager could not write
//    (an expanded tensor; an inference tensor outside inference_mode) is
//    refused before the replay.  Under buckets a padded copy is what the
//    graph writes (cgraph/_buckets.py copies the real rows back).  Not seen:
//    a write the capture call did not make (a branch on a Python value
//    taken only later), which no replay makes either; a write that moves no
//    version counter (through x.data, or a kernel outside autograd's
//    counting: cgraph.explain reports the first); and any write under
//    torch.inference_mode, whose tensors have no version counter.

// 3. One copy launch for the arguments the graph does not copy itself, then
//    the forward graph, then the copies back of the arguments it writes.
void launch_forward(Engine& e, const StagedCall& call) {
  e.stats.copied_before += call.dst.size();
  copy_all(call.dst, call.src);
  {
    RECORD_FUNCTION("cgraph::replay_forward_graph", std::vector<c10::IValue>());
    if (!e.rng.has_regions()) {
      e.launch(*e.fwd);
    } else {
      e.rng.before_forward_replay();
      e.launch(*e.fwd);
      e.rng.after_forward_replay();
    }
  }
  ++e.generation;
  ++e.stats.forward;
  if (C10_UNLIKELY(!call.written_to.empty())) {
    e.stats.written_back += call.written_to.size();
    copy_all(call.written_to, call.written_from);
    e.order_after_current();  // a replay on another stream: the copy back too
  }
}

// 4. The backward node, when autograd will need one: an edge per argument
//    that requires grad and per parameter delivered by autograd; the other
//    parameters' grads the node accumulates itself (Note [Parameter
//    gradients] in aten_backward.cpp).  An argument that requires grad
//    unlike its sample gets an edge that raises if a backward needs it.
NodePtr wire_backward(const std::shared_ptr<Engine>& shared, const StagedCall& call,
                      bool params_need_grad) {
  Engine& e = *shared;
  const bool graded = e.backward.exists() && (call.any_grad_arg || params_need_grad);
  if (!(graded || call.ungraded_arg) || !at::GradMode::is_enabled()) {
    return NodePtr();
  }
  BackwardWiring w;
  w.ungraded = call.ungraded_arg;
  for (size_t i = 0; i < e.inputs.size(); ++i) {
    if (call.grad_args[i] != nullptr) {
      w.edges.push_back(autograd::impl::gradient_edge(*call.grad_args[i]));
      w.sources.push_back({e.inputs[i].requires_grad ? EdgeSource::Kind::Input
                                                     : EdgeSource::Kind::UngradedInput,
                           static_cast<uint32_t>(i)});
    }
  }
  for (size_t j = 0; j < e.params.size(); ++j) {
    const Param& p = e.params[j];
    if (!p.tensor.requires_grad() || !p.grad.defined()) {
      continue;
    }
    if (delivered_by_autograd(p.tensor)) {
      w.edges.push_back(autograd::impl::gradient_edge(p.tensor));
      w.sources.push_back({EdgeSource::Kind::Param, static_cast<uint32_t>(j)});
    } else {
      w.fused.push_back(static_cast<uint32_t>(j));
    }
  }
  return make_backward_node(shared, std::move(w));
}

// 5. The outputs: aliases of the static outputs (Note [Outputs of earlier
//    calls]), with the backward node as their grad_fn where they require
//    grad.  Returns a NEW reference to a tuple.
PyObject* wrap_outputs(Engine& e, const NodePtr& node, bool ungraded) {
  THPObjectPtr result(PyTuple_New(static_cast<Py_ssize_t>(e.outputs.size())));
  if (!result) {
    throw python_error();
  }
  for (size_t k = 0; k < e.outputs.size(); ++k) {
    const Output& o = e.outputs[k];
    at::Tensor out;
    if (e.kept_outputs == CG_KEEP_ALIAS) {
      out = o.buffer.detach();
    } else {
      out = guarded_alias(o.buffer);
      e.handed.watch_output(out);
    }
    if (node && attaches(o, ungraded)) {
      autograd::set_history(out, node);
    }
    PyObject* wrapped = THPVariable_Wrap(std::move(out));
    if (!wrapped) {
      throw python_error();
    }
    PyTuple_SET_ITEM(result.get(), static_cast<Py_ssize_t>(k), wrapped);
  }
  return result.release();
}

bool capturing(const c10::cuda::CUDAStream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

// Makes `waiter`'s later work wait for `stream`'s work so far.
void wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& stream) {
  cudaEvent_t event = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(event, stream.stream());
  const cudaError_t waited =
      recorded == cudaSuccess ? cudaStreamWaitEvent(waiter.stream(), event, 0) : recorded;
  C10_CUDA_CHECK(cudaEventDestroy(event));  // released once the wait is done
  C10_CUDA_CHECK(waited);
}

}  // namespace

// ---- HandedOut: what the engine handed out and watches, written only here --

void HandedOut::watch_output(const at::Tensor& out) {
  outputs_.push_back(out.storage().getWeakStorageImpl());
}

void HandedOut::watch_replaced_grad(const at::Tensor& grad) {
  grads_.push_back(grad.storage().getWeakStorageImpl());  // watched until it dies
}

void HandedOut::release_outputs(cg_kept_outputs policy, c10::DeviceIndex device,
                                cg_stats& stats) {
  for (const auto& weak : outputs_) {
    if (auto storage = weak.lock()) {
      if (policy == CG_KEEP_COPY) {
        move_to_own_memory(device, *storage);
        ++stats.outputs_copied;
      } else {
        storage->release_data_and_set_meta_custom_data_ptr_error_msg_(kOverwrittenOutput);
        ++stats.outputs_invalidated;
      }
    }
  }
  outputs_.clear();
}

void HandedOut::release_replaced_grads(at::ArrayRef<at::Tensor> consumed,
                                       c10::DeviceIndex device, cg_stats& stats) {
  size_t watched = 0;
  for (size_t k = 0; k < grads_.size(); ++k) {
    const auto storage = grads_[k].lock();
    if (storage && !watched_held_elsewhere(storage, consumed)) {
      std::swap(grads_[watched++], grads_[k]);  // looked at again next replay
    } else if (storage) {
      move_to_own_memory(device, *storage);
      ++stats.input_grads_copied;
    }
  }
  grads_.erase(grads_.begin() + static_cast<std::ptrdiff_t>(watched), grads_.end());
}

bool HandedOut::outputs_lie_in(const std::vector<Output>& statics) const {
  for (const auto& weak : outputs_) {
    const auto storage = weak.lock();
    for (const Output& o : statics) {
      if (storage && o.buffer.defined() && o.buffer.has_storage() &&
          storage->data_ptr().get() == o.buffer.storage().data_ptr().get()) {
        return true;
      }
    }
  }
  return false;
}

bool HandedOut::replaced_grads_held(at::ArrayRef<at::Tensor> consumed) const {
  for (const auto& weak : grads_) {
    if (watched_held_elsewhere(weak.lock(), consumed)) {
      return true;
    }
  }
  return false;
}

void HandedOut::forget() noexcept {
  outputs_.clear();
  grads_.clear();
}

void Engine::release_earlier_outputs() {
  handed.release_outputs(kept_outputs, device, stats);
}

// Note [Grads handed to autograd]
// Q: A backward replay gives autograd the grads for the graph's inputs, which live in static
//    buffers.  Which replays overwrite them, and who may still hold one then?
// A: A grad buffer is allocated at its engine's backward capture from the blocks then free
//    (temporaries of its own forward capture and of earlier captures), so the engine's own
//    replays may overwrite it, and so may graphs captured before that backward capture:
//    within one backward when layers are captured one by one (Note [Layers captured one by
//    one into one pool] in aten_pool.cpp), or once the buffer was freed, graphs captured after
//    the free too (Notes [Input grads freed at their capture] and [Static memory freed once
//    its pass is over]).  The node it flows to mostly reads it as it starts,
//    nobody holding it then; but a hook may keep it, torch.autograd.grad return it, and
//    autograd hold it in a node's input buffer until that node's other grads arrive (with
//    h2 = B(h1) and C(h2 + h1), the grad C hands back waits for h1's node while B's backward
//    replays).  torch returns the buffers themselves, which then silently change.
//    cgraph hands out a tensor with its own storage over the buffer (Input::handed, as for
//    outputs: Note [Outputs of earlier calls]) and, before a replay that may overwrite it,
//    copies one held by anybody but cgraph to memory of its own (release_handed_grads), never
//    making it unreadable: the holder may be autograd.  One held only as an incoming grad of
//    the backward about to replay stays: that graph reads it before writing anything but its
//    incoming-grad buffers, and one lying in those is cloned first (Note [Incoming grads] in
//    aten_backward.cpp).  Input::handed is handed out again while nobody else holds it, so a
//    backward allocates nothing for it, and the engine's reference keeps AccumulateGrad from
//    taking it as a leaf's .grad (it copies, as from torch's buffers) and autograd from
//    adding into it in place; one replaced while still held is watched in HandedOut until it
//    dies (hand_out_grad).  kept_outputs="alias" hands out the buffers, as torch does.
//    Checked with CGRAPH_DEBUG=1: holds_grads_in_place() in held_where_written().
//
// Graphs of one pool replay on one thread at a time, the caller's or autograd's while the
// caller waits in backward(), so these lists are not locked.
at::Tensor Engine::hand_out_grad(Input& in) {
  if (kept_outputs == CG_KEEP_ALIAS || !in.grad.defined()) {  // undefined: allow_unused_input
    return in.grad;  // still referenced here: AccumulateGrad copies it, not steals
  }
  if (in.handed.defined() && !reusable(in)) {
    handed.watch_replaced_grad(in.handed);
    in.handed = at::Tensor();
  }
  if (!in.handed.defined()) {
    in.handed = guarded_alias(in.grad);
  }
  return in.handed;  // held here too: AccumulateGrad copies it, not steals
}

bool Engine::may_hold_grads() const {
  bool may = handed.has_replaced_grads();
  for (const Input& in : inputs) {
    may = may || alias_may_be_held(in.handed);
  }
  for (const Param& p : params) {
    may = may || (p.owns_store && p.store->may_be_held());
  }
  return may;
}

void Engine::release_handed_grads(at::ArrayRef<at::Tensor> consumed) {
  release_handed_input_grads(consumed);
  for (Param& p : params) {  // Note [Parameter gradients] (aten_backward.cpp)
    if (p.owns_store && p.store->release()) {
      ++stats.param_grads_copied;
    }
  }
}

void Engine::release_handed_input_grads(at::ArrayRef<at::Tensor> consumed) {
  for (Input& in : inputs) {
    if (handed_held_elsewhere(in.handed, consumed)) {
      move_to_own_memory(device, *in.handed.storage().unsafeGetStorageImpl());
      ++stats.input_grads_copied;
      in.handed = at::Tensor();  // its holders keep it, in memory of its own now
    }
  }
  handed.release_replaced_grads(consumed, device, stats);
}

bool Engine::holds_outputs_in_place() const {
  return handed.outputs_lie_in(outputs);
}

// What release_handed_grads leaves, recomputed: Note [Checked invariants].
bool Engine::holds_grads_in_place(at::ArrayRef<at::Tensor> consumed) const {
  for (const Input& in : inputs) {
    if (handed_held_elsewhere(in.handed, consumed)) {
      return true;
    }
  }
  if (handed.replaced_grads_held(consumed)) {
    return true;
  }
  for (const Param& p : params) {
    if (p.owns_store && p.store->held_by_others()) {
      return true;
    }
  }
  return false;
}

// Note [Replays on another stream]
// A graph replays on the stream current at the call, usually the stream it
// was captured from (caller_stream), in order with the eager work there.
// Its GEMMs share that stream's cuBLAS workspace with the eager GEMMs on it
// (Note [One cuBLAS workspace per stream], aten_workspace.cpp), so a replay
// on another stream, running beside them, would race them for it.  Such a
// replay waits for caller_stream's work so far, and caller_stream's later
// work waits for the replay: what would run beside it runs after it.  (This
// also orders graphs whose capture ran no GEMM, if a workspace was alive:
// the price of not tracking which graph used it; one pointer compare when
// the streams match.)
void Engine::launch(Graph& graph) {
  const c10::cuda::CUDAStream now = c10::cuda::getCurrentCUDAStream(device);
  if (now == caller_stream || !blas_workspace || capturing(now)) {
    graph.launch(now.stream());  // while capturing, launch() refuses with its own error
    return;
  }
  c10::cuda::CUDAGuard on_device(device);  // the events must be the streams'
  wait_for(now, caller_stream);
  graph.launch(now.stream());
  wait_for(caller_stream, now);
}

// After work queued on the current stream behind a launch (the copies back
// of Note [Arguments written in place]): caller_stream's later work waits
// for it too, where launch() made it wait for the graph.
void Engine::order_after_current() {
  const c10::cuda::CUDAStream now = c10::cuda::getCurrentCUDAStream(device);
  if (now == caller_stream || !blas_workspace || capturing(now)) {
    return;
  }
  c10::cuda::CUDAGuard on_device(device);
  wait_for(caller_stream, now);
}

namespace {

// Whether a parameter frozen at capture requires grad now (unfrozen since:
// the backward graph computes no grad for it).  One frozen since is fine:
// its grad is dropped (wire_backward).
bool unfrozen_since(const Engine& e) {
  for (const Param& p : e.params) {
    if (!p.requires_grad && p.tensor.requires_grad()) {
      return true;
    }
  }
  return false;
}

}  // namespace

// The same checks as check_call, check_argument and check_params, answered
// instead of raised.  Where a graph for the call can be captured: with
// exact_grad, an argument that requires grad unlike its sample does not
// fit, nor a parameter unfrozen since (a fine-tuning schedule: a graph
// whose backward computes its grad is captured); with exact_dtype, one of
// another dtype does not either, so a graph of its own computes what eager
// does (a bf16 tensor through a function without parameters stays bf16;
// through a float32 Linear, eager raises), where the cast would compute in
// the sample's.
bool accepts(const Engine& e, PyObject* const* args, size_t nargs, bool exact_grad,
             bool exact_dtype) {
  if (!e.alive() || nargs != e.inputs.size() || !(Autocast::current() == e.autocast) ||
      (at::GradMode::is_enabled() && !e.grad_mode) ||
      (e.inference_statics && !c10::InferenceMode::is_enabled()) ||
      (exact_grad && unfrozen_since(e))) {
    return false;
  }
  for (size_t i = 0; i < nargs; ++i) {
    if (!THPVariable_Check(args[i])) {
      return false;
    }
    const at::Tensor& t = THPVariable_Unpack(args[i]);
    const Input& in = e.inputs[i];
    if (!fits(in, t) || (exact_grad && t.requires_grad() && !in.requires_grad) ||
        (exact_dtype && t.scalar_type() != in.buffer.scalar_type())) {
      return false;
    }
  }
  return true;
}

namespace {

// Note [Checked invariants]: an input read in place lies in the static
// output whose memory its owner keeps allocated (Note [A layer reading the
// one before it in place], aten_pool.cpp).
bool reads_in_place_from_owner(const Engine& e) {
  for (const Input& in : e.inputs) {
    if (!in.in_place || in.buffer.numel() == 0) {
      continue;
    }
    if (!in.owner.defined()) {
      return false;
    }
    const auto* begin = static_cast<const char*>(in.owner.storage().data_ptr().get());
    const auto* at = static_cast<const char*>(in.buffer.const_data_ptr());
    if (at < begin || at >= begin + in.owner.storage().nbytes()) {
      return false;
    }
  }
  return true;
}

}  // namespace

PyObject* replay(const std::shared_ptr<Engine>& shared, PyObject* const* args, size_t nargs,
                 bool accepted) {
  RECORD_FUNCTION("cgraph::forward", std::vector<c10::IValue>());
  Engine& e = *shared;
  if (accepted) {
    CG_DEBUG_INVARIANT(accepts(e, args, nargs, /*exact_grad=*/false, /*exact_dtype=*/false),
                       "a call replayed as accepted that accepts() refuses.");
  } else {
    check_call(e, nargs);
  }
  CG_DEBUG_INVARIANT(e.may_replay_forward(), "a forward replay was chosen while a pending "
                     "backward of its pool needs what it writes (Note [Captures that share "
                     "a pool]).");
  CG_DEBUG_INVARIANT(reads_in_place_from_owner(e), "an input read in place lies outside the "
                     "output that keeps it allocated.");
  // First the earlier call's outputs saved from this replay: one may be an
  // argument now, or a static input that staging refills.
  e.release_earlier_outputs();
  e.release_later_outputs(CG_FORWARD);  // Note [Captures that share a pool] (aten_pool.cpp)
  StagedCall call;
  stage_inputs(e, args, accepted, call);
  const bool params_need_grad = check_params(e);
  launch_forward(e, call);
  const NodePtr node = wire_backward(shared, call, params_need_grad);
  e.note_latest_node(node);
  return wrap_outputs(e, node, call.ungraded_arg);
}

}  // namespace cgraph
