// aten_warmup.cpp -- the second place of the lifecycle: eager warm-up calls
// and their backwards, and the backward that warm-up and capture share.
#include "aten_engine.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <iterator>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace cgraph {

std::vector<at::Tensor> autograd_leaves(const std::vector<at::Tensor>& roots) {
  using torch::autograd::AccumulateGrad;
  using torch::autograd::Node;
  std::vector<at::Tensor> leaves;
  std::vector<Node*> stack;
  std::unordered_set<const Node*> seen;
  for (const at::Tensor& t : roots) {
    if (t.defined() && t.grad_fn()) {
      stack.push_back(t.grad_fn().get());
    }
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) {
      continue;
    }
    if (auto* acc = dynamic_cast<AccumulateGrad*>(node)) {
      if (acc->variable.defined()) {
        leaves.push_back(acc->variable);
      }
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.is_valid()) {
        stack.push_back(edge.function.get());
      }
    }
  }
  return leaves;
}

// Leaves that require grad and that the forward reads, but that are neither
// inputs nor module parameters (a tensor captured in a closure, a parameter
// of another module).  torch's make_graphed_callables silently drops their
// grads; cgraph treats them as parameters, their accumulators and hooks set
// aside from now to the end of capture as the parameters' are (Note [Grad
// accumulators during capture], aten_setup.cpp): else a post-accumulate-grad
// hook stepping an optimizer (the optimizer-in-backward pattern) stepped at
// warm-up and was captured into the backward graph.  Inputs are leaves
// (cgraph/_api.py _static_input), so the walk stops at them.
void Engine::adopt_hidden_leaves(const std::vector<at::Tensor>& outs) {
  std::unordered_set<const c10::TensorImpl*> known;
  for (const Input& in : inputs) {
    known.insert(in.buffer.unsafeGetTensorImpl());
  }
  for (const Param& p : params) {
    known.insert(p.tensor.unsafeGetTensorImpl());
  }
  std::vector<Param> adopted;
  for (const at::Tensor& leaf : autograd_leaves(outs)) {
    if (known.insert(leaf.unsafeGetTensorImpl()).second) {
      Param param;
      param.tensor = leaf;
      param.data = leaf.const_data_ptr();
      param.requires_grad = leaf.requires_grad();
      adopted.push_back(std::move(param));
    }
  }
  TORCH_INTERNAL_ASSERT(setup, "cgraph: leaves adopted after the set-up ended");
  setup->set_aside_grad_accumulators(adopted);
  params.insert(params.end(), std::make_move_iterator(adopted.begin()),
                std::make_move_iterator(adopted.end()));
}

namespace {

// Note [A CUDA context on autograd's thread]
// Q: Why does warm-up hook the nodes its backward starts from?
// A: A backward runs on autograd's device thread, which torch starts without
//    making the device's primary CUDA context current there: for device 0,
//    c10::cuda::SetDevice skips cudaSetDevice because the thread's device
//    index already matches (pytorch issue 195256).  The thread's first
//    cuBLAS call then warns "Attempting to run cuBLAS, but there was no
//    current CUDA context! Attempting to set the primary context..." and
//    sets it itself.  In a warm-up backward that first call is often a GEMM
//    (a Linear's weight grad), so every script that graphed a Linear
//    printed that warning (torch's make_graphed_callables does too).  This
//    pre-hook makes the context current on the thread that runs the node,
//    once per thread, before the node's first kernel.
struct CurrentContextHook : torch::autograd::FunctionPreHook {
  explicit CurrentContextHook(c10::DeviceIndex device) : device(device) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& grads) override {
    thread_local bool current = false;
    if (!current) {
      C10_CUDA_CHECK(c10::cuda::SetDevice(device, /*force=*/true));
      current = true;
    }
    return grads;
  }
  c10::DeviceIndex device;
};

// Names the handle of the thread that runs the node, for the stream
// `caller`: Note [Naming a thread's cuBLAS handle] (aten_workspace.cpp).
struct NameBlasHandleHook : torch::autograd::FunctionPreHook {
  NameBlasHandleHook(c10::DeviceIndex device, c10::cuda::CUDAStream caller, void** handle)
      : device(device), caller(caller), handle(handle) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& grads) override {
    C10_CUDA_CHECK(c10::cuda::SetDevice(device, /*force=*/true));  // as CurrentContextHook
    c10::cuda::CUDAStreamGuard on_caller(caller);
    *handle = blas_handle_of_this_thread();
    return grads;
  }
  c10::DeviceIndex device;
  c10::cuda::CUDAStream caller;
  void** handle;
};

}  // namespace

void Engine::warmup_backward(const std::vector<at::Tensor>& outs) {
  std::vector<at::Tensor> diff, grads;
  for (const at::Tensor& o : outs) {
    if (o.requires_grad()) {
      diff.push_back(o);
      grads.push_back(at::empty_like(o));
    }
  }
  if (diff.empty()) {
    return;
  }
  for (const at::Tensor& o : diff) {
    if (const auto& fn = o.grad_fn()) {
      fn->add_pre_hook(std::make_unique<CurrentContextHook>(device));
    }
  }
  adopt_hidden_leaves(diff);
  if (!grad_targets().empty()) {
    run_backward(diff, grads);
  }
}

void* autograd_thread_blas_handle(const c10::cuda::CUDAStream& caller) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, void*> named;  // the threads live on
  const c10::DeviceIndex device = caller.device_index();
  GilRelease nogil;  // first: a thread waiting for the lock must not hold the GIL
  std::lock_guard<std::mutex> lock(mutex);
  void*& handle = named[device];
  if (handle == nullptr) {
    c10::InferenceMode not_inference(false);
    at::AutoGradMode grad(true);
    c10::cuda::CUDAStreamGuard on_caller(caller);
    const at::Tensor leaf = at::zeros({1}, at::device({at::kCUDA, device})).requires_grad_();
    const at::Tensor out = leaf * 2;
    out.grad_fn()->add_pre_hook(std::make_unique<NameBlasHandleHook>(device, caller, &handle));
    torch::autograd::backward({out}, {at::ones_like(out)});
  }
  return handle;
}

// What the backward graph differentiates with respect to, in order: inputs
// that required grad at capture, then parameters that did.
std::vector<at::Tensor> Engine::grad_targets() const {
  std::vector<at::Tensor> wrt;
  for (const Input& in : inputs) {
    if (in.requires_grad) {
      wrt.push_back(in.buffer);
    }
  }
  for (const Param& p : params) {
    if (p.requires_grad) {
      wrt.push_back(p.tensor);
    }
  }
  return wrt;
}

namespace {

// Note [Backward capture runs .backward()]
// Q: Why not torch.autograd.grad(outputs, inputs), as torch does?
// A: A backward that names the tensors it wants grads for (autograd.grad,
//    or .backward(inputs=...)) refuses torch.utils.checkpoint with
//    use_reentrant=True, whose backward re-enters autograd with a plain
//    .backward() (as Megatron's and DeepSpeed's checkpointing do).  So the
//    warm-up and the capture run a plain .backward(), as the training loop
//    would, and collect the grads where AccumulateGrad leaves them: in the
//    .grad of the static inputs and parameters, each set aside before and
//    put back after (GradsAside).  The static inputs are leaves
//    (cgraph/_api.py detaches a sample that has autograd history), so
//    backward stops at them.  A leaf the forward reads outside its
//    parameters is found by adopt_hidden_leaves(), except one read only
//    inside a reentrant region: its history is built by the recompute,
//    during backward, out of sight (cgraph/_capture.py refuses it).
class GradsAside {
 public:
  explicit GradsAside(std::vector<at::Tensor> wrt)
      : wrt_(std::move(wrt)), first_(wrt_.size()), saved_(wrt_.size()) {
    // A tensor both argument and parameter appears twice: one slot per tensor.
    std::unordered_map<const c10::TensorImpl*, size_t> seen;
    for (size_t k = 0; k < wrt_.size(); ++k) {
      first_[k] = seen.emplace(wrt_[k].unsafeGetTensorImpl(), k).first->second;
      if (first_[k] == k) {
        saved_[k] = std::exchange(wrt_[k].mutable_grad(), at::Tensor());
      }
    }
  }
  ~GradsAside() {
    if (!done_) {
      put_back();
    }
  }
  GradsAside(const GradsAside&) = delete;
  GradsAside& operator=(const GradsAside&) = delete;

  // Puts every .grad back.  Returns what backward left there, in wrt's
  // order: undefined where no grad flowed.
  std::vector<at::Tensor> put_back() {
    done_ = true;
    std::vector<at::Tensor> grads(wrt_.size());
    for (size_t k = 0; k < wrt_.size(); ++k) {
      grads[k] = first_[k] == k ? std::exchange(wrt_[k].mutable_grad(), std::move(saved_[k]))
                                : grads[first_[k]];
    }
    return grads;
  }

 private:
  std::vector<at::Tensor> wrt_;
  std::vector<size_t> first_;  // per entry: the first entry of the same tensor
  std::vector<at::Tensor> saved_;
  bool done_ = false;
};

}  // namespace

// Returns the grads of grad_targets(), in order; undefined where none flowed.
std::vector<at::Tensor> Engine::run_backward(const std::vector<at::Tensor>& outs,
                                             const std::vector<at::Tensor>& grad_outs,
                                             bool retain_graph) {
  TORCH_INTERNAL_ASSERT(setup, "cgraph: a set-up backward after the set-up ended");
  setup->hold_hooks_added_meanwhile();
  GradsAside aside(grad_targets());
  {
    GilRelease nogil;
    torch::autograd::backward(outs, grad_outs, retain_graph, /*create_graph=*/false);
  }
  std::vector<at::Tensor> grads = aside.put_back();
  if (allow_unused) {
    return grads;
  }
  const char* advice = " requires grad, but the callable's outputs do not depend on it "
                       "(differentiably). Pass allow_unused_input=True to accept that, as "
                       "with torch's make_graphed_callables, or set requires_grad=False.";
  size_t k = 0;
  for (const Input& in : inputs) {
    TORCH_CHECK(!in.requires_grad || grads[k++].defined(), "cgraph: argument '", in.name, "'",
                advice);
  }
  for (size_t j = 0; j < params.size(); ++j) {
    TORCH_CHECK(!params[j].requires_grad || grads[k++].defined(), "cgraph: parameter ", j,
                " (shape ", params[j].tensor.sizes(), ")", advice);
  }
  return grads;
}

}  // namespace cgraph
