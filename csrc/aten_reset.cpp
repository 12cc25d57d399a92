// aten_reset.cpp -- the last place of the lifecycle: an engine's graphs,
// static tensors and pool memory given back.  Never throws.
#include "aten_engine.hpp"

#include <atomic>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

namespace cgraph {
namespace {

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

// Whether this thread's stream or cgraph's capture stream (Note [The capture stream],
// where every cgraph capture runs, another thread's too) is capturing on `device`; true
// where that cannot be told.
bool capture_under_way(c10::DeviceIndex device) noexcept {
  try {
    c10::cuda::CUDAGuard guard(device);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(capture_stream(device).stream(), &status) != cudaSuccess) {
      (void)cudaGetLastError();
      return true;
    }
    return status != cudaStreamCaptureStatusNone ||
           c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  } catch (const std::exception&) {
    return true;
  }
}

// Note [Emptying a pool under expandable segments]
// Q: Emptying the pool's cache gives its free memory back to the device.  Under
//    expandable_segments:True torch's allocator does so with cuMemUnmap after synchronizing
//    only the stream the segment was made for (ExpandableSegment::unmapHandles): for a
//    graph's pool, the capture stream (Note [The capture stream], aten_graph.cpp).  Replays
//    and the copies that give held outputs and grads memory of their own (hand_back_held,
//    just before) run on the caller's stream, and the GPU may be behind the CPU.  And a
//    released pool emptied while blocks in it are still allocated (an output the caller
//    holds) can be erased under them: torch counts a pool's growths once per mapping but
//    takes one off per range unmapped (Note [A step's warm-up in its pool], aten_setup.cpp).
//    What then?
// A: Pages unmapped before a kernel queued earlier reads or writes them: an illegal memory
//    access.  On an H200, every time with the caller's stream held up (torch.cuda._sleep)
//    before reset(); at random without (test_memory's allocator test, 3 runs of 7 under
//    load).  cudaFree, which releases the pool under the default setting, synchronizes the
//    device itself.  So under expandable segments:
//    - held outputs and grads get memory of their own when an engine is dropped too, not
//      only at reset() (~Engine);
//    - the device is synchronized, as cudaFree would, before the pool is emptied or left
//      to torch's own emptying; the pool is emptied only with none of its blocks allocated.
//      Left allocated: kept_outputs="alias" buffers the caller holds, as torch's own graphs
//      leave them, and the grads a graphed step's capture made (cgraph/_step.py), which
//      other steps may read in place and FSDP2 holds as views of one buffer: moving them
//      would need the storage-level move of move_to_own_memory and a registry of readers.
//    Neither while a capture is under way on this thread's stream or cgraph's capture
//    stream (a synchronization would invalidate it, and a hand-back's copy would be
//    captured instead of run): the pool is then left to torch's own emptying.  Costs, under
//    that setting only: one device synchronization (the GIL released meanwhile) and one
//    snapshot of the allocator per reset or dropped engine, and the copies of what a
//    dropped engine's caller still holds.
bool may_empty_pool(c10::DeviceIndex device, at::cuda::MempoolId_t pool) {
  if (!expandable_segments_on()) {
    return true;
  }
  if (capture_under_way(device)) {
    return false;
  }
  c10::cuda::CUDAGuard guard(device);
  if (PyGILState_Check()) {  // a dropped engine's destructor may run on a thread without it
    GilRelease nogil;
    c10::cuda::device_synchronize();
  } else {
    c10::cuda::device_synchronize();
  }
  return !pool_holds_allocations(device, pool);
}

}  // namespace

// Note [Resets at exit]
// Q: cgraph's atexit hook resets every live graph, so that graphs (and the NCCL
//    communicator references a captured collective holds) are freed while CUDA is
//    up.  What of the rest of a reset there?
// A: It is skipped, as during the interpreter's finalization: the copies that
//    give held outputs and grads memory of their own (the memory they take can
//    run out, and then each warns), and the emptying of the pool with its
//    device synchronization (under expandable segments, or cudaFree's own),
//    which would wait forever on a replayed collective whose peer died (Ctrl-C
//    after a rank failed: a graph's collective has no Work for NCCL's watchdog
//    to time out).  An atexit handler registered before `import cgraph` runs
//    after this one and can still read what it holds: the pool, not emptied,
//    keeps those blocks.  The driver takes the memory back with the process.
namespace {
std::atomic<bool> exiting{false};
}  // namespace

// Called once, by cgraph's atexit hook (cg_exiting).
void note_exiting() noexcept {
  exiting.store(true, std::memory_order_relaxed);
}

// Py_IsFinalizing is public API from Python 3.13.
bool interpreter_finalizing() {
  if (exiting.load(std::memory_order_relaxed)) {
    return true;
  }
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Outputs and grads the caller still holds get memory of their own (or,
// kept_outputs='error', are made unreadable), as before a replay: Notes
// [Outputs of earlier calls] and [Grads handed to autograd] (aten_replay.cpp).
void Engine::hand_back_held() noexcept {
  try {
    release_earlier_outputs();
    release_handed_grads({});
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: could not copy out a held output: ", e.what());
  }
}

// An explicit reset: the pool's memory goes back to the device now, not when
// the tensors the caller holds die.
void Engine::reset() noexcept {
  if (alive_ && !interpreter_finalizing()) {  // Note [Resets at exit]
    hand_back_held();
  }
  tear_down();
}

// What reset() and the destructor share.
void Engine::tear_down() noexcept {
  if (!alive_) {
    return;
  }
  alive_ = false;
  setup.reset();  // a failed set-up's: Note [A set-up puts back what it changed]
  try {
    // Tensors first, so the pool's blocks are free when the graphs let go
    // of the pool; then the pool's cached memory goes back to the device.
    inputs.clear();
    for (const Param& p : params) {  // the ledger protects the ones others still share
      if (p.owns_store && p.store->ledger && p.store.use_count() > 1) {
        note_orphan_store(p.store);
      }
    }
    params.clear();
    outputs.clear();
    member.forget_history();
    handed.forget();
    rng.finish_setup();  // a failed capture's RNG set-up state, if any
    fwd.reset();
    bwd.reset();
    blas_workspace.reset();  // after the graphs that write it
    if ((pool.first != 0 || pool.second != 0) && !interpreter_finalizing() &&
        may_empty_pool(device, pool)) {
      empty_pool_cache(pool, 0);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: reset did not complete: ", e.what());
  }
}

// Held outputs and grads get memory of their own first where the ledger
// would no longer move them out of the way of a pool that other graphs still
// replay into, or where they do not keep their memory allocated: memory
// freed once the pass was over or once the readers captured, input grads
// freed at their capture, or read in place and kept by Input::owner (Notes
// [Static memory freed once its pass is over], [An output freed once its
// reader has captured] and [Input grads freed at their capture],
// aten_pool.cpp).  Under expandable segments always, but while a capture
// is under way, which would record the copies instead of running them (the
// pool is not emptied then): Note [Emptying a pool under expandable
// segments].  Not at exit, where nothing replays.
Engine::~Engine() {
  if (alive_ && !interpreter_finalizing() &&
      (shares_pool_with_others() || borrows_memory() ||
       (expandable_segments_on() && !capture_under_way(device)))) {
    hand_back_held();
  }
  tear_down();
}

bool Engine::borrows_memory() const {
  bool borrows = member.freed_statics() || member.freed_grads();
  for (const Input& in : inputs) {
    borrows = borrows || in.owner.defined();
  }
  return borrows;
}

}  // namespace cgraph
