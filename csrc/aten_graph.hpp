// aten_graph.hpp -- Graph: one captured CUDA graph, torch's CUDAGraph with the
// parts cgraph switches per replay.  Internal to the C++ half.
//
// Its lifecycle is that of every graph: capture_begin/capture_end (or
// abandon) in aten_graph.cpp; the nodes a replay sets, and launch(), in
// aten_graph_nodes.cpp; shape() in aten_inspect.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "cgraph.h"

namespace cgraph {

// A copy-in slot of one Graph: a memcpy node at its head, re-pointed per
// replay (Note [Argument copies inside the graph]).
struct SlotId {
  uint32_t index = 0;
};

// An optional segment of one Graph: nodes that a replay switches on or off
// together (the parameter-grad tails, an incoming grad's broadcast or zeros).
struct SegmentId {
  uint32_t index = 0;
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

  // torch's; a cuBLAS workspace the capture allocates from the pool is a
  // temporary of this graph: Note [One cuBLAS workspace per stream].
  // capture_end() also instantiates a graph that keeps its cudaGraph_t.
  void capture_begin(at::cuda::MempoolId_t pool, cudaStreamCaptureMode mode);
  void capture_end();
  // Never throws; a failure to release the pool is reported as a warning.
  void abandon() noexcept;

  // During capture, before the callable's first operation: a copy-in slot
  // writing `dst`.
  SlotId capture_copy_in(const at::Tensor& dst);
  // Before a replay: the graph copies `src` into `dst` (slot's buffer)
  // itself.  False when it cannot (a layout a memcpy cannot copy, or the
  // driver refused): the slot is then off and the caller copies.
  bool copy_in(SlotId slot, const at::Tensor& dst, const at::Tensor& src);
  // The same for raw memory: the slot's buffer's size in bytes from `src`.
  bool copy_in_from(SlotId slot, const void* src);
  // Before a replay: the slot copies nothing this time.
  void skip_copy_in(SlotId slot);

  // During capture: runs `record` and makes the nodes it records an optional
  // segment.  Every replay must say whether it runs (set_segment).  Only
  // kernel, memcpy and memset nodes can be switched: anything else raises.
  SegmentId capture_segment(const std::function<void()>& record);
  // Before a replay: whether the segment runs this time.
  void set_segment(SegmentId segment, bool enabled);

  // Replays the graph on `stream`, the current stream of its device (the
  // caller has it already): torch's replay() without its ATen calls.  See
  // Note [Seeding random numbers inside the graph].
  void launch(cudaStream_t stream);

  // What the captured graph is made of (aten_inspect.cpp); false if it was
  // not captured (or was reset).
  bool shape(cg_graph_shape* out) const;

  // During capture: what the current stream records from now until end_if()
  // runs at a replay only where `flag` (one CUDA bool) is true then; until
  // end_if() the current stream is the region's own.  Regions nest.  Note
  // [Conditional regions] (aten_conditional.cpp).
  void begin_if(const at::Tensor& flag);
  // Ends the innermost open region and gives its caller's stream back.  With
  // completed=false (what it recorded raised), never throws.
  void end_if(bool completed);
  // The Graph whose capture (or one of whose regions) the current stream
  // records, or nullptr.
  static Graph* capturing_here();

 private:
  // Conditional regions (aten_conditional.cpp).
  struct IfRegion {
    c10::cuda::CUDAStream outer;        // the stream begin_if() was called on
    c10::cuda::CUDAStream body;         // records the region
    unsigned long long capture_id = 0;  // the body's capture
  };
  std::vector<IfRegion> regions_;  // open, innermost last
  // The capture ids whose allocations go to the graph's pool: its own and
  // every region's so far.  The allocator's filter reads it on any thread.
  std::vector<unsigned long long> pool_captures_;
  mutable std::mutex pool_captures_mutex_;
  bool regions_routed_ = false;  // the allocator's filter is takes_allocations_of
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeGlobal;
  void enlist(cudaStreamCaptureMode mode);
  void delist() noexcept;
  void route_regions_to_pool();
  bool takes_allocations_of(cudaStream_t stream) const;
  static void finish_generator_capture() noexcept;
  void release_abandoned_pool() noexcept;
  // At capture end, before instantiation: the nodes that write the seeds and
  // offsets the graph's random ops read.
  void capture_rng_seeds();
  void add_seed_chain();

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
  void write_seeds(RngSeed& seed);

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

// The graph `stream` is capturing into; throws if it captures none
// (aten_graph_nodes.cpp).
cudaGraph_t capturing_graph(cudaStream_t stream);

// Whether captures can record conditional nodes: cgraph built with CUDA 12.4
// or later, and a driver as new (aten_conditional.cpp).
bool conditional_nodes_supported();

// Whether a memcpy of dst.nbytes() bytes from src's first element copies
// `src` into `dst` element for element (aten_graph_nodes.cpp).
bool memcpy_copies(const at::Tensor& dst, const at::Tensor& src);

// Every warm-up and capture on `device` runs on this stream: Note [The
// capture stream] (aten_graph.cpp).
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device);

// The cuBLAS workspace graphs share with eager mode on one caller stream:
// Note [One cuBLAS workspace per stream] (aten_workspace.cpp).
class BlasWorkspace;
// The caller stream's workspace, or nullptr if none is alive.
std::shared_ptr<BlasWorkspace> live_blas_workspace(const c10::cuda::CUDAStream& caller);
// The caller stream's workspace, made if none is alive, with torch's entries
// on the caller and capture streams pointed at it for `handles` (the
// threads a warm-up runs on, or those it used), the handles of eager GEMMs
// on the caller stream and those an earlier session pointed.  Eager mode's
// own workspaces move to `replaced`: free them once other threads' GEMMs
// are done.
std::shared_ptr<BlasWorkspace> share_blas_workspace(const c10::cuda::CUDAStream& caller,
                                                    cudaStream_t capture,
                                                    std::set<void*> handles,
                                                    std::vector<at::DataPtr>& replaced);
// The calling thread's cuBLAS handle on the current device, named without
// leaving it a workspace on the current stream: Note [Naming a thread's
// cuBLAS handle] (aten_workspace.cpp).
void* blas_handle_of_this_thread();
// Drops torch's workspace entries for `stream` that are not cgraph's (a
// warm-up's, or those a capture allocated from its pool, freed with its
// other temporaries) and returns their handles.
std::set<void*> drop_foreign_blas_workspaces(cudaStream_t stream);

}  // namespace cgraph
