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
//      set_rng_state(token) in the same capture (fork_rng's exit, or a whole
//      training step's recompute: Note [RNG inside a graphed step] in
//      cgraph/_step.py) switches to region k's second state, which starts
//      at the region's start again, as eager's restored state does;
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
#include <ATen/cuda/CUDAGeneratorImpl.h>

#include <atomic>

namespace cgraph {
namespace {

// The engine warming up or capturing, if any.  Not thread-local: the
// backward capture runs checkpoint's recompute (and so the RNG hooks) on
// the autograd engine's device thread.  Set only while the engine's
// set-up state exists.
std::atomic<EngineRng*> rng_owner{nullptr};

at::Generator default_generator(c10::DeviceIndex device) {
  return at::cuda::detail::getDefaultCUDAGenerator(device);
}

// Registers region k's state with a graph, before its capture.  torch 2.11
// registers a state on both sides (graph and state) only through the
// Generator overload; later releases have only the state overload.
template <class G>
auto register_stream(G& graph, const RngStream& stream, int)
    -> decltype(graph.register_generator_state(stream.generator), void()) {
  graph.register_generator_state(stream.generator);
}
template <class G>
void register_stream(G& graph, const RngStream& stream, long) {
  graph.register_generator_state(stream.state);
}

RngStream make_stream(c10::DeviceIndex device) {
  RngStream stream;
  stream.state = c10::make_intrusive<at::CUDAGeneratorState>();
  stream.generator = at::make_generator<at::CUDAGeneratorImpl>(device, stream.state);
  return stream;
}

// Both of a region's streams start where eager mode would be at its start.
void seed_region(RngRegion& region, uint64_t seed, uint64_t base) {
  for (RngStream* stream : {&region.drawn, &region.again}) {
    stream->generator.set_current_seed(seed);
    stream->generator.set_offset(base + region.entry_offset);
  }
}

// A CPU byte tensor that stands for `generator` until capture ends.
at::Tensor issue_token(RngSetup& rng, at::Generator generator) {
  at::Tensor token = at::zeros({16}, at::kByte);
  rng.tokens.emplace_back(token, std::move(generator));
  return token;
}

// The regions' states, made at the forward capture: one per region the
// last warm-up call entered.
std::vector<RngRegion> make_regions(c10::DeviceIndex device,
                                    const std::vector<uint64_t>& entry_offsets) {
  std::vector<RngRegion> regions;
  for (const uint64_t offset : entry_offsets) {
    RngRegion region;
    region.drawn = make_stream(device);
    region.again = make_stream(device);
    region.entry_offset = offset;
    regions.push_back(std::move(region));
  }
  return regions;
}

}  // namespace

RngSnapshot EngineRng::host_snapshot() const {
  RngSnapshot s;
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    s.cpu_state = cpu.get_state();
  }
  at::Generator gen = default_generator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  s.cuda_seed = gen.current_seed();
  s.cuda_offset = gen.get_offset();
  return s;
}

// Called after each capture: a callable that seeded a generator or drew
// host-side random numbers did so once, at capture, and replays would not.
void EngineRng::check_host_untouched() const {
  const RngSnapshot& before = setup_->host_before;
  const RngSnapshot after = host_snapshot();
  if (before.cuda_seed != after.cuda_seed || before.cuda_offset != after.cuda_offset ||
      !at::equal(before.cpu_state, after.cpu_state)) {
    throw Refusal(CG_FAILURE_RNG_CHANGED, "cgraph: random generator state changed during capture.");
  }
}

void EngineRng::warmup_begin() {
  rng_owner = this;
  setup_->phase = RngPhase::Warmup;
  setup_->warmup_offsets.clear();
  setup_->warmup_start = default_generator(device_).get_offset();
}

// The last warm-up call counts: the first may compile (torch.compile reads
// and restores the RNG state while it traces), later ones run as captured.
void EngineRng::warmup_end() {
  rng_owner = nullptr;
  RngSetup& r = *setup_;
  r.phase = RngPhase::Off;
  r.entry_offsets = r.warmup_offsets;
  forward_increment_ = default_generator(device_).get_offset() - r.warmup_start;
}

void EngineRng::warmed_up_elsewhere(std::vector<uint64_t> entry_offsets, uint64_t increment) {
  setup_->entry_offsets = std::move(entry_offsets);
  forward_increment_ = increment;
}

void EngineRng::check_regions_entered() const {
  const RngSetup& r = *setup_;
  if (r.entered != r.entry_offsets.size()) {
    throw Refusal(CG_FAILURE_RNG_REGIONS,
                  "cgraph: the callable asked for the CUDA RNG state " +
                      std::to_string(r.entered) + " time(s) during capture but " +
                      std::to_string(r.entry_offsets.size()) +
                      " time(s) in its last warm-up call, so checkpointed regions cannot be "
                      "matched to their random streams.");
  }
}

void EngineRng::capture_begin(Graph& graph, cg_pass pass) {
  RngSetup& r = *setup_;
  if (pass == CG_FORWARD && regions_.size() != r.entry_offsets.size()) {
    regions_ = make_regions(device_, r.entry_offsets);
  }
  for (RngRegion& region : regions_) {
    register_stream(graph, region.drawn, 0);
    register_stream(graph, region.again, 0);
    region.set_back = false;
  }
  r.host_before = host_snapshot();
  r.default_state = default_generator(device_).graphsafe_get_state();
  r.entered = 0;
  r.phase = pass == CG_FORWARD ? RngPhase::Forward : RngPhase::Backward;
  rng_owner = this;
}

void EngineRng::capture_end() noexcept {
  EngineRng* self = this;
  rng_owner.compare_exchange_strong(self, nullptr);
  if (!setup_) {
    return;
  }
  RngSetup& r = *setup_;
  if (r.phase == RngPhase::Backward) {
    r.tokens.clear();  // forward tokens live until their recomputes are captured
  }
  r.phase = RngPhase::Off;
  if (r.default_state.defined()) {
    try {
      default_generator(device_).graphsafe_set_state(r.default_state);
    } catch (const std::exception& err) {
      TORCH_WARN("cgraph: could not restore the CUDA generator after capture: ", err.what());
    }
    r.default_state = at::Generator();
  }
}

void EngineRng::before_forward_replay() {
  at::Generator gen = default_generator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  seed_ = gen.current_seed();
  base_ = gen.get_offset();
  for (RngRegion& region : regions_) {
    seed_region(region, seed_, base_);
  }
}

void EngineRng::after_forward_replay() {
  at::Generator gen = default_generator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_offset(base_ + forward_increment_);
}

void EngineRng::before_backward_replay() {
  for (RngRegion& region : regions_) {
    seed_region(region, seed_, base_);
  }
}

std::optional<at::Tensor> rng_get_state(c10::DeviceIndex device) {
  EngineRng* e = rng_owner;
  if (!e || e->device_ != device) {
    return std::nullopt;
  }
  RngSetup& r = *e->setup_;
  switch (r.phase) {
    case RngPhase::Warmup:
      r.warmup_offsets.push_back(default_generator(device).get_offset() - r.warmup_start);
      return std::nullopt;  // torch answers
    case RngPhase::Forward: {
      const size_t k = r.entered++;
      if (k >= e->regions_.size()) {
        throw Refusal(CG_FAILURE_RNG_REGIONS, "cgraph: the callable asked for the CUDA RNG "
                      "state more often during capture than during warm-up.");
      }
      default_generator(device).graphsafe_set_state(e->regions_[k].drawn.generator);
      return issue_token(r, e->regions_[k].drawn.generator);
    }
    case RngPhase::Backward:
      return issue_token(r, default_generator(device).graphsafe_get_state());
    default:
      return std::nullopt;
  }
}

// A forward capture setting back a state its region drew from: the region's
// `again` stream, which starts where the region did (Note [RNG inside a
// graphed step]).  Once per region and capture: a second set-back would
// start where the first one's draws went on.  Other states stay as they are.
at::Generator EngineRng::set_back(const at::Generator& generator) {
  for (RngRegion& region : regions_) {
    if (region.drawn.generator.unsafeGetGeneratorImpl() != generator.unsafeGetGeneratorImpl()) {
      continue;
    }
    if (region.set_back) {
      throw Refusal(CG_FAILURE_RNG_REGIONS, "cgraph: the callable set the CUDA RNG state back "
                    "to one it took twice within one capture, which a graph cannot replay.");
    }
    region.set_back = true;
    return region.again.generator;
  }
  return generator;
}

bool rng_set_state(const at::Tensor& state, c10::DeviceIndex device) {
  EngineRng* e = rng_owner;
  if (!e || e->device_ != device) {
    return false;
  }
  RngSetup& r = *e->setup_;
  if (r.phase != RngPhase::Forward && r.phase != RngPhase::Backward) {
    return false;
  }
  for (const auto& [token, generator] : r.tokens) {
    if (token.unsafeGetTensorImpl() == state.unsafeGetTensorImpl()) {
      default_generator(device).graphsafe_set_state(
          r.phase == RngPhase::Forward ? e->set_back(generator) : generator);
      return true;
    }
  }
  throw Refusal(CG_FAILURE_RNG_CHANGED, "cgraph: torch.cuda.set_rng_state during capture with "
                "a state that was not taken during this capture. A graph cannot restore a "
                "host-side RNG state: set it outside the graphed callable.");
}

}  // namespace cgraph
