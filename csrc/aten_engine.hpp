// aten_engine.hpp -- the C++ half's shared definitions.  Internal: only
// csrc/aten_*.cpp include it; the C half sees cgraph.h alone.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <Python.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cgraph.h"

namespace cgraph {

// torch 2.14 made autograd nodes intrusive_ptr-owned; earlier releases use
// shared_ptr.  Take whichever this torch's Edge holds, so nothing below names
// a torch version.
using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);

template <class T, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// Releases the GIL for the lifetime of the object.  Used around calls that
// wait on the autograd engine, whose worker threads may need the GIL to run
// Python backward code (custom Functions, hooks).
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease() { PyEval_RestoreThread(state_); }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

// A CUDAGraph that can abandon a failed capture.
//
// Note [Abandoning a capture]
// Q: Why not just call capture_end() and reset() when the callable raises?
// A: When the capture was invalidated (a sync such as .item() inside the
//    callable), capture_end() throws from cudaStreamEndCapture before it
//    tells the caching allocator to stop routing the stream's allocations to
//    the graph pool.  Some torch releases then leave the allocator routing
//    forever and the pool's use count raised, so the process leaks the pool
//    and later allocations on that stream land in a dead pool.  Releases that
//    track this themselves (a `capturing_to_pool_` member) clean up in
//    reset().  abandon() ends the stream capture, then does the allocator's
//    part only where this torch's reset() will not.
class Graph : public at::cuda::CUDAGraph {
 public:
  // The graph keeps its cudaGraph_t: its nodes are what each replay
  // switches on and off (aten_graph_nodes.cpp).
  Graph() : at::cuda::CUDAGraph(/*keep_graph=*/true) {}

  // torch's, with the capture stream's cuBLAS workspaces made temporaries
  // of this graph: Note [cuBLAS workspaces during capture].  capture_end()
  // also instantiates a graph that keeps its cudaGraph_t.
  void capture_begin(at::cuda::MempoolId_t pool, cudaStreamCaptureMode mode);
  void capture_end();
  void abandon() noexcept;

  // During capture, before the callable's first operation: a copy-in slot
  // writing `dst`.  Returns its number.
  size_t capture_copy_in(const at::Tensor& dst);
  // Before a replay: the graph copies `src` into `dst` (slot k's buffer)
  // itself.  False when it cannot (a layout a memcpy cannot copy, or the
  // driver refused): the slot is then off and the caller copies.
  bool copy_in(size_t k, const at::Tensor& dst, const at::Tensor& src);
  // The same for raw memory: slot k's buffer's size in bytes from `src`.
  bool copy_in_from(size_t k, const void* src);
  // Before a replay: slot k copies nothing this time.
  void skip_copy_in(size_t k);

  // During capture: runs `record` and makes the nodes it records an optional
  // segment, number segments_.size().  Every replay must say whether it runs
  // (set_segment).  Only kernel, memcpy and memset nodes can be switched:
  // anything else raises.
  size_t capture_segment(const std::function<void()>& record);
  // Before a replay: whether segment s runs this time.
  void set_segment(size_t s, bool enabled);

  // Replays the graph on the current stream: torch's replay() without its
  // ATen calls.  See Note [Seeding random numbers inside the graph].
  void launch();

  // What the captured graph is made of (aten_inspect.cpp); false if it was
  // not captured (or was reset).
  bool shape(cg_graph_shape* out) const;

 private:
  static void finish_generator_capture() noexcept;
  // At capture end, before instantiation: the nodes that write the seeds and
  // offsets the graph's random ops read.
  void capture_rng_seeds();

  // One generator state the graph draws from: four memset nodes ahead of
  // the graph's roots write its seed and base offset, as 32-bit halves.
  struct RngSeed {
    c10::intrusive_ptr<at::CUDAGeneratorState> state;
    uint64_t increment = 0;  // how far one replay moves the state's offset
    cudaGraphNode_t nodes[4] = {};       // seed low, seed high, offset low, offset high
    cudaMemsetParams params[4] = {};     // as the executable graph holds them now
  };
  std::vector<RngSeed> rng_seeds_;
  // False when this torch keeps a graph's seed and offset where cgraph does
  // not know to look: launch() then leaves them to torch's replay().
  bool seeds_in_graph_ = true;

  struct CopyIn {
    cudaGraphNode_t node = nullptr;  // nullptr: this slot always falls back
    void* dst = nullptr;
    size_t bytes = 0;
    const void* src = nullptr;  // what the executable node copies from now
    bool enabled = true;        // as instantiated
  };
  std::vector<CopyIn> copy_ins_;

  struct Segment {
    std::vector<cudaGraphNode_t> nodes;
    bool enabled = true;  // as instantiated
  };
  std::vector<Segment> segments_;

  template <class G>
  static auto reset_ends_pool_routing(G& g, int)
      -> decltype(g.capturing_to_pool_, bool()) {
    return true;
  }
  template <class G>
  static bool reset_ends_pool_routing(G&, long) {
    return false;
  }
};

// Where the engine is in warm-up and capture, for the RNG hooks of
// Note [RNG in checkpointed regions] (aten_rng.cpp).
enum class RngPhase { Off, Warmup, Forward, Backward };

// One graphed callable.  Shared between the C half (through cg_engine) and
// every backward node still pending, so a live autograd graph keeps the
// buffers its backward replay needs.
struct Engine {
  ~Engine();
  void reset() noexcept;

  // -- identity
  c10::DeviceIndex device = 0;
  at::cuda::MempoolId_t pool{0, 0};
  bool allow_unused = false;
  bool alive = true;  // false after reset(): replays and backwards raise

  // -- graphs
  // Both start with copies of their arguments (inputs; incoming grads).
  std::unique_ptr<Graph> fwd = std::make_unique<Graph>();
  std::unique_ptr<Graph> bwd = std::make_unique<Graph>();
  bool has_bwd = false;  // false when no output requires grad
  // bwd begins with the incoming grads' ways in (grad_ins), and ends with
  // two optional segments, the parameter-grad tails: grad_store = grads, or
  // grad_store += grads.  See Note [Parameter gradients].
  size_t tail_copy = 0;        // segment numbers
  size_t tail_add = 0;
  size_t num_tail_params = 0;  // parameters the tails cover (those with a grad)

  // -- what the forward graph reads
  std::vector<at::Tensor> inputs;  // the sample tensors, as in torch
  std::vector<std::string> input_names;
  std::vector<char> input_requires_grad;  // at capture
  // Module parameters, then any other leaf requiring grad that the forward
  // reads (a tensor in a closure); see adopt_hidden_leaves().
  std::vector<at::Tensor> params;
  std::vector<const void*> param_ptrs;  // at capture: a moved one is stale
  std::vector<char> param_requires_grad;  // at capture

  // -- what the forward graph writes
  std::vector<at::Tensor> outputs;
  std::vector<char> output_requires_grad;

  // -- what the backward graph reads and writes
  std::vector<at::Tensor> grad_outputs;  // undefined where no grad flows
  // Per output that requires grad, in order: the ways the backward graph
  // fills its grad_outputs buffer itself.  See Note [Incoming grads].
  struct GradIn {
    size_t copy = 0;       // copy-in slot: the grad, when a memcpy copies it
    size_t element = 0;    // copy-in slot: `scalar` = the grad's one element ...
    size_t broadcast = 0;  // ... and this segment: buffer = scalar, everywhere
    size_t zero = 0;       // segment: buffer = 0, when no grad flowed
    at::Tensor scalar;     // one element, in the graph pool
  };
  std::vector<GradIn> grad_ins;
  std::vector<at::Tensor> grad_inputs;   // aligned with inputs
  // Aligned with params.  NON-OWNING views of the backward graph's
  // temporaries: their memory is the pool's, reused by later graphs, so they
  // hold the grads only between bwd's replay and the next graph's.
  std::vector<at::Tensor> grad_params;
  // Aligned with params: the tensors the tails write and that are handed
  // out as param.grad.  Regular allocations, so they outlive reset().
  std::vector<at::Tensor> grad_store;
  // The stream current when the callable was graphed: grad_store lives
  // there, beside the optimizer's state, not on the capture stream.
  std::optional<c10::cuda::CUDAStream> caller_stream;

  // -- the parameters' own grad accumulators, set aside from engine creation
  //    to the end of capture: see Note [Grad accumulators during capture]
  using WeakNodePtr = decltype(torch::autograd::AutogradMeta::grad_accumulator_);
  std::vector<WeakNodePtr> accumulators_aside;
  using PostAccHookPtr = std::unique_ptr<torch::autograd::PostAccumulateGradHook>;
  std::vector<PostAccHookPtr> post_acc_hooks_aside;  // likewise: they run at replay
  void set_aside_grad_accumulators();
  void restore_grad_accumulators() noexcept;

  // -- module state that warm-up changes
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> buffer_snapshot;

  // -- random numbers: see Note [RNG in checkpointed regions]
  struct RngSnapshot {
    at::Tensor cpu_state;
    uint64_t cuda_seed = 0;
    uint64_t cuda_offset = 0;
  };
  struct {
    RngPhase phase = RngPhase::Off;
    uint64_t warmup_start = 0;
    std::vector<uint64_t> warmup_offsets;   // this warm-up call's, so far
    std::vector<uint64_t> entry_offsets;    // per region: where eager mode is at its start
    uint64_t forward_increment = 0;         // how far one eager forward moves the stream
    std::vector<c10::intrusive_ptr<at::CUDAGeneratorState>> states;  // per region
    std::vector<at::Generator> generators;  // per region, over states[k]
    at::Generator default_state;            // the default generator's own, during capture
    size_t entered = 0;                     // regions entered so far in the forward capture
    std::vector<std::pair<at::Tensor, at::Generator>> tokens;  // handed out as RNG states
    RngSnapshot host_before;                // host generators before this capture
    uint64_t replay_seed = 0;               // the latest forward replay's seed and base
    uint64_t replay_base = 0;
  } rng;
  RngSnapshot host_rng_snapshot() const;
  void check_host_rng_untouched(const RngSnapshot& before) const;
  void rng_warmup_begin();
  void rng_warmup_end();
  void check_rng_regions_entered() const;
  void rng_capture_begin(cg_pass pass);
  void rng_capture_end() noexcept;
  void rng_before_forward_replay();
  void rng_after_forward_replay();
  void rng_before_backward_replay();

  // -- outputs handed to the caller: see Note [Outputs of earlier calls]
  bool guard_outputs = true;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> handed_out;  // latest call's
  // The autocast state at capture: the graph replays the casts it recorded.
  bool autocast_enabled = false;
  at::ScalarType autocast_dtype = at::kHalf;

  // -- replay bookkeeping
  // Forward replays so far.  A backward replay is valid only for the latest
  // forward: an earlier call's activations have been overwritten.
  uint64_t generation = 0;
  cg_stats stats{};  // how often each path ran, for introspection and tests

  void adopt_hidden_leaves(const std::vector<at::Tensor>& outs);
  void allocate_grad_store();
  void capture_param_grad_tails(const std::vector<at::Tensor>& grads);
  GradIn capture_grad_in(const at::Tensor& buffer);
  void forget_capture_autograd();
  std::vector<at::Tensor> grad_targets() const;
  std::vector<at::Tensor> run_backward(const std::vector<at::Tensor>& outs,
                                       const std::vector<at::Tensor>& grad_outs);
};

// Whether a memcpy of dst.nbytes() bytes from src's first element copies
// `src` into `dst` element for element (aten_graph_nodes.cpp).
bool memcpy_copies(const at::Tensor& dst, const at::Tensor& src);

}  // namespace cgraph

struct cg_engine {
  std::shared_ptr<cgraph::Engine> ptr;
};

struct cg_setup {
  c10::DeviceIndex device;
  c10::cuda::CUDAStream caller;
  c10::cuda::CUDAStream side;
};
