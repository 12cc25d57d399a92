// aten_reset.cpp -- the last place of the lifecycle: an engine's graphs,
// static tensors and pool memory given back.  Never throws.
#include "aten_engine.hpp"

#include <c10/cuda/CUDACachingAllocator.h>

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

}  // namespace

void Engine::reset() noexcept {
  if (alive) {
    // Outputs and grads the caller still holds (a grad a hook kept) get
    // memory of their own, as before a replay (Notes [Outputs of
    // earlier calls] and [Grads handed to autograd], aten_replay.cpp), so
    // the pool's memory goes back to the device now, not when they die.
    try {
      if (kept_outputs == CG_KEEP_COPY) {
        release_earlier_outputs();
      }
      release_handed_grads({});
    } catch (const std::exception& e) {
      TORCH_WARN("cgraph: reset could not copy out a held output: ", e.what());
    }
  }
  tear_down();
}

// What reset() and the destructor share; the destructor leaves held outputs
// where they are (they keep their memory alive), since it may run at exit.
void Engine::tear_down() noexcept {
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
    kept_history.clear();
    handed_out.clear();
    setup.reset();
    fwd.reset();
    bwd.reset();
    blas_workspace.reset();  // after the graphs that write it
    if (pool.first != 0 || pool.second != 0) {
      empty_pool_cache(pool, 0);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: reset did not complete: ", e.what());
  }
}

Engine::~Engine() {
  tear_down();
}

}  // namespace cgraph
