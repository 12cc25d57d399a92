// aten_engine.hpp -- the C++ half's engine: one graphed callable's graphs and
// the records of what they read and write.  Internal: only csrc/aten_*.cpp
// include it; the C half sees cgraph.h alone.
//
// The files of the C++ half, in the order of the lifecycle:
//   aten_entry.cpp             every extern "C" function of cgraph.h, thin wrappers
//   aten_setup.cpp             construction, grad accumulators set aside, the
//                              set-up session, warm-up in a pool, finish_setup
//   aten_workspace.cpp         the cuBLAS workspace graphs share with eager mode
//   aten_warmup.cpp            warm-up backward, hidden leaves, run_backward
//   aten_capture.cpp           forward capture: begin, end, abandon, outputs
//   aten_capture_backward.cpp  backward capture: incoming grads, grad stores, tails
//   aten_graph.cpp             a Graph's capture (aten_graph.hpp)
//   aten_graph_nodes.cpp       the nodes a replay sets in a Graph, and its launch
//   aten_replay.cpp            the forward replay (the hot path), held outputs
//                              and input grads
//   aten_backward.cpp          the backward node and its replay, grad stores
//   aten_pool.cpp              the captures that share a pool: PoolLedger,
//                              PoolMember, and when a replay may run
//   aten_rng.cpp               random numbers in warm-up, capture and replay
//   aten_accumulators.cpp      grad accumulators moved for a whole-step capture
//   aten_lend.cpp              storages lent fixed memory (FSDP2's parameters)
//   aten_inspect.cpp           what a captured graph is made of
//   aten_checks.cpp            the switch of the debug checks (Note [Checked
//                              invariants]) and the faults tests plant
//   aten_reset.cpp             reset and destruction
//   tensor_lists.cu            one-launch copies and adds of tensor lists
//
// Who writes what.  The records with private state are written by their own
// methods only, each in one file: PoolMember (aten_pool.cpp), HandedOut
// (aten_replay.cpp), EngineRng (aten_rng.cpp), SetupState (aten_setup.cpp),
// CapturedBackward (aten_capture_backward.cpp), Graph (aten_graph.cpp,
// aten_graph_nodes.cpp).
// The Engine's identity is const; `alive()` changes in reset() alone
// (aten_reset.cpp).  Its other fields are written at capture (aten_capture.cpp,
// aten_capture_backward.cpp, aten_warmup.cpp) and, after capture, only by:
// Input::handed and `generation` in aten_replay.cpp; latest_node in
// aten_pool.cpp (under the ledger's mutex); the static tensors, swapped for
// non-owning views once nothing reads them (outputs once their readers have
// captured, input grads at their capture, the rest once their pass is
// over) and Input::owner set, in aten_pool.cpp; everything, at reset, in
// aten_reset.cpp; `stats` by the path each counter counts.  The static
// tensors (Input, Param, Output) stay the engine's, not a record's: capture
// makes them, the pool's rules swap their memory, replays hand them out, so
// a record of their own would have to open its writes to those three files
// anyway.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "aten_graph.hpp"
#include "cgraph.h"

namespace cgraph {

// torch 2.14 made autograd nodes intrusive_ptr-owned; earlier releases use
// shared_ptr.  Take whichever this torch's Edge holds, so nothing below names
// a torch version.
using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);

// A weak reference to a node, of the kind torch's AutogradMeta keeps.
using WeakNodePtr = decltype(torch::autograd::AutogradMeta::grad_accumulator_);

template <class T, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// Releases the GIL for the lifetime of the object.  Used around calls that
// wait on the autograd engine, whose worker threads may need the GIL to run
// Python backward code (custom Functions, hooks).
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease() { PyEval_RestoreThread(state_); }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

// One of cgraph's own checks refusing what a callable did during set-up.
// A c10::Error, so that HANDLE_TH_ERRORS raises it with its message, that
// also says which check refused: Note [Capture failures] in capture.c.
class Refusal : public c10::Error {
 public:
  Refusal(cg_failure kind, const std::string& message);
  cg_failure kind;
};

// ---- checked invariants: Note [Checked invariants] (aten_checks.cpp) ------

// Whether the checks that walk a pool or every held tensor run: CGRAPH_DEBUG=1
// in the environment at import, or cgraph._C._debug(True).  Inline, one
// relaxed load: the replay path asks it a few times per call.
extern std::atomic<bool> debug_switch;  // aten_checks.cpp
inline bool debug_checks() {
  return debug_switch.load(std::memory_order_relaxed);
}

// Faults a test plants to show that a check fires (cgraph._C._debug(True,
// fault)); each is honoured only while debug_checks() is on.
enum class Fault : uint8_t {
  None,
  // release_later_outputs moves nothing: outputs and grads of later graphs
  // stay where the replay writes.
  SkipLaterMoves,
};
Fault planted_fault();  // aten_checks.cpp
inline bool planted(Fault fault) {
  return C10_UNLIKELY(debug_checks()) && planted_fault() == fault;
}
// Turns the debug checks on or off and plants the fault named `fault`
// (nullptr or "": none).  False, changing nothing, for an unknown name.
bool set_debug(bool on, const char* fault);

// A rule of the Notes found broken: a bug in cgraph.  A c10::Error, so that
// HANDLE_TH_ERRORS raises it (RuntimeError "cgraph invariant: ..."); code
// that turns other errors into warnings lets it through.
class InvariantError : public c10::Error {
 public:
  InvariantError(const std::string& rule, const char* file, uint32_t line);
};

// A rule of the Notes that is cheap to check: checked always.
#define CG_INVARIANT(cond, ...)                                                   \
  do {                                                                           \
    if (C10_UNLIKELY(!(cond))) {                                                 \
      throw ::cgraph::InvariantError(c10::str(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                            \
  } while (0)
// A rule whose check walks a pool or every held tensor: only under
// debug_checks().  `cond` is not evaluated otherwise.
#define CG_DEBUG_INVARIANT(cond, ...)                                            \
  do {                                                                           \
    if (C10_UNLIKELY(::cgraph::debug_checks())) {                                \
      CG_INVARIANT(cond, __VA_ARGS__);                                           \
    }                                                                            \
  } while (0)

// ---- the records --------------------------------------------------------

// One static input: a tensor leaf of the sample arguments.
struct Input {
  at::Tensor buffer;           // the sample: the forward graph reads it, as in torch
  std::string name;            // for errors: 'x', "batch['mask']"
  bool requires_grad = false;  // at capture: the backward graph computes its grad
  SlotId copy;                 // the forward graph's copy-in slot for it
  at::Tensor grad;             // the backward graph's output for it, if requires_grad
  // What autograd gets for it: a tensor over `grad` with a storage of its
  // own, handed out again while nobody else holds it (Note [Grads handed to
  // autograd], aten_replay.cpp).
  at::Tensor handed;
  // The buffer is another graph's static output, read in place: a call must
  // pass that memory itself (Note [A layer reading the one before it in
  // place], aten_pool.cpp).
  bool in_place = false;
  // Where the sample is a non-owning view of another graph's static output
  // (static_output_in: the spec keeps the sample, and must not keep the
  // memory), what keeps that output allocated from before the capture until
  // it is freed with the output (Notes [Static memory freed once its pass is
  // over] and [An output freed once its reader has captured]).
  at::Tensor owner;
  // For an input read in place: the storage of the view its forward capture
  // passed the callable instead of the sample (Engine::capture_inputs), held
  // weakly until the backward capture starts; and whether anything kept
  // that view then (note_capture_views_kept), when all the backward will
  // read is alive: Note [An output freed once its reader has captured]
  // (aten_pool.cpp).
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> capture_view;
  bool kept_by_capture = true;
  // The forward writes the buffer in place (a cache filled inside it): each
  // replay copies it back into the argument passed (Note [Arguments written
  // in place], aten_replay.cpp).  `version`: the buffer's version counter as
  // the forward capture began.
  bool written = false;
  int64_t version = 0;
};

// The captures into one memory pool and their engines: Note [Captures that
// share a pool] (aten_pool.cpp).
struct PoolLedger;

// A parameter's grad store: what the backward graphs of that parameter write
// its grad into and what is handed out as param.grad (Note [Parameter
// gradients], aten_backward.cpp), shared by every graph that writes it (Note
// [One grad store per parameter], aten_capture_backward.cpp).  Its methods
// live in aten_backward.cpp.
struct GradStore {
  // The memory: a pool store is the grad its first backward graph computes,
  // kept allocated in that graph's pool; a regular store (kept_outputs=
  // 'alias', or a layer captured one by one into a shared pool) a regular
  // allocation made before the capture.
  at::Tensor memory;
  // The backward capture (the pool's number for it) that allocated a pool
  // store; only graphs of its pool captured before it, and that backward
  // graph, write that memory other than through a tail.  0: a regular store.
  uint64_t allocated_at = 0;
  // A pool store's param.grad: a tensor with a storage of its own over the
  // memory, handed out again while it stays there, moved to memory of its
  // own before a replay overwrites it while held.  Undefined until then.
  at::Tensor handed;
  // A pool store's pool, set after its capture: it numbers the pool's later
  // captures even once no engine is left.
  std::shared_ptr<PoolLedger> ledger;

  GradStore(at::Tensor memory, uint64_t allocated_at);
  ~GradStore();  // moves a handed grad still held: nothing protects it after
  GradStore(const GradStore&) = delete;
  GradStore& operator=(const GradStore&) = delete;

  bool in_pool() const { return allocated_at != 0; }
  // What param.grad is set to when the memory holds the grad.
  const at::Tensor& hand_out();
  // Whether `grad` is what was handed out and still lies in the memory: the
  // add tail may add into it.
  bool handed_as(const at::Tensor& grad) const;
  // Whether nobody but cgraph holds the memory: the copy tail may write it.
  bool unheld() const;
  // Whether a graph other than the one that computes it in place may write
  // the memory now, given the pool's earliest_pending_forward().
  bool writable_by_others(uint64_t earliest_pending) const {
    return !in_pool() || earliest_pending > allocated_at;
  }
  // Whether anybody but cgraph may hold what was handed out (cheap).
  bool may_be_held() const;
  // Whether a handed grad lies in the memory and somebody holds it: what
  // release() moves (exact, not cheap).
  bool held_by_others() const;
  // Before a replay that writes the memory: a handed grad still held gets
  // memory of its own.  Returns whether one was moved.
  bool release();
};

// One parameter: a module parameter, or another leaf requiring grad that the
// forward reads (a tensor in a closure; Engine::adopt_hidden_leaves).
struct Param {
  at::Tensor tensor;
  const void* data = nullptr;  // at capture: a parameter moved since is stale
  bool requires_grad = false;  // at capture
  // A NON-OWNING view of the backward graph's grad for it: the store's
  // memory where this engine owns the store, else pool memory that later
  // graphs reuse, so it holds the grad only between the backward replay and
  // the next graph's.  Undefined where no grad flows.
  at::Tensor grad;
  // Null where no grad flows.
  std::shared_ptr<GradStore> store;
  // This engine's backward graph computes the grad in the store's memory
  // (it allocated the store); else its tails copy or add into the store.
  bool owns_store = false;
};

// The grad store other graphs made for `param`, read on `stream`, if one
// is alive: a regular one, or one in a pool (aten_capture_backward.cpp).
std::shared_ptr<GradStore> grad_store_for(const at::Tensor& param,
                                          const c10::cuda::CUDAStream& stream, bool regular);
// Makes `store` the one later graphs of `param` on `stream` share.
void share_grad_store(const at::Tensor& param, const c10::cuda::CUDAStream& stream,
                      const std::shared_ptr<GradStore>& store);
// Forgets the stores no graph holds any more (aten_capture_backward.cpp).
void prune_grad_stores();

// Gives a storage that lies in graph memory memory of its own on `device`,
// with the value it has (aten_replay.cpp).
void move_to_own_memory(c10::DeviceIndex device, c10::StorageImpl& storage);
// A tensor over `t`'s memory with a StorageImpl of its own, which keeps that
// memory alive (aten_replay.cpp).
at::Tensor guarded_alias(const at::Tensor& t);
// A view of `t`'s memory that does not keep it alive, and whether `t` is
// one (aten_capture_backward.cpp).
at::Tensor non_owning_view(const at::Tensor& t);
bool is_non_owning_view(const at::Tensor& t);
// Whether nobody changed what such an alias of `t` is since it was made
// (resize_, set_, requires_grad_), so it may be handed out again.
bool still_alias_of(const at::Tensor& alias, const at::Tensor& t);
// stores[j] = sources[j], or += with `add`, enqueued on the current stream:
// recorded as a tail inside a capture, launched outside one.  tensor_lists.cu
// takes the copy, or the adds of each dtype, in one launch; what it cannot
// take, ATen's foreach ops (aten_capture_backward.cpp).
void launch_list(bool add, const std::vector<at::Tensor>& stores,
                 const std::vector<at::Tensor>& sources);
// Whether the interpreter is shutting down, when nothing replays any more
// and CUDA may be gone (aten_reset.cpp).
bool interpreter_finalizing();  // or exiting: Note [Resets at exit], aten_reset.cpp
void note_exiting() noexcept;

// The ways the backward graph fills its buffer for one incoming grad itself:
// Note [Incoming grads] (aten_backward.cpp).
struct GradIn {
  at::Tensor buffer;    // the backward graph reads the grad here; not owned
                        // once captured: a temporary of the graph
  SlotId copy;          // the grad, when a memcpy copies it
  SlotId element;       // `scalar` = the grad's one element ...
  SegmentId broadcast;  // ... then buffer = scalar, everywhere
  SegmentId zero;       // buffer = 0, when no grad flowed
  at::Tensor scalar;    // one element, in the graph pool
};

// One static output: a tensor leaf of what the forward returned.
struct Output {
  at::Tensor buffer;
  bool requires_grad = false;
  std::optional<GradIn> grad_in;  // when requires_grad and a backward graph exists
};

// What an engine handed to its callers and still watches, weakly: the
// latest call's outputs (Note [Outputs of earlier calls]) and the input
// grads whose Input::handed was replaced while somebody held them (Note
// [Grads handed to autograd]).  Private state, written only by its methods,
// all in aten_replay.cpp.  Not locked: graphs of one pool replay on one
// thread at a time.
class HandedOut {
 public:
  void watch_output(const at::Tensor& out);
  void watch_replaced_grad(const at::Tensor& grad);
  bool has_outputs() const { return !outputs_.empty(); }
  bool has_replaced_grads() const { return !grads_.empty(); }
  // Before a replay overwrites them: the outputs still alive get memory of
  // their own (CG_KEEP_COPY) or are made unreadable (CG_KEEP_ERROR).
  void release_outputs(cg_kept_outputs policy, c10::DeviceIndex device, cg_stats& stats);
  // Likewise the replaced grads held by anybody but `consumed`.
  void release_replaced_grads(at::ArrayRef<at::Tensor> consumed, c10::DeviceIndex device,
                              cg_stats& stats);
  // Note [Checked invariants]: whether a watched output still lies in
  // `statics`' memory, or a replaced grad is held by anybody but `consumed`.
  bool outputs_lie_in(const std::vector<Output>& statics) const;
  bool replaced_grads_held(at::ArrayRef<at::Tensor> consumed) const;
  void forget() noexcept;  // at reset

 private:
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> outputs_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> grads_;
};

// Where a backward node's next edge gets its grad from.
struct EdgeSource {
  enum class Kind : uint8_t {
    Input,          // an input the backward graph differentiates
    Param,          // a parameter with hooks: Note [Parameter gradients]
    UngradedInput,  // an input that requires grad although its sample did not
  };
  Kind kind;
  uint32_t index;  // into Engine::inputs or Engine::params
};

// The autocast state a graph was captured under: it replays those casts.
struct Autocast {
  bool enabled = false;
  at::ScalarType dtype = at::kHalf;
  static Autocast current();
  bool operator==(const Autocast& other) const {
    return enabled == other.enabled && (!enabled || dtype == other.dtype);
  }
  std::string describe() const;
};

// What the backward capture made besides the graph: whether there is a
// backward at all, and the parameter-grad tails (Note [Parameter gradients],
// aten_backward.cpp).  Private state, written only by its methods, in
// aten_capture_backward.cpp.
class CapturedBackward {
 public:
  bool exists() const { return exists_; }  // false when no output requires grad
  // The optional segments that end the graph: stores = grads, stores += grads.
  SegmentId tail_copy() const { return tail_copy_; }
  SegmentId tail_add() const { return tail_add_; }
  size_t num_grad_params() const { return num_grad_params_; }  // with a grad at capture

  void note_exists(bool exists);
  void note_tails(SegmentId copy, SegmentId add, size_t num_grad_params);

 private:
  bool exists_ = false;
  SegmentId tail_copy_;
  SegmentId tail_add_;
  size_t num_grad_params_ = 0;
};

// ---- random numbers: Note [RNG in checkpointed regions] (aten_rng.cpp) ---

// A graph-safe generator state, registered with the engine's graphs, and a
// generator over it.
struct RngStream {
  c10::intrusive_ptr<at::CUDAGeneratorState> state;
  at::Generator generator;
};

// One checkpointed region's random stream, replayed from where eager mode
// would be at the region's start: `drawn` is what the region draws from
// after get_rng_state; `again` starts there once more when the state is set
// back within the same capture (a whole step's recompute, fork_rng's exit):
// Note [RNG inside a graphed step] (cgraph/_step.py).
struct RngRegion {
  RngStream drawn;
  RngStream again;
  bool set_back = false;      // `again` taken in this capture
  uint64_t entry_offset = 0;  // from the forward's start to the region's
};

enum class RngPhase { Off, Warmup, Forward, Backward };

struct RngSnapshot {
  at::Tensor cpu_state;
  uint64_t cuda_seed = 0;
  uint64_t cuda_offset = 0;
};

// What warm-up and capture need.
struct RngSetup {
  RngPhase phase = RngPhase::Off;
  uint64_t warmup_start = 0;
  std::vector<uint64_t> warmup_offsets;  // this warm-up call's, so far
  std::vector<uint64_t> entry_offsets;   // the last warm-up call's
  at::Generator default_state;           // the default generator's own, during capture
  size_t entered = 0;                    // regions entered so far in the forward capture
  std::vector<std::pair<at::Tensor, at::Generator>> tokens;  // handed out as RNG states
  RngSnapshot host_before;               // host generators before this capture
};

// An engine's random numbers.  Its state is private and written only by its
// methods, all in aten_rng.cpp, and by the RNG hooks there
// (rng_get_state, rng_set_state).
class EngineRng {
 public:
  explicit EngineRng(c10::DeviceIndex device) : device_(device) {}

  // -- warm-up and capture; none after finish_setup()
  void warmup_begin();
  void warmup_end();
  // What a warm-up would have noted, from an eager run outside cgraph (a
  // training step's): where it asked for the RNG state, how far it moved it.
  void warmed_up_elsewhere(std::vector<uint64_t> entry_offsets, uint64_t increment);
  void capture_begin(Graph& graph, cg_pass pass);
  void capture_end() noexcept;        // also when the capture failed
  void check_host_untouched() const;  // after each capture: throws a Refusal
  void check_regions_entered() const;  // after the forward capture: likewise
  void finish_setup() { setup_.reset(); }

  // -- replay (the hot path: callables with no checkpointed region skip it)
  bool has_regions() const { return !regions_.empty(); }
  void before_forward_replay();
  void after_forward_replay();
  void before_backward_replay();

 private:
  friend std::optional<at::Tensor> rng_get_state(c10::DeviceIndex device);
  friend bool rng_set_state(const at::Tensor& state, c10::DeviceIndex device);
  RngSnapshot host_snapshot() const;
  at::Generator set_back(const at::Generator& generator);

  c10::DeviceIndex device_;
  std::vector<RngRegion> regions_;
  uint64_t forward_increment_ = 0;  // how far one eager forward moves the stream
  uint64_t seed_ = 0;               // the latest forward replay's seed and base
  uint64_t base_ = 0;
  std::unique_ptr<RngSetup> setup_ = std::make_unique<RngSetup>();  // until finish_setup
};

// ---- set-up state, freed when capture completes ------------------------------

// What warm-up and capture change of the caller's state and must put back.
// Private state, written only by its methods, all in aten_setup.cpp.
// Destroyed unfinished (a warm-up or capture that failed, an engine whose
// construction threw), it puts back what it holds: Note [A set-up puts back
// what it changed] (aten_setup.cpp).
class SetupState {
 public:
  SetupState() = default;
  SetupState(const SetupState&) = delete;
  SetupState& operator=(const SetupState&) = delete;
  ~SetupState();
  // Sets each parameter's own grad accumulator, tensor hooks and
  // post-accumulate-grad hooks aside: Note [Grad accumulators during
  // capture] (aten_setup.cpp).
  void set_aside_grad_accumulators(const std::vector<Param>& params);
  // Hooks registered on a tensor held aside since it went aside (by the
  // forward, on its first call) join what is held: called before each
  // backward of the set-up.
  void hold_hooks_added_meanwhile();
  void restore_grad_accumulators() noexcept;
  // Module state that warm-up changes (BatchNorm's running stats): saved
  // now, put back (once) by restore_buffers().
  void save_buffers(std::vector<at::Tensor> buffers);
  void restore_buffers();

 private:
  using PostAccHookPtr = std::unique_ptr<torch::autograd::PostAccumulateGradHook>;
  using TensorHooks = std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>;
  using NodePostHooks = std::vector<std::unique_ptr<torch::autograd::FunctionPostHook>>;
  // One tensor held aside, and everything taken off it and its accumulator.
  struct AsideParam {
    at::Tensor param;
    WeakNodePtr accumulator = WeakNodePtr(NodePtr());
    TensorHooks hooks;  // register_hook's: AccumulateGrad reads them off the tensor
    PostAccHookPtr post_acc_hooks;
    // The accumulator node's own hooks (its register_prehook and
    // register_hook: DDP's reducer, _apply_optimizer_in_backward).
    TensorHooks node_pre_hooks;
    NodePostHooks node_post_hooks;
  };
  static void take_hooks(AsideParam& aside);
  std::vector<AsideParam> aside_;
  struct BufferSnapshot {
    at::Tensor buffer;
    at::Tensor saved;
  };
  std::vector<BufferSnapshot> buffers_;
};

// ---- the engine -----------------------------------------------------------

struct Engine;

// An engine's place among the captures of its pool: Note [Captures that
// share a pool] (aten_pool.cpp).  Its state is private and written only by
// its own methods, all in aten_pool.cpp; the other files read it.
class PoolMember {
 public:
  explicit PoolMember(bool keep_activations) : keep_activations_(keep_activations) {}

  // Note [Layers captured one by one into one pool] (aten_pool.cpp).
  bool keeps_activations() const { return keep_activations_; }
  // The pool's number of `pass`'s capture; 0 before it.
  uint64_t captured_at(cg_pass pass) const { return captured_at_[pass]; }
  // The pool's ledger, from the first capture on.
  const std::shared_ptr<PoolLedger>& ledger() const { return ledger_; }
  // Whether capture number `at` ran while the engine's activations were
  // allocated (so it did not take their memory).
  bool activations_span(uint64_t at) const {
    return captured_at_[CG_FORWARD] < at && at < released_at_;
  }
  // Whether the activations it kept were released (its pass is over).
  bool released_kept() const { return released_at_ != 0 && released_at_ != UINT64_MAX; }
  bool holds_activations() const { return !kept_history_.empty(); }
  // Whether static memory of the engine was freed for later captures (before
  // capture number `at`): Notes [Static memory freed once its pass is over]
  // and [An output freed once its reader has captured].
  bool freed_statics() const { return statics_freed_at_ != UINT64_MAX; }
  bool freed_statics_before(uint64_t at) const { return statics_freed_at_ < at; }
  // Whether its input grads may have been freed for later captures (before
  // capture number `at`): at its backward capture (Note [Input grads freed
  // at their capture]), or when any of its static memory was freed once its
  // pass was over.
  bool freed_grads() const { return grads_freed_at() != UINT64_MAX; }
  bool freed_grads_before(uint64_t at) const { return grads_freed_at() < at; }

  // At each capture's start: numbers it, and enters `engine` in the ledger
  // of `pool` at its forward capture.
  void note_capture(Engine& engine, at::cuda::MempoolId_t pool, cg_pass pass);
  // At the backward capture, with keep_activations: an output's autograd
  // node, which holds the activations allocated until released.
  void keep_history(NodePtr node);
  // Releases the kept activations as capture number `at` (under the
  // ledger's mutex); the caller drops what it returns outside the mutex.
  std::vector<NodePtr> release_kept(uint64_t at);
  // Static memory of the engine was freed as capture number `at` (under the
  // ledger's mutex).
  void note_statics_freed(uint64_t at);
  // Its input grads are freed now, numbered as a capture of the pool.
  void note_input_grads_freed();
  // At reset: the kept history goes, the ledger stays (it numbers the pool).
  void forget_history() noexcept;

 private:
  std::shared_ptr<PoolLedger> ledger_;
  uint64_t captured_at_[2] = {0, 0};
  // When the forward capture's activations became free for later captures:
  // at the backward capture, or, with keep_activations, once released.
  uint64_t released_at_ = 0;
  std::vector<NodePtr> kept_history_;  // with keep_activations, until released
  uint64_t grads_freed_at() const { return std::min(statics_freed_at_, input_grads_freed_at_); }

  uint64_t statics_freed_at_ = UINT64_MAX;
  uint64_t input_grads_freed_at_ = UINT64_MAX;
  bool keep_activations_;
};

// Whether an engine of `pool` has a backward pending; with unkept_only, one
// whose activations are not kept (aten_pool.cpp).
bool pool_busy(at::cuda::MempoolId_t pool, bool unkept_only);
// Lists a pool store whose first engine is going while later graphs still
// share it in its pool's ledger, which then moves its handed grad out of
// the way of the replays that overwrite it (aten_pool.cpp).
void note_orphan_store(const std::shared_ptr<GradStore>& store);
// The pool's number of the earliest forward capture of an engine with a
// backward pending; UINT64_MAX if none (aten_pool.cpp).
uint64_t earliest_pending_forward(PoolLedger& ledger);
// Before `capturing` capture into `pool`: frees the kept activations of its
// engines with no backward pending, and what static memory of theirs only
// they hold, but for what `capturing` read (Note [Static memory freed once
// its pass is over]).
void release_kept_activations(at::cuda::MempoolId_t pool, at::ArrayRef<Engine*> capturing);
// Before a warm-up in `pool`, which writes its free blocks: the outputs and
// grads still held in memory freed once its pass was over move out (Note
// [Warm-up in the pool], aten_setup.cpp).
void move_held_out_of_freed(at::cuda::MempoolId_t pool);
// A non-owning view of the static output of a live graph of `pool` that `t`
// shows, if there is one (aten_pool.cpp).
std::optional<at::Tensor> static_output_in(at::cuda::MempoolId_t pool, const at::Tensor& t);

// Whether at most `refs` references hold tensor `t`, not counting a Python
// wrapper only `t` keeps alive (aten_backward.cpp).
bool held_at_most(const at::Tensor& t, size_t refs);
// Whether anybody but cgraph may hold `handed`, a tensor cgraph handed out
// over its memory (guarded_alias), or its storage: a cheap test of counts
// only, before the exact ones (aten_backward.cpp).
bool alias_may_be_held(const at::Tensor& handed);

// One graphed callable.  Shared between the C half (through cg_engine) and
// every backward node still pending, so a live autograd graph keeps the
// buffers its backward replay needs.
struct Engine : std::enable_shared_from_this<Engine> {
  explicit Engine(const cg_engine_config& config);
  ~Engine();

  // -- identity, fixed at construction
  const c10::DeviceIndex device;
  const bool allow_unused = false;
  const cg_kept_outputs kept_outputs = CG_KEEP_COPY;  // Note [Outputs of earlier calls]
  at::cuda::MempoolId_t pool{0, 0};  // set at the forward capture (aten_capture.cpp)
  // False after reset(): replays and backwards raise.
  bool alive() const { return alive_; }
  // The stream current when the callable was graphed: param.grad lives
  // there, beside the optimizer's state, not on the capture stream.
  const c10::cuda::CUDAStream caller_stream;

  // -- graphs.  Both start with copies of their arguments (inputs; incoming
  //    grads); bwd ends with the parameter-grad tails, two optional
  //    segments: stores = grads, or stores += grads (Note [Parameter gradients]).
  std::unique_ptr<Graph> fwd = std::make_unique<Graph>();
  std::unique_ptr<Graph> bwd = std::make_unique<Graph>();
  // The cuBLAS workspace the graphs' GEMMs use, shared with eager mode on
  // caller_stream: Note [One cuBLAS workspace per stream].
  std::shared_ptr<BlasWorkspace> blas_workspace;
  CapturedBackward backward;

  std::vector<Input> inputs;
  std::vector<Param> params;  // module parameters, then hidden leaves
  // Throws unless every parameter lies where the graphs read it: before a
  // forward replay (check_params) and a backward one (GraphedBackward::apply).
  void check_param_memory(cg_pass pass) const;
  std::vector<Output> outputs;
  Autocast autocast;          // at the forward's capture
  bool grad_mode = true;      // grad mode at the forward's capture
  // Whether its static tensors are inference tensors (the forward captured
  // under inference mode, or samples made under it), which only a call in
  // inference mode may write.
  bool inference_statics = false;
  EngineRng rng;  // Note [RNG in checkpointed regions] (aten_rng.cpp)

  // Present from construction to finish_setup().
  std::unique_ptr<SetupState> setup = std::make_unique<SetupState>();

  // -- replay bookkeeping
  HandedOut handed;
  // The latest replay's backward node: Note [Calls before their backwards]
  // (aten_backward.cpp).
  WeakNodePtr latest_node = WeakNodePtr(NodePtr());
  bool backward_pending() const;
  void note_latest_node(const NodePtr& node);  // null: this call has no backward
  // Forward replays so far.  A backward replay is valid only for the latest
  // forward: an earlier call's activations have been overwritten.
  uint64_t generation = 0;
  cg_stats stats{};  // how often each path ran, for introspection and tests

  // -- the pool's other graphs: Note [Captures that share a pool] (aten_pool.cpp)
  PoolMember member;
  void note_capture(cg_pass pass) { member.note_capture(*this, pool, pass); }
  void note_inputs_in_place();                 // at the forward capture's start
  bool may_replay_forward() const;             // no pending graph needs what it writes
  void check_backward_replayable() const;      // throws if one does
  void release_earlier_outputs();              // this engine's: Note [Outputs of earlier calls]
  at::Tensor hand_out_grad(Input& in);        // Note [Grads handed to autograd]
  // This engine's grads still held but by `consumed` (the incoming grads of
  // the backward replay about to run, which its graph reads first).
  void release_handed_grads(at::ArrayRef<at::Tensor> consumed);
  void release_handed_input_grads(at::ArrayRef<at::Tensor> consumed);  // not parameters
  bool may_hold_grads() const;  // a cheap test before release_handed_grads
  // Before a replay of `pass`: what it may overwrite of this engine's grads,
  // and of the outputs and grads of engines captured after it.
  void release_later_outputs(cg_pass pass, at::ArrayRef<at::Tensor> consumed = {});
  bool later_backward_of_another(uint64_t at) const;
  // Note [Checked invariants]: whether a replay of `pass` would overwrite an
  // output or grad still held by anybody but `consumed` (aten_pool.cpp), and
  // whether this engine holds one (aten_replay.cpp).
  bool held_where_written(cg_pass pass, at::ArrayRef<at::Tensor> consumed) const;
  bool holds_outputs_in_place() const;
  bool holds_grads_in_place(at::ArrayRef<at::Tensor> consumed) const;

  Graph& graph(cg_pass pass) { return pass == CG_FORWARD ? *fwd : *bwd; }

  // -- set-up (aten_setup.cpp)
  void finish_setup();

  // -- warm-up (aten_warmup.cpp)
  void warmup_backward(const std::vector<at::Tensor>& outs);
  void adopt_hidden_leaves(const std::vector<at::Tensor>& outs);
  std::vector<at::Tensor> grad_targets() const;
  std::vector<at::Tensor> run_backward(const std::vector<at::Tensor>& outs,
                                       const std::vector<at::Tensor>& grad_outs,
                                       bool retain_graph = false);

  // -- capture (aten_capture.cpp, aten_capture_backward.cpp)
  void capture_begin(cg_pass pass, at::cuda::MempoolId_t pool, cudaStreamCaptureMode mode);
  void capture_end(cg_pass pass);
  void abandon_capture(cg_pass pass) noexcept;
  // After capture_begin(CG_FORWARD): what to call the callable with, where
  // an input is read in place; empty where the samples serve as they are.
  std::vector<at::Tensor> capture_inputs();
  void note_capture_views_kept();
  void set_outputs(std::vector<at::Tensor> outs);
  void capture_backward(at::cuda::MempoolId_t pool, cudaStreamCaptureMode mode);

  // -- reset (aten_reset.cpp)
  void reset() noexcept;
  void hand_back_held() noexcept;
  void tear_down() noexcept;
  bool shares_pool_with_others() const;  // aten_pool.cpp
  // Whether what it hands out may lie in memory it does not keep allocated.
  bool borrows_memory() const;

  // Launches one of this engine's graphs on the current stream, ordered
  // with caller_stream if that is another: Note [Replays on another stream]
  // (aten_replay.cpp).
  void launch(Graph& graph);
  void order_after_current();  // caller_stream waits for the current stream's work

 private:
  bool alive_ = true;  // written by reset() alone (aten_reset.cpp)
  // aten_pool.cpp: release_later_outputs's moves; Note [Input grads freed
  // at their capture].
  void move_later_outputs(cg_pass pass, at::ArrayRef<at::Tensor> consumed);
  void free_input_grads();
  // aten_capture_backward.cpp
  std::vector<at::Tensor> differentiable_outputs() const;
  void record_backward(const std::vector<at::Tensor>& diff);
  bool computes_grads_in_place() const;
  void allocate_grad_stores();
  void capture_param_grad_tails();
  GradIn capture_grad_in(const at::Tensor& buffer);
  void release_grad_in_buffers();
  void forget_capture_autograd();
};

// ---- the lifecycle's entry points into the C++ half ----------------------

// The set-up session (aten_setup.cpp): the capture stream made current for
// the warm-up and capture of one make_graphed call.
cg_setup* open_setup(c10::DeviceIndex device);
void warm_up_in(cg_setup& setup, at::cuda::MempoolId_t pool);
bool end_warm_up(cg_setup& setup);
bool moved_what_warm_up_left(cg_setup& setup, PyObject* objects);
void release_warmup_memory(cg_setup& setup);
// Note [A step's warm-up in its pool] (aten_setup.cpp); the one reading of the
// expandable_segments setting, also for Note [Emptying a pool under expandable segments].
bool expandable_segments_on();
bool can_allocate_all_from_a_pool();
// Whether any block of `pool` is allocated (the allocator's snapshot: not per replay).
bool pool_holds_allocations(c10::DeviceIndex device, at::cuda::MempoolId_t pool);
void allocate_all_from(cg_setup& setup, at::cuda::MempoolId_t pool);
void hold_pool(c10::DeviceIndex device, at::cuda::MempoolId_t pool);
void release_held_pool(c10::DeviceIndex device, at::cuda::MempoolId_t pool) noexcept;
void close_setup(cg_setup* setup) noexcept;

// A block of the caching allocator: its address and size, ordered by both.
struct Block {
  size_t address;
  size_t size;
  bool operator<(const Block& other) const {
    return address != other.address ? address < other.address : size < other.size;
  }
};
// What a graph pool holds: its segments and its allocated blocks, sorted.
struct PoolBlocks {
  std::vector<Block> segments;
  std::vector<Block> allocated;
};

// The forward replay of one call (aten_replay.cpp): a NEW reference to the
// tuple of outputs.  Throws on failure.
// With `accepted`, accepts() just took these arguments: they are not
// checked again.
PyObject* replay(const std::shared_ptr<Engine>& engine, PyObject* const* args, size_t nargs,
                 bool accepted);

// Whether a call with these tensor arguments may replay this engine's graphs
// (cg_engine_accepts in cgraph.h).  Never throws for a mismatch.
bool accepts(const Engine& e, PyObject* const* args, size_t nargs, bool exact_grad,
             bool exact_dtype);

// Shared by the forward and backward replays (aten_replay.cpp).
using TensorVec = c10::SmallVector<at::Tensor, 16>;
// Copies each src into its dst: one launch for all of them.
void copy_all(const TensorVec& dst, const TensorVec& src);
// Whether `src` must be copied into the static buffer `dst`; *staged is
// what to copy from (a clone where `src` aliases `dst` with other strides).
bool needs_copy(const at::Tensor& dst, const at::Tensor& src, at::Tensor* staged);

// torch.cuda.get_rng_state and set_rng_state while an engine warms up or
// captures (aten_rng.cpp): nullopt, or false, when torch should answer.
std::optional<at::Tensor> rng_get_state(c10::DeviceIndex device);
bool rng_set_state(const at::Tensor& state, c10::DeviceIndex device);

// The backward node of one forward replay (aten_backward.cpp).  It receives
// a grad for each output that attaches() to it, in output order.
struct BackwardWiring {
  torch::autograd::edge_list edges;
  std::vector<EdgeSource> sources;  // per edge
  std::vector<uint32_t> fused;      // parameters whose grads the node accumulates
  bool ungraded = false;            // an edge is an UngradedInput
};
NodePtr make_backward_node(std::shared_ptr<Engine> engine, BackwardWiring&& wiring);
// Whether output `o` gets the node as its grad_fn: it required grad at
// capture or, when an argument requires grad unlike its sample, it is
// floating (as torch's autograd.Function marks every output).
bool attaches(const Output& o, bool ungraded);

// Whether parameter `p`'s grad must go through autograd (it has hooks):
// Note [Parameter gradients] (aten_backward.cpp).
bool delivered_by_autograd(const at::Tensor& p);

// The leaves requiring grad that the autograd graph of `roots` ends at, each
// once (aten_warmup.cpp).
std::vector<at::Tensor> autograd_leaves(const std::vector<at::Tensor>& roots);

// The cuBLAS handle of autograd's thread for `caller`'s device, named once
// per device: Note [Naming a thread's cuBLAS handle] (aten_workspace.cpp;
// this in aten_warmup.cpp).  Runs a backward: call it with the GIL held.
void* autograd_thread_blas_handle(const c10::cuda::CUDAStream& caller);

// Moves the live grad accumulators of `params` onto the current stream;
// restore_accumulators gives them their streams back and frees the record
// (aten_accumulators.cpp, Note [DDP inside a graphed step] in cgraph/_ddp.py).
cg_moved_accumulators* move_accumulators(const std::vector<at::Tensor>& params);
void restore_accumulators(cg_moved_accumulators* moved) noexcept;
// Whether each parameter's grad is the tensor at its place of `grads`
// (None: no grad); TypeError for a parameter that is not a tensor
// (aten_accumulators.cpp).
bool grads_are(PyObject* params, PyObject* grads);
// A NEW reference: per parameter, (its memory's address, requires_grad).
PyObject* param_marks(PyObject* params);
// Whether every parameter still has the mark param_marks gave it.
bool params_are(PyObject* params, PyObject* marks);

// Points the storage of `t` at `home`'s memory, keeping `home` alive
// (aten_lend.cpp, Note [FSDP2's unsharded parameters in per-layer graphs] in
// cgraph/_fsdp.py).
void lend_memory(const at::Tensor& t, const at::Tensor& home);
// Where in a home `t`'s storage is lent, or nullptr where it is not lent
// (aten_lend.cpp).
const void* lent_from_home(const at::Tensor& t);

// Unpacks a Python sequence of tensors.  `what` names the items in errors
// (aten_setup.cpp).
std::vector<at::Tensor> unpack_tensors(PyObject* seq, const char* what);

}  // namespace cgraph

struct cg_engine {
  std::shared_ptr<cgraph::Engine> ptr;
};

// Grad accumulators moved onto a capture stream: each node, its parameter and
// the metadata it had, its stream included.
struct cg_moved_accumulators {
  struct Moved {
    cgraph::NodePtr node;
    at::Tensor param;
    torch::autograd::InputMetadata was;
  };
  std::vector<Moved> moved;
};

// An open region of the Graph capturing it (Note [Conditional regions]).
struct cg_if_region {
  cgraph::Graph* graph;
};

struct cg_setup {
  c10::DeviceIndex device;
  c10::cuda::CUDAStream caller;
  c10::cuda::CUDAStream side;
  // The pool warm-up allocates from (Note [Warm-up in the pool]), held to
  // the session's end; `routing` while warm-up allocates there.
  std::optional<at::cuda::MempoolId_t> warm_pool = std::nullopt;
  bool routing = false;
  // Every stream routed, for a step's eager call: Note [A step's warm-up in
  // its pool].
  bool every_stream = false;
  cgraph::PoolBlocks pool_before;  // what the warm pool held when warm-up began
  // Note [One cuBLAS workspace per stream] (aten_workspace.cpp), and eager
  // mode's own workspaces it replaced, freed when the session ends.
  std::shared_ptr<cgraph::BlasWorkspace> blas_workspace;
  std::vector<at::DataPtr> replaced_workspaces;
  // The workspaces torch made for the warm-up, dropped at its end; the
  // streams they named share blas_workspace once it is made.
  std::set<void*> warmed_workspaces;
};
