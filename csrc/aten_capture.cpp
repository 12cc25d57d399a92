// aten_capture.cpp -- the C++ half of set-up, warm-up, capture and reset.
//
// Every extern "C" function here sits inside HANDLE_TH_ERRORS, which turns
// C++ and c10 exceptions into Python exceptions: none crosses into C.
#include "aten_engine.hpp"
#include "tensor_lists.h"

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_variable.h>

#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace cgraph {
namespace {

cudaStreamCaptureMode to_cuda_mode(cg_capture_mode mode) {
  switch (mode) {
    case CG_CAPTURE_THREAD_LOCAL:
      return cudaStreamCaptureModeThreadLocal;
    case CG_CAPTURE_RELAXED:
      return cudaStreamCaptureModeRelaxed;
    default:
      return cudaStreamCaptureModeGlobal;
  }
}

// Unpacks a Python sequence of tensors.  `what` names the items in errors.
std::vector<at::Tensor> unpack_tensors(PyObject* seq, const char* what) {
  PyObject* fast = PySequence_Fast(seq, "cgraph: expected a sequence of tensors");
  if (!fast) {
    throw python_error();
  }
  std::vector<at::Tensor> out;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(fast, i);
    if (!THPVariable_Check(item)) {
      const char* type_name = Py_TYPE(item)->tp_name;
      Py_DECREF(fast);
      TORCH_CHECK_TYPE(false, "cgraph: ", what, " ", i, " is a ", type_name,
                       "; graphed callables take and return tensors "
                       "(nested in tuples, lists or dicts).");
    }
    out.push_back(THPVariable_Unpack(item));
  }
  Py_DECREF(fast);
  return out;
}

// Prefers the allocator's per-pool emptyCache(pool); falls back to emptying
// the whole cache on torch releases without it.
template <class Pool>
auto empty_pool_cache(const Pool& pool, int)
    -> decltype(c10::cuda::CUDACachingAllocator::emptyCache(pool)) {
  return c10::cuda::CUDACachingAllocator::emptyCache(pool);
}
template <class Pool>
void empty_pool_cache(const Pool&, long) {
  c10::cuda::CUDACachingAllocator::emptyCache();
}

// Note [The capture stream]
// Every warm-up and capture on a device runs on one stream, created once:
//  - a *blocking* stream (torch's pool streams are non-blocking), so work the
//    callable puts on the legacy default stream during capture fails with
//    cudaErrorStreamCaptureImplicit instead of running once, outside the
//    graph, without a word;
//  - the same stream for every capture, because the caching allocator reuses
//    a pool's free blocks only on the stream that freed them: graphs captured
//    by separate calls that share a pool (pool=) can then share its memory,
//    as torch.cuda.graph's class-wide capture stream allows.
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mutex);
  cudaStream_t& stream = streams[device];
  if (stream == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamDefault));
  }
  return c10::cuda::getStreamFromExternal(stream, device);
}

Graph& graph_of(Engine& e, cg_pass pass) {
  return pass == CG_FORWARD ? *e.fwd : *e.bwd;
}

// Abandons a capture whose recording failed.  Never throws.
void abandon_capture(Engine& e, Graph& g) noexcept {
  e.rng_capture_end();  // first: abandon() may repair the default generator
  g.abandon();
}

// Ends a capture whose recording succeeded, abandoning it if ending fails,
// and checks that the callable left the host's generators alone.
void end_capture(Engine& e, Graph& g) {
  try {
    g.capture_end();
  } catch (...) {
    abandon_capture(e, g);
    throw;
  }
  e.rng_capture_end();
  e.check_host_rng_untouched(e.rng.host_before);
}

// Note [cuBLAS workspaces during capture]
// Q: Why does cgraph drop the capture stream's cuBLAS workspaces?
// A: torch keeps a cuBLAS and a cuBLASLt workspace (32 MiB each on Hopper)
//    per (handle, stream), and each thread has its own handle: a forward
//    captured on the caller's thread and a backward captured on autograd's
//    device thread would pin up to four workspaces to the capture stream for
//    the life of the process, beside those of the caller's stream that
//    eager GEMMs use: 64-128 MiB more than eager mode holds.  cgraph drops
//    the capture stream's entries after warm-up and around every capture.
//    The first GEMM of a capture then allocates its workspace from the graph
//    pool, and dropping it at the capture's end frees that block like any
//    other temporary of the graph: later captures reuse it (for their own
//    workspace, among others), which is safe for the same reason sharing a
//    pool is (Note at the top of capture.c): graphs replay in the order they
//    were captured, one at a time.
template <class WorkspaceMap>
void drop_stream_entries(WorkspaceMap& workspaces, cudaStream_t stream) {
  std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
  for (auto it = workspaces.map.begin(); it != workspaces.map.end();) {
    it = std::get<1>(it->first) == static_cast<void*>(stream) ? workspaces.map.erase(it)
                                                               : std::next(it);
  }
}

void drop_blas_workspaces(cudaStream_t stream) {
  drop_stream_entries(at::cuda::cublas_handle_stream_to_workspace(), stream);
  drop_stream_entries(at::cuda::cublaslt_handle_stream_to_workspace(), stream);
}

}  // namespace

void Graph::capture_begin(at::cuda::MempoolId_t pool, cudaStreamCaptureMode mode) {
  drop_blas_workspaces(c10::cuda::getCurrentCUDAStream().stream());
  at::cuda::CUDAGraph::capture_begin(pool, mode);
}

void Graph::capture_end() {
  at::cuda::CUDAGraph::capture_end();
  drop_blas_workspaces(c10::cuda::getCurrentCUDAStream().stream());
  if (!has_graph_exec_) {
    capture_rng_seeds();
    instantiate();  // a graph that keeps its cudaGraph_t: torch leaves this to us
  } else {
    seeds_in_graph_ = false;  // instantiated already: torch's replay() seeds it
  }
}

void Graph::abandon() noexcept {
  bool invalidated = false;
  try {
    // Succeeds when only Python code failed and the stream capture is
    // intact; then torch's own bookkeeping unwinds everything.
    capture_end();
  } catch (...) {
    // The capture was invalidated.  cudaStreamEndCapture has ended it all
    // the same; clear the error it left and undo the allocator routing.
    // See Note [Abandoning a capture].
    invalidated = true;
    (void)cudaGetLastError();
    if (!reset_ends_pool_routing(*this, 0)) {
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(capture_dev_, mempool_id_);
        c10::cuda::CUDACachingAllocator::releasePool(capture_dev_, mempool_id_);
      } catch (const std::exception& e) {
        TORCH_WARN("cgraph: could not release the pool of a failed capture: ", e.what());
      }
    }
  }
  try {
    reset();
    drop_blas_workspaces(c10::cuda::getCurrentCUDAStream().stream());
  } catch (...) {
  }
  (void)cudaGetLastError();
  if (invalidated) {
    finish_generator_capture();
  }
}

namespace {
// Swallows torch warnings while alive ("The CUDA Graph is empty").
struct QuietWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};
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

// One tail of Note [Parameter gradients], recorded into the capture:
// stores[j] = sources[j], or += with `add`.  tensor_lists.cu takes the copy,
// or the adds of each dtype, in one launch; what it cannot take, ATen's
// foreach ops.
void record_tail(bool add, const std::vector<at::Tensor>& stores,
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

}  // namespace

// Note [Generators after a failed capture]
// torch ends a capture's RNG bookkeeping (the capture epilogue) only after
// cudaStreamEndCapture succeeds.  An invalidated capture skips it, which
// leaves the default CUDA generator marked as capturing: every later random
// op (dropout, randn) then fails with "Offset increment outside graph
// capture encountered unexpectedly".  Capturing an empty graph on the same
// stream runs prologue and epilogue once more and clears the mark.
void Graph::finish_generator_capture() noexcept {
  try {
    QuietWarnings quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    at::cuda::CUDAGraph empty;
    empty.capture_begin();
    empty.capture_end();
  } catch (const std::exception& e) {
    (void)cudaGetLastError();
    TORCH_WARN("cgraph: random ops may fail after this failed capture: ", e.what());
  }
}

// Leaves that require grad and that the forward reads, but that are neither
// inputs nor module parameters (a tensor captured in a closure, a parameter
// of another module).  torch's make_graphed_callables silently drops their
// grads; cgraph treats them as parameters.
void Engine::adopt_hidden_leaves(const std::vector<at::Tensor>& outs) {
  using torch::autograd::AccumulateGrad;
  using torch::autograd::Node;
  // Inputs are leaves (cgraph/_api.py _static_input), so the walk below
  // stops at their AccumulateGrad nodes.
  std::unordered_set<const c10::TensorImpl*> known;
  for (const at::Tensor& t : inputs) {
    known.insert(t.unsafeGetTensorImpl());
  }
  for (const at::Tensor& p : params) {
    known.insert(p.unsafeGetTensorImpl());
  }
  std::vector<Node*> stack;
  std::unordered_set<const Node*> seen;
  for (const at::Tensor& o : outs) {
    if (o.grad_fn()) {
      stack.push_back(o.grad_fn().get());
    }
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) {
      continue;
    }
    if (auto* acc = dynamic_cast<AccumulateGrad*>(node)) {
      const at::Tensor& leaf = acc->variable;
      if (leaf.defined() && known.insert(leaf.unsafeGetTensorImpl()).second) {
        params.push_back(leaf);
        param_ptrs.push_back(leaf.const_data_ptr());
        param_requires_grad.push_back(leaf.requires_grad());
      }
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.is_valid()) {
        stack.push_back(edge.function.get());
      }
    }
  }
}

// Note [Grad accumulators during capture]
// A parameter's grad accumulator (the AccumulateGrad node autograd ends at)
// remembers the stream that was current when it was made, and the backward
// pass makes that stream wait for the producer of the grad.  DDP makes the
// accumulators at construction, to hang its hooks on them, usually on the
// legacy default stream; a backward capture then asks the legacy stream to
// wait on the capture stream, which CUDA refuses (cudaError 906; NVIDIA's
// guide has users build DDP on a side stream).  cgraph sets each parameter's
// accumulator aside from engine creation to the end of capture, so autograd
// makes fresh ones on the capture stream, then puts the originals back:
// replays deliver grads to them, DDP's hooks included.  Post-accumulate-grad
// hooks (register_post_accumulate_grad_hook) go aside with them: warm-up and
// capture run AccumulateGrad (Note [Backward capture runs .backward()]),
// and the hooks must run at each replay, not once at capture.
void Engine::set_aside_grad_accumulators() {
  for (const at::Tensor& p : params) {
    post_acc_hooks_aside.push_back(std::move(torch::autograd::impl::post_acc_grad_hooks(p)));
    auto* meta = torch::autograd::impl::get_autograd_meta(p);
    if (meta == nullptr) {
      accumulators_aside.emplace_back(NodePtr());
      continue;
    }
    std::lock_guard<std::mutex> lock(meta->mutex_);
    accumulators_aside.push_back(std::move(meta->grad_accumulator_));
    meta->grad_accumulator_ = WeakNodePtr(NodePtr());
  }
}

void Engine::restore_grad_accumulators() noexcept {
  for (size_t j = 0; j < accumulators_aside.size(); ++j) {
    auto* meta = torch::autograd::impl::get_autograd_meta(params[j]);
    if (meta != nullptr) {
      std::lock_guard<std::mutex> lock(meta->mutex_);
      meta->grad_accumulator_ = std::move(accumulators_aside[j]);
    }
    if (post_acc_hooks_aside[j]) {
      torch::autograd::impl::post_acc_grad_hooks(params[j]) = std::move(post_acc_hooks_aside[j]);
    }
  }
  accumulators_aside.clear();
  post_acc_hooks_aside.clear();
}

// What the backward graph differentiates with respect to, in order: inputs
// that required grad at capture, then parameters that did.
std::vector<at::Tensor> Engine::grad_targets() const {
  std::vector<at::Tensor> wrt;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (input_requires_grad[i]) {
      wrt.push_back(inputs[i]);
    }
  }
  for (size_t j = 0; j < params.size(); ++j) {
    if (param_requires_grad[j]) {
      wrt.push_back(params[j]);
    }
  }
  return wrt;
}

// Note [Backward capture runs .backward()]
// Q: Why not torch.autograd.grad(outputs, inputs), as torch does?
// A: A backward that names the tensors it wants grads for (autograd.grad,
//    or .backward(inputs=...)) refuses torch.utils.checkpoint with
//    use_reentrant=True, whose backward re-enters autograd with a plain
//    .backward() (as Megatron's and DeepSpeed's checkpointing do).  So the
//    warm-up and the capture run a plain .backward(), as the training loop
//    would, and collect the grads where AccumulateGrad leaves them: in the
//    .grad of the static inputs and parameters, each set aside before and
//    put back after.  The static inputs are leaves (cgraph/_api.py detaches
//    a sample that has autograd history), so backward stops at them.  A
//    leaf the forward reads outside its parameters is found by
//    adopt_hidden_leaves(), except one read only inside a reentrant region:
//    its history is built by the recompute, during backward, out of sight.
// Returns the grads of grad_targets(), in order; undefined where none flowed.
std::vector<at::Tensor> Engine::run_backward(const std::vector<at::Tensor>& outs,
                                             const std::vector<at::Tensor>& grad_outs) {
  std::vector<at::Tensor> wrt = grad_targets();
  // A tensor both argument and parameter appears twice: one slot per tensor.
  std::unordered_map<const c10::TensorImpl*, size_t> first;
  std::vector<at::Tensor> aside(wrt.size());
  for (size_t k = 0; k < wrt.size(); ++k) {
    if (first.emplace(wrt[k].unsafeGetTensorImpl(), k).second) {
      aside[k] = std::exchange(wrt[k].mutable_grad(), at::Tensor());
    }
  }
  auto put_back = [&](std::vector<at::Tensor>* grads) {
    for (size_t k = 0; k < wrt.size(); ++k) {
      const size_t f = first.at(wrt[k].unsafeGetTensorImpl());
      if (f == k) {
        at::Tensor g = std::exchange(wrt[k].mutable_grad(), std::move(aside[k]));
        if (grads) {
          (*grads)[k] = std::move(g);
        }
      } else if (grads) {
        (*grads)[k] = (*grads)[f];
      }
    }
  };
  std::vector<at::Tensor> grads(wrt.size());
  try {
    cgraph::GilRelease nogil;
    torch::autograd::backward(outs, grad_outs, /*retain_graph=*/false, /*create_graph=*/false);
  } catch (...) {
    put_back(nullptr);
    throw;
  }
  put_back(&grads);
  if (!allow_unused) {
    const char* advice = " requires grad, but the callable's outputs do not depend on it "
                         "(differentiably). Pass allow_unused_input=True to accept that, as "
                         "with torch's make_graphed_callables, or set requires_grad=False.";
    size_t k = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(!input_requires_grad[i] || grads[k++].defined(), "cgraph: argument '",
                  input_names[i], "'", advice);
    }
    for (size_t j = 0; j < params.size(); ++j) {
      TORCH_CHECK(!param_requires_grad[j] || grads[k++].defined(), "cgraph: parameter ", j,
                  " (shape ", params[j].sizes(), ")", advice);
    }
  }
  return grads;
}

// Before the backward capture, outside it: grad_store, one regular
// allocation per parameter that requires grad, laid out like the parameter
// (AccumulateGrad's layout contract) on the stream that will read it as
// param.grad.  Those the backward leaves without a grad are released after
// the capture.  Left unfilled (a fill launch per parameter is set-up time):
// every path of Note [Parameter gradients] writes a grad_store before it
// hands it out, and adds into it only once handed out.
void Engine::allocate_grad_store() {
  c10::cuda::CUDAStreamGuard on_caller(*caller_stream);
  for (size_t j = 0; j < params.size(); ++j) {
    if (param_requires_grad[j]) {
      grad_store[j] = at::empty_like(params[j], at::MemoryFormat::Preserve);
    }
  }
}

// During the backward capture, once it has the parameter grads: the two
// tails that turn them into param.grad, recorded as optional segments at the
// end of the backward graph (tail_copy writes grad_store, tail_add adds into
// it; a replay runs at most one).  The grads are temporaries of the graph,
// whose memory later graphs reuse: grad_params keeps non-owning views of
// them, read by the slow path right after a replay.
void Engine::capture_param_grad_tails(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> stores, sources;
  for (size_t j = 0; j < params.size(); ++j) {
    const at::Tensor& g = grads[j];
    if (!g.defined()) {
      continue;  // frozen at capture, or unused (allow_unused_input)
    }
    grad_params[j] = at::from_blob(const_cast<void*>(g.const_data_ptr()), g.sizes(), g.strides(),
                                   [](void*) {}, g.options());
    stores.push_back(grad_store[j]);
    sources.push_back(grad_params[j]);
  }
  num_tail_params = stores.size();
  at::NoGradGuard no_grad;
  tail_copy = bwd->capture_segment([&] { record_tail(false, stores, sources); });
  tail_add = bwd->capture_segment([&] { record_tail(true, stores, sources); });
}

// During the backward capture, before the callable's backward: the ways the
// graph fills the buffer of one incoming grad itself (Note [Incoming grads]):
// a copy of the grad, a broadcast of its one element, or zeros.
Engine::GradIn Engine::capture_grad_in(const at::Tensor& buffer) {
  at::NoGradGuard no_grad;
  GradIn in;
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
// warn (and sync) when a later call's backward reaches them.
void Engine::forget_capture_autograd() {
  for (at::Tensor& o : outputs) {
    o = o.detach();
  }
}

void Engine::reset() noexcept {
  if (!alive) {
    return;
  }
  alive = false;
  restore_grad_accumulators();  // after a failed capture
  try {
    // Tensors first, so the pool's blocks are free when the graphs let go
    // of the pool; then the pool's cached memory goes back to the device.
    inputs.clear();
    params.clear();
    outputs.clear();
    grad_outputs.clear();
    grad_ins.clear();
    grad_inputs.clear();
    grad_params.clear();
    grad_store.clear();
    handed_out.clear();
    buffers.clear();
    buffer_snapshot.clear();
    fwd.reset();
    bwd.reset();
    if (pool.first != 0 || pool.second != 0) {
      empty_pool_cache(pool, 0);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: reset did not complete: ", e.what());
  }
}

Engine::~Engine() {
  reset();
}

}  // namespace cgraph

using cgraph::Engine;

extern "C" {

int cg_cuda_device_count(void) {
  try {
    return static_cast<int>(c10::cuda::device_count());
  } catch (...) {
    return 0;
  }
}

int cg_new_pool(cg_pool* out) {
  HANDLE_TH_ERRORS
  const auto id = at::cuda::graph_pool_handle();
  out->first = id.first;
  out->second = id.second;
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

cg_setup* cg_setup_begin(int device_index) {
  HANDLE_TH_ERRORS
  const auto device = static_cast<c10::DeviceIndex>(device_index);
  c10::cuda::CUDAGuard guard(device);
  {
    // Lazy initialization (cuBLAS handles, cuDNN autotuning) belongs in
    // warm-up, not in a capture; start from an idle device, as torch does.
    cgraph::GilRelease nogil;
    c10::cuda::device_synchronize();
  }
  auto* setup = new cg_setup{device, c10::cuda::getCurrentCUDAStream(device),
                             cgraph::capture_stream(device)};
  c10::cuda::setCurrentCUDAStream(setup->side);
  return setup;
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

int cg_setup_release_warmup_memory(cg_setup* setup) {
  HANDLE_TH_ERRORS
  cgraph::GilRelease nogil;
  setup->side.synchronize();
  cgraph::drop_blas_workspaces(setup->side.stream());  // Note [cuBLAS workspaces during capture]
  c10::cuda::CUDACachingAllocator::emptyCache();
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

void cg_setup_end(cg_setup* setup) {
  if (!setup) {
    return;
  }
  try {
    c10::cuda::setCurrentCUDAStream(setup->caller);
    cgraph::GilRelease nogil;
    setup->side.synchronize();
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: could not wait for the capture stream: ", e.what());
  }
  delete setup;
}

cg_engine* cg_engine_new(PyObject* inputs, PyObject* names, PyObject* params,
                         PyObject* buffers, int allow_unused_input, int guard_outputs) {
  HANDLE_TH_ERRORS
  auto e = std::make_shared<Engine>();
  e->allow_unused = allow_unused_input != 0;
  e->guard_outputs = guard_outputs != 0;
  e->device = c10::cuda::current_device();
  e->inputs = cgraph::unpack_tensors(inputs, "argument");
  for (size_t i = 0; i < e->inputs.size(); ++i) {
    PyObject* name = PySequence_GetItem(names, static_cast<Py_ssize_t>(i));
    const char* utf8 = name ? PyUnicode_AsUTF8(name) : nullptr;
    e->input_names.emplace_back(utf8 ? utf8 : "?");
    Py_XDECREF(name);
    PyErr_Clear();
    const at::Tensor& t = e->inputs[i];
    TORCH_CHECK_VALUE(t.is_cuda(), "cgraph: argument '", e->input_names[i], "' is on ",
                      t.device(), "; a CUDA graph replays CUDA work only. "
                      "Move the sample (and every later argument) to the GPU.");
    e->device = t.device().index();
    e->input_requires_grad.push_back(t.requires_grad());
  }
  e->params = cgraph::unpack_tensors(params, "parameter");
  for (const at::Tensor& p : e->params) {
    e->param_ptrs.push_back(p.const_data_ptr());
    e->param_requires_grad.push_back(p.requires_grad());
  }
  e->caller_stream = c10::cuda::getCurrentCUDAStream(e->device);
  e->set_aside_grad_accumulators();
  e->buffers = cgraph::unpack_tensors(buffers, "buffer");
  for (const at::Tensor& b : e->buffers) {
    e->buffer_snapshot.push_back(b.clone());
  }
  return new cg_engine{std::move(e)};
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

void cg_engine_free(cg_engine* engine) {
  delete engine;  // the last reference resets the engine; reset never throws
}

int cg_engine_warmup_begin(cg_engine* engine) {
  HANDLE_TH_ERRORS
  engine->ptr->rng_warmup_begin();
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_warmup_end(cg_engine* engine, int completed) {
  HANDLE_TH_ERRORS
  Engine& e = *engine->ptr;
  if (!completed) {
    e.rng_capture_end();  // leaves the RNG hooks; keeps the caller's exception
    return 0;
  }
  e.rng_warmup_end();
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_warmup_backward(cg_engine* engine, PyObject* outputs) {
  HANDLE_TH_ERRORS
  Engine& e = *engine->ptr;
  std::vector<at::Tensor> diff, grads;
  for (const at::Tensor& o : cgraph::unpack_tensors(outputs, "output")) {
    if (o.requires_grad()) {
      diff.push_back(o);
      grads.push_back(at::empty_like(o));
    }
  }
  if (diff.empty()) {
    return 0;
  }
  e.adopt_hidden_leaves(diff);
  if (!e.grad_targets().empty()) {
    e.run_backward(diff, grads);
  }
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_capture_begin(cg_engine* engine, cg_pass pass, cg_pool pool,
                            cg_capture_mode mode) {
  HANDLE_TH_ERRORS
  Engine& e = *engine->ptr;
  e.pool = {pool.first, pool.second};
  e.autocast_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
  e.autocast_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  cgraph::Graph& g = cgraph::graph_of(e, pass);
  e.rng_capture_begin(pass);
  try {
    g.capture_begin(e.pool, cgraph::to_cuda_mode(mode));
  } catch (...) {
    e.rng_capture_end();
    throw;
  }
  try {
    // Note [Argument copies inside the graph]
    for (size_t i = 0; pass == CG_FORWARD && i < e.inputs.size(); ++i) {
      g.capture_copy_in(e.inputs[i]);
    }
  } catch (...) {
    cgraph::abandon_capture(e, g);
    throw;
  }
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_capture_end(cg_engine* engine, cg_pass pass) {
  HANDLE_TH_ERRORS
  Engine& e = *engine->ptr;
  cgraph::end_capture(e, cgraph::graph_of(e, pass));
  if (pass == CG_FORWARD) {
    e.check_rng_regions_entered();
  }
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

void cg_engine_capture_abort(cg_engine* engine, cg_pass pass) {
  // Keep the callable's exception: abandon() may call into torch, which
  // could set (and must not clobber) Python's error indicator.
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  Engine& e = *engine->ptr;
  cgraph::abandon_capture(e, cgraph::graph_of(e, pass));
  PyErr_Restore(type, value, traceback);
}

int cg_engine_set_outputs(cg_engine* engine, PyObject* outputs) {
  HANDLE_TH_ERRORS
  Engine& e = *engine->ptr;
  e.outputs = cgraph::unpack_tensors(outputs, "output");
  e.output_requires_grad.clear();
  for (size_t k = 0; k < e.outputs.size(); ++k) {
    const at::Tensor& o = e.outputs[k];
    TORCH_CHECK_VALUE(o.is_cuda(), "cgraph: output ", k, " of the callable is on ", o.device(),
                      ". A graph's outputs live in its CUDA memory, and a copy to the host "
                      "inside a graph is replayed without a sync the caller could wait on: "
                      "return the CUDA tensor and call .cpu() after the graphed call.");
    e.output_requires_grad.push_back(o.requires_grad());
  }
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_capture_backward(cg_engine* engine, cg_pool pool,
                               cg_capture_mode mode) {
  HANDLE_TH_ERRORS
  Engine& e = *engine->ptr;
  std::vector<at::Tensor> diff;
  for (size_t k = 0; k < e.outputs.size(); ++k) {
    if (e.output_requires_grad[k]) {
      diff.push_back(e.outputs[k]);
    }
  }
  e.adopt_hidden_leaves(diff);
  e.grad_outputs.assign(e.outputs.size(), at::Tensor());
  e.grad_inputs.assign(e.inputs.size(), at::Tensor());
  e.grad_params.assign(e.params.size(), at::Tensor());
  e.grad_store.assign(e.params.size(), at::Tensor());
  const auto wrt = e.grad_targets();
  if (diff.empty() || wrt.empty()) {
    e.has_bwd = false;
    e.forget_capture_autograd();
    return 0;
  }

  cgraph::Graph& g = *e.bwd;
  e.allocate_grad_store();
  e.rng_capture_begin(CG_BACKWARD);
  try {
    g.capture_begin({pool.first, pool.second}, cgraph::to_cuda_mode(mode));
  } catch (...) {
    e.rng_capture_end();
    throw;
  }
  std::vector<at::Tensor> grads;
  try {
    // Allocated inside the capture, so they live in the graph pool and
    // reset() returns them with it.
    std::vector<at::Tensor> grad_outputs;
    e.grad_ins.clear();
    for (size_t k = 0; k < e.outputs.size(); ++k) {
      if (e.output_requires_grad[k]) {
        e.grad_outputs[k] = at::empty_like(e.outputs[k]);
        grad_outputs.push_back(e.grad_outputs[k]);
        e.grad_ins.push_back(e.capture_grad_in(e.grad_outputs[k]));
      }
    }
    grads = e.run_backward(diff, grad_outputs);
    size_t next = 0;
    for (size_t i = 0; i < e.inputs.size(); ++i) {
      if (e.input_requires_grad[i]) {
        e.grad_inputs[i] = grads[next++];
      }
    }
    std::vector<at::Tensor> param_grads(e.params.size());
    for (size_t j = 0; j < e.params.size(); ++j) {
      if (e.param_requires_grad[j]) {
        param_grads[j] = grads[next++];
      }
    }
    e.capture_param_grad_tails(param_grads);
  } catch (...) {
    cgraph::abandon_capture(e, g);
    throw;
  }
  cgraph::end_capture(e, g);
  for (size_t j = 0; j < e.params.size(); ++j) {
    if (!e.grad_params[j].defined()) {
      e.grad_store[j] = at::Tensor();  // no grad flows to it
    }
  }
  e.has_bwd = true;
  e.forget_capture_autograd();
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_restore_buffers(cg_engine* engine) {
  HANDLE_TH_ERRORS
  Engine& e = *engine->ptr;
  e.restore_grad_accumulators();
  for (size_t i = 0; i < e.buffers.size(); ++i) {
    e.buffers[i].copy_(e.buffer_snapshot[i]);
  }
  e.buffer_snapshot.clear();
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

void cg_engine_reset(cg_engine* engine) {
  engine->ptr->reset();
}

cg_pool cg_engine_pool(const cg_engine* engine) {
  const auto& pool = engine->ptr->pool;
  return cg_pool{pool.first, pool.second};
}

Py_ssize_t cg_engine_num_inputs(const cg_engine* engine) {
  return static_cast<Py_ssize_t>(engine->ptr->inputs.size());
}

Py_ssize_t cg_engine_num_params(const cg_engine* engine) {
  return static_cast<Py_ssize_t>(engine->ptr->params.size());
}

cg_stats cg_engine_stats(const cg_engine* engine) {
  return engine->ptr->stats;
}

}  // extern "C"
