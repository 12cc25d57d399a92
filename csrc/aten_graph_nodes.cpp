// aten_graph_nodes.cpp -- the nodes of a captured graph that each replay
// switches: copies of the call's arguments into the static buffers, done by
// the graph itself, and optional segments (the parameter-grad tails of Note
// [Parameter gradients]).
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
#include "aten_engine.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

namespace cgraph {
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

}  // namespace

void Graph::capture_copy_in(const at::Tensor& dst) {
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
}

size_t Graph::capture_segment(const std::function<void()>& record) {
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
  return segments_.size() - 1;
}

void Graph::set_segment(size_t s, bool enabled) {
  Segment& segment = segments_[s];
  if (segment.enabled == enabled) {
    return;
  }
  for (cudaGraphNode_t node : segment.nodes) {
    C10_CUDA_CHECK(cudaGraphNodeSetEnabled(graph_exec_, node, enabled ? 1 : 0));
  }
  segment.enabled = enabled;
}

bool Graph::copy_in(size_t k, const at::Tensor& dst, const at::Tensor& src) {
  CopyIn& slot = copy_ins_[k];
  if (slot.node == nullptr || !memcpy_copies(dst, src)) {
    skip_copy_in(k);
    return false;
  }
  const void* from = src.const_data_ptr();
  if (from != slot.src) {
    if (cudaGraphExecMemcpyNodeSetParams1D(graph_exec_, slot.node, slot.dst, from, slot.bytes,
                                           cudaMemcpyDeviceToDevice) != cudaSuccess) {
      (void)cudaGetLastError();  // memory from elsewhere (another context, IPC): ATen copies
      skip_copy_in(k);
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

void Graph::skip_copy_in(size_t k) {
  CopyIn& slot = copy_ins_[k];
  if (slot.node != nullptr && slot.enabled) {
    C10_CUDA_CHECK(cudaGraphNodeSetEnabled(graph_exec_, slot.node, 0));
    slot.enabled = false;
  }
}

}  // namespace cgraph
