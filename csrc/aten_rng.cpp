// aten_rng.cpp -- random numbers inside graphed callables: checkpointed
// regions that must redraw their forward's dropout masks, and callables that
// seed or draw host-side random numbers during capture.
//
// Note [RNG in checkpointed regions]
// Q: Why does torch.utils.checkpoint need help inside a CUDA graph?
// A: Checkpoint stashes the CUDA RNG state when a region's forward starts
//    (torch.cuda.get_rng_state) and restores it before recomputing the
//    region in backward (torch.cuda.set_rng_state), so the recompute redraws
//    the forward's dropout masks.  Inside a capture that state is the host's
//    (seed, offset), but captured kernels do not read it: they read a base
//    offset that each replay writes to the device, plus their offset within
//    the graph.  Restoring the host state changes nothing the backward graph
//    reads, so its recompute draws other masks and the grads are silently
//    wrong.
// Q: What does cgraph do instead?
// A: While cgraph warms up and captures a callable, torch.cuda.get_rng_state
//    and set_rng_state ask cgraph first (cgraph/_api.py installs the hook):
//    - warm-up (eager): cgraph notes where in the forward's RNG stream each
//      get_rng_state call falls (entry_offsets) and how far one forward
//      advances the stream (forward_increment), then lets torch answer;
//    - forward capture: the k-th get_rng_state switches the default
//      generator to region k's own generator state (registered with both
//      graphs) for the rest of the forward and returns a token for it;
//    - backward capture: set_rng_state(token) switches to that state, so the
//      recompute draws from region k's state from its start, as the forward
//      did; get_rng_state returns a token for the current state.
//    At replay cgraph seeds every region state with the default generator's
//    seed at the offset where eager mode would be (its offset + entry_offsets[k]),
//    and moves the default generator on by forward_increment, as an eager
//    forward would.  Before the backward replay it puts every region state
//    back where that forward started it.  So forward masks, recompute masks
//    and the default generator's stream are those of eager mode, bit for bit.
//    Callables that never ask for the RNG state pay nothing.
#include "aten_engine.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <atomic>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace cgraph {
namespace {

// The engine warming up or capturing, if any.  Not thread-local: the
// backward capture runs checkpoint's recompute (and so the RNG hooks) on
// the autograd engine's device thread.
std::atomic<Engine*> rng_owner{nullptr};

at::Generator default_generator(c10::DeviceIndex device) {
  return at::cuda::detail::getDefaultCUDAGenerator(device);
}

// Registers region k's state with a graph, before its capture.  torch 2.11
// registers a state on both sides (graph and state) only through the
// Generator overload; later releases have only the state overload.
template <class G>
auto register_region(G& graph, const at::Generator& generator,
                     const c10::intrusive_ptr<at::CUDAGeneratorState>&, int)
    -> decltype(graph.register_generator_state(generator), void()) {
  graph.register_generator_state(generator);
}
template <class G>
void register_region(G& graph, const at::Generator&,
                     const c10::intrusive_ptr<at::CUDAGeneratorState>& state, long) {
  graph.register_generator_state(state);
}

// A CPU byte tensor that stands for `generator` until capture ends.
at::Tensor issue_token(Engine& e, at::Generator generator) {
  at::Tensor token = at::zeros({16}, at::kByte);
  e.rng.tokens.emplace_back(token, std::move(generator));
  return token;
}

}  // namespace

Engine::RngSnapshot Engine::host_rng_snapshot() const {
  RngSnapshot s;
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    s.cpu_state = cpu.get_state();
  }
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  s.cuda_seed = gen.current_seed();
  s.cuda_offset = gen.get_offset();
  return s;
}

// Called after each capture: a callable that seeded a generator or drew
// host-side random numbers did so once, at capture, and replays would not.
void Engine::check_host_rng_untouched(const RngSnapshot& before) const {
  const RngSnapshot after = host_rng_snapshot();
  TORCH_CHECK(before.cuda_seed == after.cuda_seed && before.cuda_offset == after.cuda_offset &&
                  at::equal(before.cpu_state, after.cpu_state),
              "cgraph: random generator state changed during capture.");
}

void Engine::rng_warmup_begin() {
  rng_owner = this;
  rng.phase = RngPhase::Warmup;
  rng.warmup_offsets.clear();
  rng.warmup_start = default_generator(device).get_offset();
}

// The last warm-up call counts: the first may compile (torch.compile reads
// and restores the RNG state while it traces), later ones run as captured.
void Engine::rng_warmup_end() {
  rng_owner = nullptr;
  rng.phase = RngPhase::Off;
  rng.entry_offsets = rng.warmup_offsets;
  rng.forward_increment = default_generator(device).get_offset() - rng.warmup_start;
}

void Engine::check_rng_regions_entered() const {
  TORCH_CHECK(rng.entered == rng.entry_offsets.size(), "cgraph: the callable asked for the "
              "CUDA RNG state ", rng.entered, " time(s) during capture but ",
              rng.entry_offsets.size(), " time(s) in its last warm-up call, so checkpointed "
              "regions cannot be matched to their random streams. Make RNG use the same on "
              "every call; if the first call compiles (torch.compile), use num_warmup_iters >= 2.");
}

void Engine::rng_capture_begin(cg_pass pass) {
  Graph& g = pass == CG_FORWARD ? *fwd : *bwd;
  if (pass == CG_FORWARD && rng.states.size() != rng.entry_offsets.size()) {
    rng.states.clear();
    rng.generators.clear();
    for (size_t k = 0; k < rng.entry_offsets.size(); ++k) {
      auto state = c10::make_intrusive<at::CUDAGeneratorState>();
      rng.generators.push_back(at::make_generator<at::CUDAGeneratorImpl>(device, state));
      rng.states.push_back(std::move(state));
    }
  }
  for (size_t k = 0; k < rng.states.size(); ++k) {
    register_region(g, rng.generators[k], rng.states[k], 0);
  }
  rng.host_before = host_rng_snapshot();
  rng.default_state = default_generator(device).graphsafe_get_state();
  rng.entered = 0;
  rng.phase = pass == CG_FORWARD ? RngPhase::Forward : RngPhase::Backward;
  rng_owner = this;
}

void Engine::rng_capture_end() noexcept {
  Engine* self = this;
  rng_owner.compare_exchange_strong(self, nullptr);
  if (rng.phase == RngPhase::Backward) {
    rng.tokens.clear();  // forward tokens live until their recomputes are captured
  }
  rng.phase = RngPhase::Off;
  if (rng.default_state.defined()) {
    try {
      default_generator(device).graphsafe_set_state(rng.default_state);
    } catch (const std::exception& err) {
      TORCH_WARN("cgraph: could not restore the CUDA generator after capture: ", err.what());
    }
    rng.default_state = at::Generator();
  }
}

void Engine::rng_before_forward_replay() {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  rng.replay_seed = gen.current_seed();
  rng.replay_base = gen.get_offset();
  for (size_t k = 0; k < rng.generators.size(); ++k) {
    rng.generators[k].set_current_seed(rng.replay_seed);
    rng.generators[k].set_offset(rng.replay_base + rng.entry_offsets[k]);
  }
}

void Engine::rng_after_forward_replay() {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_offset(rng.replay_base + rng.forward_increment);
}

void Engine::rng_before_backward_replay() {
  for (size_t k = 0; k < rng.generators.size(); ++k) {
    rng.generators[k].set_current_seed(rng.replay_seed);
    rng.generators[k].set_offset(rng.replay_base + rng.entry_offsets[k]);
  }
}

}  // namespace cgraph

using cgraph::Engine;
using cgraph::RngPhase;

extern "C" {

PyObject* cg_rng_get_state(int device) {
  HANDLE_TH_ERRORS
  Engine* e = cgraph::rng_owner;
  if (!e || e->device != device) {
    Py_RETURN_NONE;
  }
  switch (e->rng.phase) {
    case RngPhase::Warmup:
      e->rng.warmup_offsets.push_back(cgraph::default_generator(e->device).get_offset() -
                                      e->rng.warmup_start);
      Py_RETURN_NONE;  // torch answers
    case RngPhase::Forward: {
      const size_t k = e->rng.entered++;
      TORCH_CHECK(k < e->rng.generators.size(), "cgraph: the callable asked for the CUDA RNG "
                  "state more often during capture than during warm-up.");
      cgraph::default_generator(e->device).graphsafe_set_state(e->rng.generators[k]);
      return THPVariable_Wrap(cgraph::issue_token(*e, e->rng.generators[k]));
    }
    case RngPhase::Backward:
      return THPVariable_Wrap(
          cgraph::issue_token(*e, cgraph::default_generator(e->device).graphsafe_get_state()));
    default:
      Py_RETURN_NONE;
  }
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

int cg_rng_set_state(PyObject* state, int device) {
  HANDLE_TH_ERRORS
  Engine* e = cgraph::rng_owner;
  if (!e || e->device != device || !THPVariable_Check(state) ||
      (e->rng.phase != RngPhase::Forward && e->rng.phase != RngPhase::Backward)) {
    return 0;
  }
  const c10::TensorImpl* impl = THPVariable_Unpack(state).unsafeGetTensorImpl();
  for (const auto& [token, generator] : e->rng.tokens) {
    if (token.unsafeGetTensorImpl() == impl) {
      cgraph::default_generator(e->device).graphsafe_set_state(generator);
      return 1;
    }
  }
  TORCH_CHECK(false, "cgraph: torch.cuda.set_rng_state during capture with a state that was "
              "not taken during this capture. A graph cannot restore a host-side RNG state: "
              "set it outside the graphed callable.");
  END_HANDLE_TH_ERRORS_RET(-1)
}

}  // extern "C"
