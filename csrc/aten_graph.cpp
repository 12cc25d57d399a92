// aten_graph.cpp -- a Graph's capture: begin, end, or abandon; the stream
// every capture runs on.
#include "aten_graph.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>

namespace cgraph {

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

namespace {
// Swallows torch warnings while alive ("The CUDA Graph is empty").
struct QuietWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};
}  // namespace

void Graph::capture_begin(at::cuda::MempoolId_t pool, cudaStreamCaptureMode mode) {
  drop_foreign_blas_workspaces(c10::cuda::getCurrentCUDAStream().stream());
  at::cuda::CUDAGraph::capture_begin(pool, mode);
  enlist(mode);  // Note [Conditional regions] (aten_conditional.cpp)
}

void Graph::capture_end() {
  TORCH_CHECK(regions_.empty(), "cgraph: internal error: a capture ended inside a conditional "
              "region.");
  delist();
  at::cuda::CUDAGraph::capture_end();
  drop_foreign_blas_workspaces(c10::cuda::getCurrentCUDAStream().stream());
  if (!has_graph_exec_) {
    capture_rng_seeds();
    instantiate();  // a graph that keeps its cudaGraph_t: torch leaves this to us
  } else {
    seeds_in_graph_ = false;  // instantiated already: torch's replay() seeds it
  }
}

// After an invalidated capture: the allocator's part of ending it, where
// this torch's reset() does not do it.  See Note [Abandoning a capture].
void Graph::release_abandoned_pool() noexcept {
  if (reset_ends_pool_routing(*this, 0)) {
    return;
  }
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(capture_dev_, mempool_id_);
    c10::cuda::CUDACachingAllocator::releasePool(capture_dev_, mempool_id_);
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: could not release the pool of a failed capture: ", e.what());
  }
}

void Graph::abandon() noexcept {
  while (!regions_.empty()) {
    end_if(/*completed=*/false);
  }
  bool invalidated = false;
  try {
    // Succeeds when only Python code failed and the stream capture is
    // intact; then torch's own bookkeeping unwinds everything.
    capture_end();
  } catch (const std::exception&) {
    // Expected: the capture was invalidated, and the callable's own error
    // is the one the caller reports.  cudaStreamEndCapture has ended the
    // capture all the same; clear the error it left and undo the routing.
    invalidated = true;
    (void)cudaGetLastError();
    release_abandoned_pool();
  }
  try {
    reset();
    drop_foreign_blas_workspaces(c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: could not free the graph of a failed capture: ", e.what());
  }
  (void)cudaGetLastError();
  if (invalidated) {
    finish_generator_capture();
  }
}

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

}  // namespace cgraph
