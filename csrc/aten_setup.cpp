// aten_setup.cpp -- the first place of the lifecycle: an engine's records
// made from a callable's description, the capture stream made current, and
// the state only set-up needs, freed when capture completes.
#include "aten_engine.hpp"

#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <set>
#include <utility>

namespace cgraph {

std::vector<at::Tensor> unpack_tensors(PyObject* seq, const char* what) {
  PyObject* fast = PySequence_Fast(seq, "cgraph: expected a sequence of tensors");
  if (!fast) {
    throw python_error();
  }
  std::vector<at::Tensor> out;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(fast, i);
    if (!THPVariable_Check(item)) {
      const char* type_name = Py_TYPE(item)->tp_name;
      Py_DECREF(fast);
      TORCH_CHECK_TYPE(false, "cgraph: ", what, " ", i,
                       " (counting tensors in pytree order; None is not counted) is a ",
                       type_name,
                       "; graphed callables take and return tensors or None, nested in "
                       "tuples, lists or dicts.  A Python value computed at capture would come "
                       "back unchanged at every replay: return it as a tensor, or compute it "
                       "outside the graphed callable.");
    }
    out.push_back(THPVariable_Unpack(item));
  }
  Py_DECREF(fast);
  return out;
}

namespace {

// The UTF-8 text of names[i], a str (CallableSpec checks it is a tuple).
std::string name_at(PyObject* names, size_t i) {
  TORCH_CHECK(static_cast<Py_ssize_t>(i) < PyTuple_GET_SIZE(names),
              "cgraph: internal error: fewer names than sample tensors.");
  const char* utf8 = PyUnicode_AsUTF8(PyTuple_GET_ITEM(names, static_cast<Py_ssize_t>(i)));
  if (utf8 == nullptr) {
    throw python_error();
  }
  return utf8;
}

std::vector<Input> read_inputs(const cg_engine_config& config) {
  std::vector<Input> inputs;
  for (at::Tensor& t : unpack_tensors(config.inputs, "argument")) {
    Input in;
    in.name = name_at(config.names, inputs.size());
    TORCH_CHECK_VALUE(t.is_cuda(), "cgraph: argument '", in.name, "' is on ", t.device(),
                      "; a CUDA graph replays CUDA work only. "
                      "Move the sample (and every later argument) to the GPU.");
    in.requires_grad = t.requires_grad();
    in.buffer = std::move(t);
    inputs.push_back(std::move(in));
  }
  return inputs;
}

}  // namespace

Engine::Engine(const cg_engine_config& config)
    : device(static_cast<c10::DeviceIndex>(config.device)),
      allow_unused(config.allow_unused_input != 0),
      kept_outputs(config.kept_outputs),
      caller_stream(c10::cuda::getCurrentCUDAStream(device)),
      inputs(read_inputs(config)),
      rng(device),
      member(config.keep_activations != 0) {
  for (at::Tensor& p : unpack_tensors(config.params, "parameter")) {
    Param param;
    param.data = p.const_data_ptr();
    param.requires_grad = p.requires_grad();
    param.tensor = std::move(p);
    params.push_back(std::move(param));
  }
  setup->set_aside_grad_accumulators(params);
  setup->save_buffers(unpack_tensors(config.buffers, "buffer"));
  if (config.rng_warmed) {
    rng.warmed_up_elsewhere(std::vector<uint64_t>(
                                config.rng_offsets, config.rng_offsets + config.rng_offsets_count),
                            config.rng_increment);
  }
}

// Note [Grad accumulators during capture]
// A parameter's grad accumulator (the AccumulateGrad node autograd ends at)
// remembers the stream that was current when it was made, and the backward
// pass makes that stream wait for the producer of the grad.  DDP makes the
// accumulators at construction, to hang its hooks on them, usually on the
// legacy default stream; a backward capture then asks the legacy stream to
// wait on the capture stream, which CUDA refuses (cudaError 906; NVIDIA's
// guide has users build DDP on a side stream).  cgraph sets each parameter's
// accumulator aside from engine creation to the end of capture, so autograd
// makes fresh ones on the capture stream, then puts the originals back:
// replays deliver grads to them, DDP's hooks included.  The parameter's
// tensor hooks (register_hook) and post-accumulate-grad hooks go aside with
// them: warm-up and capture run AccumulateGrad (Note [Backward capture runs
// .backward()]), which reads both off the tensor, and they must run at each
// replay, where AccumulateGrad runs them (delivered_by_autograd,
// aten_backward.cpp), not at warm-up and capture: a register_hook(g * 0.1)
// captured into the backward graph was applied twice per replay.  So do
// the node's own hooks (DDP's reducer's, _apply_optimizer_in_backward's), and
// hooks the forward registers during the set-up, before each of its
// backwards (hold_hooks_added_meanwhile).  Leaves the forward reads outside
// the parameters it was given go aside when found
// (Engine::adopt_hidden_leaves): after the first warm-up's forward, whose
// graph holds the original node, hence its hooks go aside too.
namespace {

// The tensors some set-up holds aside now, so that each is recorded once:
// Note [A set-up puts back what it changed].  Set-ups run one at a time
// (cgraph/_capture.py), but a failed one puts back from its destructor.
std::mutex held_aside_mutex;
std::unordered_set<const c10::TensorImpl*>& held_aside() {
  static std::unordered_set<const c10::TensorImpl*> held;
  return held;
}

// Moves every hook of `from` to the end of `to`.
template <class Hooks>
void append(Hooks& to, Hooks& from) {
  for (auto& hook : from) {
    to.push_back(std::move(hook));
  }
  from.clear();
}

// `held` (taken before) first, then what is on `now`: hooks run in the order
// they were registered.
template <class Hooks>
void put_first(Hooks& now, Hooks& held) {
  append(held, now);
  now = std::move(held);
  held.clear();
}

}  // namespace

// Moves the hooks now on the tensor and on its own accumulator node into
// `aside`, after those taken before.
void SetupState::take_hooks(AsideParam& aside) {
  auto* meta = torch::autograd::impl::get_autograd_meta(aside.param);
  if (meta == nullptr) {
    return;  // a tensor without autograd meta has neither accumulator nor hooks
  }
  {
    std::lock_guard<std::mutex> lock(meta->mutex_);
    append(aside.hooks, meta->hooks_);
    if (!aside.post_acc_hooks) {  // Python keeps one per tensor, a dict of them
      aside.post_acc_hooks = std::exchange(meta->post_acc_grad_hooks_, nullptr);
    }
  }
  // The original node is still in a graph the forward built before the
  // tensor went aside (a leaf adopted at the first warm-up's backward):
  // its own hooks must not run there either.
  if (NodePtr node = aside.accumulator.lock()) {
    append(aside.node_pre_hooks, node->pre_hooks());
    append(aside.node_post_hooks, node->post_hooks());
  }
}

void SetupState::set_aside_grad_accumulators(const std::vector<Param>& params) {
  std::lock_guard<std::mutex> held_lock(held_aside_mutex);
  for (const Param& p : params) {
    if (!held_aside().insert(p.tensor.unsafeGetTensorImpl()).second) {
      continue;  // another engine of the session holds it aside: it puts it back
    }
    AsideParam aside{p.tensor};
    if (auto* meta = torch::autograd::impl::get_autograd_meta(p.tensor)) {
      std::lock_guard<std::mutex> lock(meta->mutex_);
      aside.accumulator = std::exchange(meta->grad_accumulator_, WeakNodePtr(NodePtr()));
    }
    take_hooks(aside);
    aside_.push_back(std::move(aside));
  }
}

// A forward that registers a hook on its first call (on a tensor with none
// before) ran it at every backward of the set-up, and the capture's
// backward graph held it: applied twice per replay.
void SetupState::hold_hooks_added_meanwhile() {
  for (AsideParam& aside : aside_) {
    take_hooks(aside);
  }
}

void SetupState::restore_grad_accumulators() noexcept {
  std::lock_guard<std::mutex> held_lock(held_aside_mutex);
  for (AsideParam& aside : aside_) {
    held_aside().erase(aside.param.unsafeGetTensorImpl());
    auto* meta = torch::autograd::impl::get_autograd_meta(aside.param);
    if (meta == nullptr) {
      continue;
    }
    if (NodePtr node = aside.accumulator.lock()) {
      put_first(node->pre_hooks(), aside.node_pre_hooks);
      put_first(node->post_hooks(), aside.node_post_hooks);
    }
    std::lock_guard<std::mutex> lock(meta->mutex_);
    // Even an expired one: autograd then makes a fresh node on the
    // caller's stream, not the capture's.
    meta->grad_accumulator_ = std::move(aside.accumulator);
    put_first(meta->hooks_, aside.hooks);
    if (aside.post_acc_hooks) {
      meta->post_acc_grad_hooks_ = std::move(aside.post_acc_hooks);
    }
  }
  aside_.clear();
}

void SetupState::save_buffers(std::vector<at::Tensor> buffers) {
  for (at::Tensor& b : buffers) {
    at::Tensor saved = b.clone();
    buffers_.push_back({std::move(b), std::move(saved)});
  }
}

void SetupState::restore_buffers() {
  for (const BufferSnapshot& b : buffers_) {
    b.buffer.copy_(b.saved);
  }
  buffers_.clear();
}

// Note [A set-up puts back what it changed]
// Q: Who puts back the grad accumulators and buffers when a set-up fails?
// A: The SetupState that holds them, when it is destroyed: an engine drops it
//    at finish_setup (after putting everything back), at reset or
//    destruction after a failed warm-up or capture, or when the engine's
//    constructor throws after setting things aside (C++ destroys the members
//    it had built).  Before, only the accumulators came back on failure: a
//    failed capture left BatchNorm's running stats with the warm-up's
//    updates in them, and so did a session that graphed.c starts again
//    after a warm-up left state in the pool (the second session saved the
//    stats the first had changed).
// Q: Two callables of one session can share a parameter (tied weights), and
//    a leaf one engine adopts at warm-up (Engine::adopt_hidden_leaves) can
//    be another's parameter.  Who puts it back?
// A: The engine that set it aside first, alone: a tensor some set-up holds
//    aside is not recorded again (held_aside).  A second record would hold
//    what was left (no accumulator, no hooks), and put back after the first
//    it would end with none: autograd would make a new node, and hooks held
//    on the original (DDP's reducer hooks) would never fire again.  Engines
//    still finish in reverse order (capture.c), last aside, first back.
SetupState::~SetupState() {
  restore_grad_accumulators();
  try {
    restore_buffers();
  } catch (const std::exception& err) {
    TORCH_WARN("cgraph: could not put back a module buffer after a failed set-up: ", err.what());
  }
}

void Engine::finish_setup() {
  setup->restore_grad_accumulators();
  setup->restore_buffers();
  setup.reset();
  rng.finish_setup();
}

// ---- the set-up session: the capture stream, current while it lasts --------

namespace {

// What `pool` on `device` holds: its segments and its allocated blocks,
// each sorted by address (the allocator's snapshot lists a segment's blocks
// in address order).
PoolBlocks pool_blocks(c10::DeviceIndex device, at::cuda::MempoolId_t pool) {
  PoolBlocks held;
  for (const auto& segment : c10::cuda::CUDACachingAllocator::snapshot().segments) {
    if (segment.device != device || segment.owner_private_pool_id != pool) {
      continue;
    }
    held.segments.push_back(Block{segment.address, segment.total_size});
    size_t address = segment.address;
    for (const auto& block : segment.blocks) {
      if (block.allocated) {
        held.allocated.push_back(Block{address, block.size});
      }
      address += block.size;
    }
  }
  std::sort(held.segments.begin(), held.segments.end());
  std::sort(held.allocated.begin(), held.allocated.end());
  return held;
}

// Whether `address` lies in one of `blocks` (sorted).
bool in_blocks(const std::vector<Block>& blocks, size_t address) {
  auto after = std::upper_bound(blocks.begin(), blocks.end(), Block{address, SIZE_MAX});
  return after != blocks.begin() && address < std::prev(after)->address + std::prev(after)->size;
}

// Whether `storage` is the caching allocator's allocation of one of
// `blocks` (sorted), not a view over one that owns nothing there (an
// in-place sample, a freed static output: non_owning_view).
bool owns_one_of(const c10::StorageImpl& storage, const std::vector<Block>& blocks) {
  const at::DataPtr& data = storage.data_ptr();
  const auto address = reinterpret_cast<size_t>(data.get());
  return data.get_deleter() == c10::cuda::CUDACachingAllocator::get()->raw_deleter() &&
         std::binary_search(blocks.begin(), blocks.end(), Block{address, 0},
                            [](const Block& a, const Block& b) { return a.address < b.address; });
}

// Note [Warm-up in the pool]: every tensor among `objects` (a list: every object the
// collector tracks, which the C half hands over) whose storage owns one of `blocks` moves
// to memory of its own, allocated on the current stream; its storage's memory is replaced,
// so its views follow (a raw pointer kept elsewhere does not).  Under the GIL.
void move_tensors_left_in_pool(const std::vector<Block>& blocks, PyObject* objects) {
  TORCH_CHECK_TYPE(PyList_Check(objects), "cgraph: internal error: expected the list of "
                   "gc.get_objects(), got ", Py_TYPE(objects)->tp_name);
  std::set<c10::StorageImpl*> moved;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objects); ++i) {
    PyObject* item = PyList_GET_ITEM(objects, i);
    // By type, not isinstance(): that reads __class__, and a deprecated
    // object's attribute access warns (torch.distributed.reduce_op).
    if (!PyObject_TypeCheck(item, reinterpret_cast<PyTypeObject*>(THPVariableClass))) {
      continue;
    }
    const at::Tensor& t = THPVariable_Unpack(item);
    if (!t.is_cuda() || !t.has_storage()) {
      continue;
    }
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    bool owns = false;
    try {
      owns = owns_one_of(*storage, blocks);
    } catch (const c10::Error&) {
      continue;  // an output kept_outputs='error' made unreadable
    }
    if (owns && moved.insert(storage).second) {
      move_to_own_memory(t.device().index(), *storage);
    }
  }
  GilRelease nogil;
  c10::cuda::getCurrentCUDAStream().synchronize();  // the old blocks go back to the pool now
}

}  // namespace

bool pool_holds_allocations(c10::DeviceIndex device, at::cuda::MempoolId_t pool) {
  return !pool_blocks(device, pool).allocated.empty();
}

cg_setup* open_setup(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  {
    // Lazy initialization (cuBLAS handles, cuDNN autotuning) belongs in
    // warm-up, not in a capture; start from an idle device, as torch does.
    GilRelease nogil;
    c10::cuda::device_synchronize();
  }
  // And with the cache's free segments given back, as torch.cuda.graph
  // does: the warm-up's segments on the capture stream cannot reuse the
  // caller stream's, so the set-up's peak would hold both (varlen's first
  // pass: the last step's loss segment beside each layer's warm-up).
  c10::cuda::CUDACachingAllocator::emptyCache();
  std::unique_ptr<cg_setup> setup(new cg_setup{device, c10::cuda::getCurrentCUDAStream(device),
                                               capture_stream(device)});
  // Warm-up GEMMs, on the capture stream, use the workspace earlier graphs
  // from this stream share (Note [One cuBLAS workspace per stream]), on
  // both threads they run on: Note [Naming a thread's cuBLAS handle].
  std::set<void*> threads{blas_handle_of_this_thread(),
                          autograd_thread_blas_handle(setup->caller)};
  setup->blas_workspace = share_blas_workspace(setup->caller, setup->side.stream(),
                                               std::move(threads), setup->replaced_workspaces);
  c10::cuda::setCurrentCUDAStream(setup->side);
  return setup.release();
}

// Note [Warm-up in the pool]
// Q: Why does a later capture's warm-up (another shape, another layer of one pool=) allocate
//    from the graph pool it captures into?
// A: Warm-up runs the callable eagerly; in the device's ordinary cache its activations would
//    be a second copy of what the pool holds free between replays (varlen's peak was the pool
//    plus a whole eager step; with one pool= for every layer, each layer's warm-up sat beside
//    the pool, as the capture stream's cache cannot take blocks the caller stream's holds
//    free).  In the pool, warm-up reuses the earlier graphs' temporaries and the capture the
//    warm-up's.  Safe only because nothing in those blocks is needed during warm-up and
//    nothing warm-up allocates there outlives it:
//    - No graph of the pool is between its forward and its backward (choose_site in graphed.c
//      picks an idle pool) but those that keep their activations (cg_pool_open_to_layers:
//      Note [Layers captured one by one into one pool] in aten_pool.cpp).
//    - What is held in freed static memory moves out first (move_held_out_of_freed).
//    - A tensor the callable keeps from warm-up (a cache made for a new shape) would sit in
//      blocks the earlier graphs overwrite.  So the pool's allocated blocks are compared
//      before and after warm-up (not the device's allocated bytes, which a cache replaced by
//      one in the pool evens out), and every Python tensor owning a block left behind moves
//      out of the pool, its views with it (move_tensors_left_in_pool; the capture reads it
//      there: Engine::capture_begin).  A block then still held in a segment the pool had
//      before (one warm-up added is memory no graph used) by what Python cannot reach (memory
//      C++ made and holds, as the saved statistics in the autograd history of a kept tensor
//      that requires grad) fails the session with kind "warmup_state"
//      (moved_what_warm_up_left): graphed.c drops the callable's earlier graphs in a pool of
//      its own; in a pool shared with other callables, that call and every later capture of
//      the callable raise (recover_from_warm_up).
//    - A warm-up that raises (an out-of-memory at a larger batch, caught and retried smaller)
//      may have made such a tensor first: the same move runs before its error goes on
//      (warm_up_failed_in_pool in capture.c), tensors its traceback holds moved too (a copy,
//      dropped with the traceback).  A move that fails in turn (out of memory again), or
//      memory only C++ holds, is warned of (RuntimeWarning), not raised: the error a
//      caller catches stays the callable's own.
// Q: Why does move_tensors_left_in_pool walk every object gc tracks (gc.get_objects(),
//    which capture.c asks for and hands over: the C++ half calls no Python)?
// A: Nothing maps memory back to tensors: a StorageImpl counts its references but does not
//    list them, a TensorImpl knows its own Python object but nothing lists those over a
//    storage, and the allocator knows blocks, not holders.  Walking only what the callable
//    reaches (its module, its closure) would miss a tensor in a global or another object's
//    cache, which the earlier graphs would overwrite silently; the collector tracks every
//    Python tensor.  The walk costs about 25 ms for 180,000 objects (torch imported, 2-core
//    host), paid only by a capture whose warm-up in a pool left a block behind (a first call
//    with new shapes that made state), never by a replay; what it cannot reach is still
//    caught by comparing the blocks again.
namespace {

// The device's allocations on the streams `takes` accepts go to `pool` until
// end_warm_up_in_pool.  Takes a reference to the pool, held to the
// session's end: a pool no graph holds yet must live on into the capture
// (close_setup).
void route_to(cg_setup& setup, at::cuda::MempoolId_t pool,
              std::function<bool(cudaStream_t)> takes) {
  c10::cuda::CUDACachingAllocator::beginAllocateToPool(setup.device, pool, std::move(takes));
  setup.warm_pool = pool;
  setup.routing = true;
}

}  // namespace

void warm_up_in(cg_setup& setup, at::cuda::MempoolId_t pool) {
  setup.pool_before = pool_blocks(setup.device, pool);
  const cudaStream_t side = setup.side.stream();
  route_to(setup, pool, [side](cudaStream_t stream) { return stream == side; });
}

// Note [A step's warm-up in its pool]
// Q: A training step graphed whole (cgraph/_step.py) warms up with real eager steps.  Why do
//    they run on the capture stream, every allocation of the device going to the pool the
//    step's capture then takes?
// A: So that the capture reuses their memory.  A step that zeroes its grads with
//    set_to_none=True before its backward drops, inside the capture, the grads its last
//    warm-up step left; the capture allocates the new ones meanwhile.  The caching allocator
//    gives a capture only free blocks of its pool and of the stream asking, so grads left in
//    the device's cache (or on the caller's stream) sat beside the capture's own: the set-up
//    peaked at 1.12-1.17x eager FSDP2's reserved memory (benchmarks/sharded_memory.py),
//    against 0.96-1.02x once captured.  Warmed up where the capture runs, the dropped grads
//    are free blocks of the pool on the streams that allocate them again (autograd's on the
//    capture stream, FSDP2's on its reduce-scatter stream), as are the warm-up's
//    activations; torch's CUDAGraph Trees warm up in their pool for the same reason.  Every
//    stream's allocations are routed, as a capture routes every stream it joins, because
//    FSDP2 allocates on streams of its own; all but the caller's and the legacy default
//    stream: no capture allocates there, so their blocks would lie in the pool for good,
//    where the device's cache gives them back (DDP's grads in a first step, before cgraph
//    knows the model: its grad accumulators, made at construction, run on the stream
//    current then; later warm-up steps run them on the capture stream, as its capture
//    does: Note [DDP inside a graphed step] in cgraph/_ddp.py).  Safe only because:
//    - The pool is the step's own and fresh (no pool= given): no graph's memory lies there,
//      so what a warm-up keeps (optimizer state, grads, a loss the caller holds) is memory
//      no graph writes, and a capture takes only blocks freed before it asks.
//    - The pool lives from the first warm-up to the capture though no graph holds it yet:
//      the step holds a reference (hold_pool; the allocator refuses to route to a pool whose
//      references all went), given back once the capture holds its own.
//    - The session orders the warm-up after the device's earlier work (open_setup
//      synchronizes the device) and the device's later work after it: close_setup
//      synchronizes the device before routing ends, because the allocator, which takes a
//      routed call for a capture, then forgets the stream uses recorded meanwhile
//      (record_stream), as a capture's would be done.  Tensors made on the capture stream
//      and freed later are reused only inside later sessions.
//    - Not with the cudaMallocAsync backend (no private pools) nor with expandable
//      segments (can_allocate_all_from_a_pool): there torch's allocator counts a segment's
//      growths and unmaps apart, and a released pool can be erased while blocks in it are
//      still allocated; the warm-up's state (optimizer moments) would outlive the step's
//      graph in such a pool.  The step then warms up on the caller's stream, as before
//      (under cudaMallocAsync it is then refused at its capture: _require_cuda).
//    Costs: two device synchronizations and an emptied cache per warm-up step.  While a
//    warm-up step runs, the allocator acts as during a capture: memory freed into the
//    device's cache is not given back to satisfy the pool, so a step whose first warm-up
//    drops grads made by eager steps before it peaks by their size there (once).  Between
//    warm-up steps the pool's free memory serves no other eager work.  Another thread's
//    allocations on the device during a warm-up step go to the pool too, as during a
//    capture in the global mode.  With pool= the warm-up runs on the caller's stream.
// The setting is read where torch's allocator reads it.  CUDAAllocatorConfig::
// expandable_segments() is inline in its header and answers false (with a "not supported
// on this platform" warning) wherever PYTORCH_C10_DRIVER_API_SUPPORTED is undefined: in
// every extension, torch's own build alone defines it.  Read through it, this check
// passed under expandable_segments:True and the warm-up ran in a pool the allocator
// cannot route to safely (an illegal memory access, intermittently, on an H200).
bool expandable_segments_on() {
  return c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
}

bool can_allocate_all_from_a_pool() {
  return c10::cuda::CUDACachingAllocator::get()->name() == "native" && !expandable_segments_on();
}

void allocate_all_from(cg_setup& setup, at::cuda::MempoolId_t pool) {
  const cudaStream_t caller = setup.caller.stream();
  const cudaStream_t legacy = c10::cuda::getDefaultCUDAStream(setup.device).stream();
  route_to(setup, pool,
           [caller, legacy](cudaStream_t stream) { return stream != caller && stream != legacy; });
  setup.every_stream = true;
}

void hold_pool(c10::DeviceIndex device, at::cuda::MempoolId_t pool) {
  c10::cuda::CUDACachingAllocator::createOrIncrefPool(device, pool);
}

void release_held_pool(c10::DeviceIndex device, at::cuda::MempoolId_t pool) noexcept {
  try {
    c10::cuda::CUDACachingAllocator::releasePool(device, pool);
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: could not release a training step's pool: ", e.what());
  }
}

namespace {

void end_warm_up_in_pool(cg_setup& setup) {
  if (setup.routing) {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(setup.device, *setup.warm_pool);
    setup.routing = false;
  }
}

// The blocks of `pool` allocated now that were not when warm-up began.
std::vector<Block> left_by_warm_up(const cg_setup& setup, at::cuda::MempoolId_t pool) {
  const std::vector<Block>& before = setup.pool_before.allocated;
  std::vector<Block> left, now = pool_blocks(setup.device, pool).allocated;
  std::set_difference(now.begin(), now.end(), before.begin(), before.end(),
                      std::back_inserter(left));
  return left;
}

}  // namespace

// Waits for the warm-up and ends it; returns whether it left blocks
// allocated in the warm pool, which Python tensors may own.
bool end_warm_up(cg_setup& setup) {
  {
    GilRelease nogil;
    setup.side.synchronize();
    // Note [One cuBLAS workspace per stream]: the workspaces torch made for
    // the warm-up go (in the pool, they would count as left below); the
    // threads they name share the caller stream's from here on.
    setup.warmed_workspaces = drop_foreign_blas_workspaces(setup.side.stream());
    end_warm_up_in_pool(setup);
  }
  return setup.warm_pool && !left_by_warm_up(setup, *setup.warm_pool).empty();
}

// Moves out of the warm pool every tensor among `objects` that owns a block
// warm-up left there; returns whether memory is still left in a segment
// the pool had before (earlier graphs may write those; a segment warm-up
// added is memory no graph has used, and what only C++ holds there may
// stay).  Under the GIL.
bool moved_what_warm_up_left(cg_setup& setup, PyObject* objects) {
  TORCH_CHECK(setup.warm_pool && !setup.routing, "cgraph: internal error: no warm-up in a "
              "pool has ended.");
  const at::cuda::MempoolId_t pool = *setup.warm_pool;
  {
    c10::cuda::CUDAStreamGuard on_caller(setup.caller);  // their memory is the caller's now
    move_tensors_left_in_pool(left_by_warm_up(setup, pool), objects);
  }
  for (const Block& b : left_by_warm_up(setup, pool)) {
    if (in_blocks(setup.pool_before.segments, b.address)) {
      return true;
    }
  }
  return false;
}

void release_warmup_memory(cg_setup& setup) {
  GilRelease nogil;
  // The warm-up's memory goes back before the shared workspace is made (the
  // freed workspaces are the capture stream's, which the caller's cannot
  // reuse), then the workspaces of torch's it replaced on the caller stream.
  c10::cuda::CUDACachingAllocator::emptyCache();
  setup.blas_workspace = share_blas_workspace(setup.caller, setup.side.stream(),
                                              setup.warmed_workspaces, setup.replaced_workspaces);
  setup.warmed_workspaces.clear();
  c10::cuda::CUDACachingAllocator::emptyCache();
}

void close_setup(cg_setup* setup) noexcept {
  if (setup == nullptr) {
    return;
  }
  if (setup->routing && setup->every_stream) {
    try {  // Note [A step's warm-up in its pool]: before routing ends
      GilRelease nogil;
      c10::cuda::device_synchronize();
    } catch (const std::exception& e) {
      TORCH_WARN("cgraph: could not wait for a warm-up step: ", e.what());
    }
  }
  try {
    // Whatever failed before: allocations stop going to the warm pool, and
    // its reference goes.
    end_warm_up_in_pool(*setup);
    if (setup->warm_pool) {
      c10::cuda::CUDACachingAllocator::releasePool(setup->device, *setup->warm_pool);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: could not release the warm-up's pool: ", e.what());
  }
  try {
    c10::cuda::setCurrentCUDAStream(setup->caller);
    GilRelease nogil;
    setup->side.synchronize();
    // After a failed warm-up too, no workspace torch allocated on the
    // capture stream outlives the session: Note [One cuBLAS workspace per
    // stream].
    drop_foreign_blas_workspaces(setup->side.stream());
    if (!setup->replaced_workspaces.empty()) {
      setup->replaced_workspaces.clear();  // freed in the caller stream's order
      c10::cuda::CUDACachingAllocator::emptyCache();
    }
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: could not wait for the capture stream: ", e.what());
  }
  delete setup;
}

}  // namespace cgraph
