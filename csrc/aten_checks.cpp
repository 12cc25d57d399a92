// aten_checks.cpp -- the switch for cgraph's debug checks, and the faults a
// test plants to see them fire.  The checks themselves sit where the rules
// are applied (CG_INVARIANT / CG_DEBUG_INVARIANT, aten_engine.hpp).
#include "aten_engine.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace cgraph {

// Note [Checked invariants]
// Q: When may a replay run, what may it overwrite, and who owns a held
//    output or grad?  The Notes of aten_pool.cpp, aten_replay.cpp and
//    aten_setup.cpp answer in prose; how does a reader know the code does
//    what they say?
// A: Each rule is also a named check at the place that relies on it.  The
//    cheap ones (a comparison of capture numbers, a flag) are CG_INVARIANT,
//    always on.  The ones that walk every graph of a pool or every held
//    tensor again are CG_DEBUG_INVARIANT, on with CGRAPH_DEBUG=1
//    (scripts/gpu.sh runs the whole GPU suite once more so): a replay then
//    costs a walk of its pool, which is why they are off by default.  They
//    recompute without the shortcuts what the fast path decided with them
//    (release_later_outputs skips the walk when no graph was captured after
//    this one): that nothing a replay writes is still held by anybody but the
//    replay's own incoming grads (Engine::held_where_written, aten_pool.cpp),
//    that a forward replays only where may_replay_forward() holds, that an
//    input read in place lies in the output that owns it, and that a call
//    replayed as accepted is one accepts() takes (aten_replay.cpp).  A failure
//    raises RuntimeError "cgraph invariant: ...", the rule named: a bug in
//    cgraph (InvariantError, which no warning swallows).  tests/test_invariants.py
//    plants a fault (Fault::SkipLaterMoves) and sees the check fire.

namespace {

bool env_says_debug() {
  const char* value = std::getenv("CGRAPH_DEBUG");
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

std::atomic<Fault> fault_planted{Fault::None};

}  // namespace

std::atomic<bool> debug_switch{env_says_debug()};

InvariantError::InvariantError(const std::string& rule, const char* file, uint32_t line)
    : c10::Error(c10::SourceLocation{"cgraph invariant", file, line},
                 "cgraph invariant: " + rule + " This is a bug in cgraph; please report it "
                 "with the steps that led here.") {}

Fault planted_fault() {
  return fault_planted.load(std::memory_order_relaxed);
}

bool set_debug(bool on, const char* fault) {
  Fault plant = Fault::None;
  if (fault != nullptr && std::strcmp(fault, "skip_later_moves") == 0) {
    plant = Fault::SkipLaterMoves;
  } else if (fault != nullptr && *fault != '\0') {
    return false;
  }
  fault_planted.store(plant);
  debug_switch.store(on);
  return true;
}

}  // namespace cgraph
