// aten_capture.cpp -- the third place of the lifecycle: recording a graph,
// and ending or abandoning the recording; the forward's static outputs.
// The backward graph's capture is in aten_capture_backward.cpp.
#include "aten_engine.hpp"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>

namespace cgraph {

Refusal::Refusal(cg_failure kind, const std::string& message)
    : c10::Error(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                 message),
      kind(kind) {}

Autocast Autocast::current() {
  Autocast now;
  now.enabled = at::autocast::is_autocast_enabled(at::kCUDA);
  if (now.enabled) {
    now.dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  }
  return now;
}

std::string Autocast::describe() const {
  return enabled ? std::string("enabled (dtype ") + c10::toString(dtype) + ")" : "disabled";
}

// Starts recording `pass` into `pool_id`.  A forward starts with one copy-in
// slot per static input: Note [Argument copies inside the graph].
void Engine::capture_begin(cg_pass pass, at::cuda::MempoolId_t pool_id,
                           cudaStreamCaptureMode mode) {
  pool = pool_id;
  note_capture(pass);  // Note [Captures that share a pool] (aten_pool.cpp)
  if (pass == CG_FORWARD && member.keeps_activations()) {  // only cgraph/_group.py reads in place
    note_inputs_in_place();
  }
  blas_workspace = live_blas_workspace(caller_stream);  // Note [One cuBLAS workspace per stream]
  if (pass == CG_FORWARD) {
    autocast = Autocast::current();
    grad_mode = at::GradMode::is_enabled();
    inference_statics = c10::InferenceMode::is_enabled() ||
                        std::any_of(inputs.begin(), inputs.end(),
                                    [](const Input& in) { return in.buffer.is_inference(); });
    // Where the graph reads them: a warm-up's move may have given one new
    // memory (Note [Warm-up in the pool], aten_setup.cpp).
    for (Param& p : params) {
      p.data = p.tensor.const_data_ptr();
    }
  }
  Graph& g = graph(pass);
  rng.capture_begin(graph(pass), pass);
  try {
    g.capture_begin(pool, mode);
  } catch (...) {
    rng.capture_end();
    throw;
  }
  try {
    for (Input& in : inputs) {
      if (pass == CG_FORWARD) {
        in.copy = g.capture_copy_in(in.buffer);  // a raw memcpy: no version bump
        // An inference tensor has no version counter: its writes go unseen.
        in.version = in.buffer.is_inference() ? 0 : in.buffer._version();
      }
    }
  } catch (...) {
    abandon_capture(pass);
    throw;
  }
}

// Ends a recording that succeeded, abandoning it if ending fails, and checks
// that the callable left the host's generators alone and, in a forward, met
// every checkpointed region warm-up met.
void Engine::capture_end(cg_pass pass) {
  try {
    graph(pass).capture_end();
  } catch (...) {
    abandon_capture(pass);
    throw;
  }
  rng.capture_end();
  rng.check_host_untouched();
  if (pass == CG_FORWARD) {
    rng.check_regions_entered();
    for (Input& in : inputs) {  // Note [Arguments written in place] (aten_replay.cpp)
      in.written = !in.in_place && !in.buffer.is_inference() &&
                   in.buffer._version() != in.version;
    }
  }
}

void Engine::abandon_capture(cg_pass pass) noexcept {
  rng.capture_end();  // first: abandon() may repair the default generator
  graph(pass).abandon();
}

namespace {

// The node of a capture view (Engine::capture_inputs): the view's grad is
// the sample's, passed on as it is.
struct CaptureViewBackward final : torch::autograd::Node {
  explicit CaptureViewBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    return std::move(grads);
  }
  std::string name() const override { return "cgraph::CaptureViewBackward"; }
};

}  // namespace

// Note [An output freed once its reader has captured] (aten_pool.cpp): the
// forward capture of a callable reading an input in place calls it with a
// view of that memory made for this capture alone (a storage of its own, a
// grad that flows on to the sample), held weakly by the engine, so that
// whether anything kept the argument shows as the backward capture starts
// (note_capture_views_kept).  The warm-up calls passed the sample itself;
// the spec keeps it.
std::vector<at::Tensor> Engine::capture_inputs() {
  std::vector<at::Tensor> args;
  if (std::none_of(inputs.begin(), inputs.end(), [](const Input& in) { return in.in_place; })) {
    return args;
  }
  for (Input& in : inputs) {
    if (!in.in_place) {
      args.push_back(in.buffer);
      continue;
    }
    at::Tensor view = non_owning_view(in.buffer);
    if (in.buffer.requires_grad() && at::GradMode::is_enabled()) {  // else no grad flows
      const NodePtr node = make_node<CaptureViewBackward>(
          torch::autograd::edge_list{torch::autograd::impl::gradient_edge(in.buffer)});
      torch::autograd::set_history(view, node);
    }
    in.capture_view = view.storage().getWeakStorageImpl();
    args.push_back(std::move(view));
  }
  return args;
}

// As the backward capture starts: whether the forward capture kept each
// capture view.  Not later: a backward may drop what it read (a Function
// clearing a ctx attribute), while its graph reads that memory at every
// replay.
void Engine::note_capture_views_kept() {
  for (Input& in : inputs) {
    if (in.capture_view) {
      in.kept_by_capture = !in.capture_view->expired();
      in.capture_view.reset();
    }
  }
}

void Engine::set_outputs(std::vector<at::Tensor> outs) {
  outputs.clear();
  for (size_t k = 0; k < outs.size(); ++k) {
    TORCH_CHECK_VALUE(outs[k].is_cuda(), "cgraph: output ", k, " of the callable is on ",
                      outs[k].device(), ". A graph's outputs live in its CUDA memory, and a "
                      "copy to the host inside a graph is replayed without a sync the caller "
                      "could wait on: return the CUDA tensor and call .cpu() after the graphed "
                      "call.");
    Output out;
    out.requires_grad = outs[k].requires_grad();
    out.buffer = std::move(outs[k]);
    outputs.push_back(std::move(out));
  }
}

}  // namespace cgraph
