// aten_graph_nodes.cpp -- the nodes of a captured graph that each replay
// sets: copies of the call's arguments into the static buffers, done by the
// graph itself; optional segments (the parameter-grad tails of Note
// [Parameter gradients]); and the seeds of its random ops.  Then the launch.
//
// Note [Argument copies inside the graph]
// Q: A graph reads its inputs from static buffers, so a call whose argument
//    lives elsewhere needs a copy first.  Why not just copy_() before the
//    replay, as torch does?
// A: On the replay path that copy is the most expensive thing cgraph does:
//    ATen's dispatch and TensorIterator, then a separate cudaMemcpyAsync, for
//    every argument of every call and every incoming grad of every backward:
//    on an H100 host, about as much host time as the graph launch and the
//    autograd node together.  Layer-by-layer graphing pays it twice per layer.
//    So the forward and backward graphs begin with one memcpy node per static
//    buffer, captured as a self-copy of the buffer.  Before each replay, a
//    slot whose argument is elsewhere gets that argument's address
//    (cudaGraphExecMemcpyNodeSetParams1D, host-side only, and only when the
//    address changed since the last call) and is enabled; a slot whose
//    argument is the buffer itself is disabled (cudaGraphNodeSetEnabled).
//    Every replay sets every slot, so a node never copies from a stale
//    address (and none is switched at capture: the first replay moves each
//    from the state it was instantiated in, a self-copy).  The copy then
//    runs inside the launch, ordered before every kernel that reads the
//    buffer, on the caller's stream as copy_() would.
//    Arguments a memcpy cannot copy byte for byte (another layout, a view
//    overlapping the buffer, memory the driver will not take) are copied by
//    ATen before the replay, as before, with their slot disabled.
//
// Note [Seeding random numbers inside the graph]
// Q: Why does cgraph launch its graphs itself rather than call torch's
//    CUDAGraph::replay()?
// A: A captured random op (dropout) reads its Philox seed and base offset
//    from two one-element device tensors, and before every launch of a graph
//    that draws random numbers, torch's replay() fills both with ATen fill_:
//    two dispatches and two kernel launches, about 14 us of host time on the
//    hosts measured, more than the launch itself, paid by the forward and the
//    backward of every dropout layer.  cgraph writes them from inside the
//    graph instead: at capture end, before instantiation, four memset nodes
//    per generator state (each 64-bit value as two 32-bit halves, the widest
//    element a memset writes) go ahead of the graph's roots, in one chain
//    (parallel roots cost the GPU more).  launch() then
//    does what torch's replay prologue does (read the state's seed and
//    offset, move the offset on by the graph's whole increment) and hands
//    each memset node whose value changed its new value
//    (cudaGraphExecMemsetNodeSetParams, host-side: the offset's low half
//    every replay, the rest when it changes).  The values are those torch
//    would write, so the random streams are bitwise torch's, and eager
//    mode's.  Where the two tensors live is torch internals (one pair per
//    generator state up to torch 2.11, one per state and capture since): a
//    torch where cgraph finds neither keeps torch's replay().
#include "aten_graph.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <mutex>

namespace cgraph {

cudaGraph_t capturing_graph(cudaStream_t stream) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph = nullptr;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, nullptr, nullptr,
                                          nullptr));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v2(stream, &status, nullptr, &graph, nullptr, nullptr));
#endif
  TORCH_CHECK(status == cudaStreamCaptureStatusActive && graph != nullptr,
              "cgraph: internal error: no capture is active on the current stream.");
  return graph;
}

namespace {

// The node the capture recorded last on `stream`: the one that the next
// node would depend on.  nullptr if it is not a single node.
cudaGraphNode_t last_captured_node(cudaStream_t stream) {
  cudaStreamCaptureStatus status;
  const cudaGraphNode_t* deps = nullptr;
  size_t count = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr,
                                          &count));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v2(stream, &status, nullptr, nullptr, &deps, &count));
#endif
  return status == cudaStreamCaptureStatusActive && count == 1 ? deps[0] : nullptr;
}

// The nodes recorded so far into the graph `stream` is capturing.
std::vector<cudaGraphNode_t> captured_nodes(cudaStream_t stream) {
  cudaGraph_t graph = capturing_graph(stream);
  size_t count = 0;
  C10_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  C10_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  nodes.resize(count);
  return nodes;
}

// Whether a replay can switch `node` off (cudaGraphNodeSetEnabled).
bool switchable(cudaGraphNode_t node) {
  cudaGraphNodeType type;
  C10_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
  return type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemcpy ||
         type == cudaGraphNodeTypeMemset;
}

// Whether `node` is a 1-D device-to-device memcpy writing `dst`.
bool is_copy_into(cudaGraphNode_t node, const void* dst) {
  cudaGraphNodeType type;
  C10_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
  if (type != cudaGraphNodeTypeMemcpy) {
    return false;
  }
  cudaMemcpy3DParms params{};
  C10_CUDA_CHECK(cudaGraphMemcpyNodeGetParams(node, &params));
  return params.dstPtr.ptr == dst && params.kind == cudaMemcpyDeviceToDevice;
}

// The device tensors holding the seed and base offset that a graph's random
// ops read, for one generator state: Note [Seeding random numbers inside the
// graph].  Both undefined where this torch keeps them elsewhere.
using SeedTensors = std::pair<at::TensorBase, at::TensorBase>;

// torch <= 2.11: one pair per generator state, shared by all its graphs.
template <class State, class Id>
auto seed_tensors(State& state, Id, int)
    -> decltype(state.offset_extragraph_, SeedTensors()) {
  return {state.seed_extragraph_, state.offset_extragraph_};
}
// Later releases: one pair per generator state and capture.
template <class State, class Id>
auto seed_tensors(State& state, Id capture_id, long)
    -> decltype(state.capture_states_.find(capture_id)->second->rng_state_offset_extragraph_,
                SeedTensors()) {
  std::lock_guard<std::mutex> lock(state.capture_states_mutex_);
  const auto it = state.capture_states_.find(capture_id);
  if (it == state.capture_states_.end()) {
    return {};
  }
  return {it->second->rng_state_seed_extragraph_, it->second->rng_state_offset_extragraph_};
}
template <class State, class Id>
SeedTensors seed_tensors(State&, Id, ...) {
  return {};
}

// The lock torch's replay prologue holds while it reads a state's seed and
// offset and moves the offset on; releases that take none get none.
template <class State>
auto replay_lock(State& state, int)
    -> decltype(std::unique_lock<std::mutex>(state.capture_states_mutex_)) {
  return std::unique_lock<std::mutex>(state.capture_states_mutex_);
}
template <class State>
std::unique_lock<std::mutex> replay_lock(State&, long) {
  return {};
}

// A one-word memset node's parameters, writing `dst`; launch() sets the value.
cudaMemsetParams word_memset(void* dst) {
  cudaMemsetParams p{};
  p.dst = dst;
  p.elementSize = 4;
  p.width = 1;
  p.height = 1;
  return p;
}

// Makes every node in `later` wait for `first`.
void precede(cudaGraph_t graph, cudaGraphNode_t first,
             const std::vector<cudaGraphNode_t>& later) {
  const std::vector<cudaGraphNode_t> from(later.size(), first);
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaGraphAddDependencies(graph, from.data(), later.data(), nullptr,
                                          later.size()));
#else
  C10_CUDA_CHECK(cudaGraphAddDependencies(graph, from.data(), later.data(), later.size()));
#endif
}

}  // namespace

// Whether a memcpy of dst.nbytes() bytes from src's first element copies
// `src` into `dst` element for element: the same dense layout, and memory
// that does not overlap (the caller has checked sizes, dtype and device).
bool memcpy_copies(const at::Tensor& dst, const at::Tensor& src) {
  if (!src.is_non_overlapping_and_dense() || !src.strides().equals(dst.strides())) {
    return false;
  }
  const auto* s = static_cast<const char*>(src.const_data_ptr());
  const auto* d = static_cast<const char*>(dst.const_data_ptr());
  const size_t n = dst.nbytes();
  return s + n <= d || d + n <= s;
}

SlotId Graph::capture_copy_in(const at::Tensor& dst) {
  CopyIn slot;
  slot.dst = dst.data_ptr();
  slot.bytes = dst.nbytes();
  if (slot.bytes > 0 && dst.is_non_overlapping_and_dense()) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    C10_CUDA_CHECK(cudaMemcpyAsync(slot.dst, slot.dst, slot.bytes, cudaMemcpyDeviceToDevice,
                                   stream));
    const cudaGraphNode_t node = last_captured_node(stream);
    // A driver that dropped the self-copy left no node to disable: the slot
    // then falls back to ATen, which is just as correct.
    if (node != nullptr && is_copy_into(node, slot.dst)) {
      slot.node = node;
      slot.src = slot.dst;
    }
  }
  copy_ins_.push_back(slot);
  return SlotId{static_cast<uint32_t>(copy_ins_.size() - 1)};
}

SegmentId Graph::capture_segment(const std::function<void()>& record) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<cudaGraphNode_t> before = captured_nodes(stream);
  std::sort(before.begin(), before.end());
  record();
  Segment segment;
  for (cudaGraphNode_t node : captured_nodes(stream)) {
    if (std::binary_search(before.begin(), before.end(), node)) {
      continue;
    }
    TORCH_CHECK(switchable(node), "cgraph: internal error: an optional part of a graph "
                "recorded a node that a replay cannot switch off. Please report this with "
                "your torch and CUDA versions.");
    segment.nodes.push_back(node);
  }
  segments_.push_back(std::move(segment));
  return SegmentId{static_cast<uint32_t>(segments_.size() - 1)};
}

void Graph::set_segment(SegmentId id, bool enabled) {
  Segment& segment = segments_[id.index];
  if (segment.enabled == enabled) {
    return;
  }
  for (cudaGraphNode_t node : segment.nodes) {
    C10_CUDA_CHECK(cudaGraphNodeSetEnabled(graph_exec_, node, enabled ? 1 : 0));
  }
  segment.enabled = enabled;
}

bool Graph::copy_in(SlotId id, const at::Tensor& dst, const at::Tensor& src) {
  if (!memcpy_copies(dst, src)) {
    skip_copy_in(id);
    return false;
  }
  return copy_in_from(id, src.const_data_ptr());
}

bool Graph::copy_in_from(SlotId id, const void* from) {
  CopyIn& slot = copy_ins_[id.index];
  if (slot.node == nullptr) {
    return false;
  }
  if (from != slot.src) {
    if (cudaGraphExecMemcpyNodeSetParams1D(graph_exec_, slot.node, slot.dst, from, slot.bytes,
                                           cudaMemcpyDeviceToDevice) != cudaSuccess) {
      (void)cudaGetLastError();  // memory from elsewhere (another context, IPC): ATen copies
      skip_copy_in(id);
      return false;
    }
    slot.src = from;
  }
  if (!slot.enabled) {
    C10_CUDA_CHECK(cudaGraphNodeSetEnabled(graph_exec_, slot.node, 1));
    slot.enabled = true;
  }
  return true;
}

void Graph::skip_copy_in(SlotId id) {
  CopyIn& slot = copy_ins_[id.index];
  if (slot.node != nullptr && slot.enabled) {
    C10_CUDA_CHECK(cudaGraphNodeSetEnabled(graph_exec_, slot.node, 0));
    slot.enabled = false;
  }
}

void Graph::capture_rng_seeds() {
  rng_seeds_.clear();
  seeds_in_graph_ = true;
  for (const auto& [state, increment] : captured_generator_states_) {
    if (increment == 0) {
      continue;  // draws nothing: torch's prologue skips it too
    }
    const auto [seed, offset] = seed_tensors(*state, capture_id_, 0);
    if (!seed.defined() || !offset.defined()) {
      rng_seeds_.clear();
      seeds_in_graph_ = false;
      return;
    }
    RngSeed r;
    r.state = state;
    r.increment = increment;
    auto* s = static_cast<char*>(seed.data_ptr());
    auto* o = static_cast<char*>(offset.data_ptr());
    r.params[0] = word_memset(s);  // little-endian: the low half first
    r.params[1] = word_memset(s + 4);
    r.params[2] = word_memset(o);
    r.params[3] = word_memset(o + 4);
    rng_seeds_.push_back(r);
  }
  if (!rng_seeds_.empty()) {
    add_seed_chain();
  }
}

// The seed nodes of every state, in one chain ahead of the graph's roots.
// On an H100, four parallel memset roots joined ahead of a graph cost 8.4 us
// of GPU time per launch, four in a row 3.0.
void Graph::add_seed_chain() {
  size_t count = 0;
  C10_CUDA_CHECK(cudaGraphGetRootNodes(graph_, nullptr, &count));
  std::vector<cudaGraphNode_t> roots(count);
  C10_CUDA_CHECK(cudaGraphGetRootNodes(graph_, roots.data(), &count));
  roots.resize(count);
  cudaGraphNode_t last = nullptr;
  for (RngSeed& r : rng_seeds_) {
    for (int k = 0; k < 4; ++k) {
      C10_CUDA_CHECK(cudaGraphAddMemsetNode(&r.nodes[k], graph_, last ? &last : nullptr,
                                            last ? 1 : 0, &r.params[k]));
      last = r.nodes[k];
    }
  }
  precede(graph_, last, roots);
}

// What torch's replay prologue does for one state (read its seed and
// offset, move the offset on by the graph's whole increment), written into
// the state's memset nodes where a value changed.
void Graph::write_seeds(RngSeed& r) {
  uint64_t seed = 0, offset = 0;
  {
    auto lock = replay_lock(*r.state, 0);
    seed = r.state->seed_;
    offset = r.state->philox_offset_per_thread_;
    r.state->philox_offset_per_thread_ += r.increment;
  }
  const uint32_t words[4] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                             static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
  for (int k = 0; k < 4; ++k) {
    if (r.params[k].value != words[k]) {
      cudaMemsetParams p = r.params[k];
      p.value = words[k];
      C10_CUDA_CHECK(cudaGraphExecMemsetNodeSetParams(graph_exec_, r.nodes[k], &p));
      r.params[k] = p;
    }
  }
}

void Graph::launch(cudaStream_t stream) {
  if (!seeds_in_graph_) {
    replay();
    return;
  }
  c10::cuda::CUDAGuard guard(capture_dev_);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  TORCH_CHECK(status == cudaStreamCaptureStatusNone, "cgraph: a graphed callable was called "
              "while its stream is capturing a CUDA graph; a replay cannot be recorded into "
              "another graph. Inside a capture, call the eager callable instead.");
  for (RngSeed& r : rng_seeds_) {
    write_seeds(r);
  }
  C10_CUDA_CHECK(cudaGraphLaunch(graph_exec_, stream));
}

}  // namespace cgraph
