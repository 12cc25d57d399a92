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

// Py_IsFinalizing is public API from Python 3.13.
bool interpreter_finalizing() {
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
  if (alive_) {
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
    if (pool.first != 0 || pool.second != 0) {
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
// aten_pool.cpp).  Not at exit, where nothing replays.
Engine::~Engine() {
  if (alive_ && !interpreter_finalizing() && (shares_pool_with_others() || borrows_memory())) {
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
