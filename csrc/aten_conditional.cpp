// aten_conditional.cpp -- conditional regions of a capture: work a replay
// runs only where a flag on the device says so.  Part of the capture place
// of the lifecycle (Graph::begin_if, Graph::end_if; aten_graph.hpp).
//
// Note [Conditional regions]
// Q: What needs them?
// A: A GradScaler steps an unfused optimizer only where unscale_ found no inf
//    or NaN, and decides on the host (found_inf.item()), a sync a graph cannot
//    hold.  A conditional node (CUDA 12.4+) decides on the device instead: the
//    optimizer's step is recorded into the body of an "if found_inf == 0"
//    node, and a replay runs all of it or none of it, as eager does
//    (cgraph/_step.py, Note [GradScaler with any optimizer]).  torch has this
//    as CUDAGraph.begin_capture_to_if_node from 2.12 on only, and its pool
//    routing there is torch's; cgraph captures with its own Graph, so it
//    records the node itself, the same way.
// Q: How is a region recorded?
// A: begin_if: a kernel on the capturing stream copies the flag into a
//    conditional handle (condition.cu); a conditional node after it, and the
//    capturing stream's next work after the node; a second stream, the
//    region's, captures into the node's body graph and becomes the current
//    stream.  end_if ends that capture and makes the caller's stream current
//    again.  A replay then runs: kernel, node (body or not), the rest.
// Q: Where does the body's memory come from?
// A: The graph's pool, as every other temporary of the capture.  torch's
//    capture routes to the pool only the allocations of streams whose capture
//    id is the capture's own, and the body's capture has an id of its own.  So
//    the first region of a capture re-routes the pool once, to a filter that
//    also takes every region's id (takes_allocations_of).  Re-routing takes a
//    second reference to the pool (beginAllocateToPool does), which is
//    released at once: the capture holds its own, as before.  (torch 2.14
//    routes a capture's pinned host allocations by capture id too; those of
//    a body are not re-routed: a body is meant for device work, an
//    optimizer's step.)
// Q: What may the body hold?
// A: What CUDA allows in a conditional body: kernels, memcpys and memsets,
//    no event nodes (work on another stream joined back), no host nodes.
//    Anything else fails the capture with CUDA's error.  Random numbers: on
//    torch 2.11 a draw in the body reserves its offsets at capture whether a
//    replay runs the body or not, so draws stay unique; torch 2.12 and later
//    key a generator's capture state by capture id and do not know the
//    body's, so a random op there fails with torch's error (as torch's own
//    conditional nodes refuse it).  Never silently wrong either way.
//    A GEMM in the body takes a cuBLAS workspace for the region's stream
//    from the pool: dropped when the region ends, as a temporary of the
//    capture (Note [One cuBLAS workspace per stream], aten_workspace.cpp).
#include "aten_graph.hpp"
#include "condition.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <unordered_map>

namespace cgraph {
namespace {

// Every Graph capturing now, by the capture ids it records under (its own and
// its open regions').  Not thread-local: autograd's device threads capture
// too.
std::mutex capturing_mutex;
std::unordered_map<unsigned long long, Graph*>& capturing_graphs() {
  static std::unordered_map<unsigned long long, Graph*> graphs;
  return graphs;
}

// The id of the capture `stream` records, 0 if none (or CUDA failed: the
// allocator's filter must not throw).
unsigned long long capture_id_of(cudaStream_t stream) noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
#if CUDART_VERSION >= 13000
  cudaError_t err = cudaStreamGetCaptureInfo(stream, &status, &id, nullptr, nullptr, nullptr,
                                             nullptr);
#else
  cudaError_t err = cudaStreamGetCaptureInfo(stream, &status, &id);
#endif
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return status == cudaStreamCaptureStatusActive ? id : 0;
}

void register_capture(unsigned long long id, Graph* graph) {
  std::lock_guard<std::mutex> lock(capturing_mutex);
  capturing_graphs()[id] = graph;
}

void unregister_capture(unsigned long long id) noexcept {
  std::lock_guard<std::mutex> lock(capturing_mutex);
  capturing_graphs().erase(id);
}

// The stream that records regions at `depth` (0: outermost) on `device`:
// created once, blocking, as Note [The capture stream] says of the capture's
// own (and for its reason: the allocator reuses a pool's blocks per stream).
c10::cuda::CUDAStream region_stream(c10::DeviceIndex device, size_t depth) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, std::vector<cudaStream_t>> streams;
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<cudaStream_t>& of_device = streams[device];
  while (of_device.size() <= depth) {
    c10::cuda::CUDAGuard guard(device);
    cudaStream_t stream = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamDefault));
    of_device.push_back(stream);
  }
  return c10::cuda::getStreamFromExternal(of_device[depth], device);
}

#if CG_HAS_CONDITIONAL_NODES
// Adds to the graph `stream` captures an "if" node on `handle`, after what
// the stream recorded last, and makes it what the stream records after.
// Returns the node's body graph.
cudaGraph_t add_if_node(cudaStream_t stream, cudaGraphConditionalHandle handle) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t count = 0;
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node = nullptr;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, &edges,
                                          &count));
  C10_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, edges, count, &params));
  C10_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                                     cudaStreamSetCaptureDependencies));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v3(stream, &status, nullptr, &graph, &deps, &edges,
                                             &count));
  C10_CUDA_CHECK(cudaGraphAddNode_v2(&node, graph, deps, edges, count, &params));
  C10_CUDA_CHECK(cudaStreamUpdateCaptureDependencies_v2(stream, &node, nullptr, 1,
                                                        cudaStreamSetCaptureDependencies));
#endif
  return params.conditional.phGraph_out[0];
}

// A conditional handle of the graph `stream` captures, set from *flag by a
// kernel the stream records now.
cudaGraphConditionalHandle condition_from(const at::Tensor& flag, cudaStream_t stream) {
  cudaGraphConditionalHandle handle{};
  C10_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, capturing_graph(stream), 0, 0));
  C10_CUDA_CHECK(cg_set_condition(handle, flag.const_data_ptr<bool>(), stream));
  return handle;
}
#endif

}  // namespace

bool conditional_nodes_supported() {
#if CG_HAS_CONDITIONAL_NODES
  int driver = 0;
  return cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12040;
#else
  return false;
#endif
}

void Graph::enlist(cudaStreamCaptureMode mode) {
  mode_ = mode;
  const unsigned long long id = capture_id_of(c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(id != 0, "cgraph: internal error: no capture after capture_begin.");
  {
    std::lock_guard<std::mutex> lock(pool_captures_mutex_);
    pool_captures_.assign(1, id);
  }
  regions_routed_ = false;
  register_capture(id, this);
}

void Graph::delist() noexcept {
  std::lock_guard<std::mutex> lock(pool_captures_mutex_);
  for (const unsigned long long id : pool_captures_) {
    unregister_capture(id);
  }
}

Graph* Graph::capturing_here() {
  const unsigned long long id = capture_id_of(c10::cuda::getCurrentCUDAStream().stream());
  std::lock_guard<std::mutex> lock(capturing_mutex);
  const auto it = capturing_graphs().find(id);
  return id != 0 && it != capturing_graphs().end() ? it->second : nullptr;
}

bool Graph::takes_allocations_of(cudaStream_t stream) const {
  const unsigned long long id = capture_id_of(stream);
  std::lock_guard<std::mutex> lock(pool_captures_mutex_);
  return id != 0 && std::find(pool_captures_.begin(), pool_captures_.end(), id) !=
                        pool_captures_.end();
}

void Graph::route_regions_to_pool() {
  if (regions_routed_) {
    return;
  }
  namespace alloc = c10::cuda::CUDACachingAllocator;
  alloc::endAllocateToPool(capture_dev_, mempool_id_);
  alloc::beginAllocateToPool(capture_dev_, mempool_id_,
                             [this](cudaStream_t s) { return takes_allocations_of(s); });
  alloc::releasePool(capture_dev_, mempool_id_);  // begin's second reference
  regions_routed_ = true;
}

void Graph::begin_if(const at::Tensor& flag) {
#if CG_HAS_CONDITIONAL_NODES
  TORCH_CHECK(flag.is_cuda() && flag.device().index() == capture_dev_ && flag.numel() == 1 &&
                  flag.scalar_type() == at::kBool,
              "cgraph: a conditional region's flag is one bool on the capture's device (cuda:",
              static_cast<int>(capture_dev_), "); got ", flag.numel(), " ", flag.scalar_type(),
              " on ", flag.device(), ".");
  TORCH_CHECK(conditional_nodes_supported(), "cgraph: this CUDA driver has no conditional "
              "graph nodes (12.4 or later has them).");
  const c10::cuda::CUDAStream outer = c10::cuda::getCurrentCUDAStream();
  const cudaGraph_t body_graph = add_if_node(outer.stream(), condition_from(flag, outer.stream()));
  const c10::cuda::CUDAStream body = region_stream(capture_dev_, regions_.size());
  route_regions_to_pool();
  C10_CUDA_CHECK(cudaStreamBeginCaptureToGraph(body.stream(), body_graph, nullptr, nullptr, 0,
                                               mode_));
  const unsigned long long id = capture_id_of(body.stream());
  {
    std::lock_guard<std::mutex> lock(pool_captures_mutex_);
    pool_captures_.push_back(id);
  }
  register_capture(id, this);
  regions_.push_back(IfRegion{outer, body, id});
  c10::cuda::setCurrentCUDAStream(body);
#else
  (void)flag;
  TORCH_CHECK(false, "cgraph was built with a CUDA before 12.4, which has no conditional graph "
              "nodes.");
#endif
}

void Graph::end_if(bool completed) {
  if (regions_.empty()) {
    TORCH_CHECK(!completed, "cgraph: internal error: end_if() outside a region.");
    return;
  }
  const IfRegion region = regions_.back();
  regions_.pop_back();
  const bool on_body = c10::cuda::getCurrentCUDAStream() == region.body;
  c10::cuda::setCurrentCUDAStream(region.outer);
  unregister_capture(region.capture_id);
  cudaGraph_t ended = nullptr;
  const cudaError_t err = cudaStreamEndCapture(region.body.stream(), &ended);
  try {
    drop_foreign_blas_workspaces(region.body.stream());
  } catch (const std::exception&) {
    if (completed) {
      throw;
    }
  }
  if (!completed) {
    (void)cudaGetLastError();
    return;
  }
  C10_CUDA_CHECK(err);
  TORCH_CHECK(on_body, "cgraph: the current stream changed inside a conditional region (the "
              "optimizer's step) and was not given back; a region must end on its own stream.");
}

}  // namespace cgraph
