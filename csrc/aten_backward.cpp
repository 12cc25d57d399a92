// aten_backward.cpp -- the fourth place of the lifecycle, backward half: the
// autograd node of a graphed call, which fills the backward graph's incoming
// grads, replays it and delivers the parameter grads.  Reads top to bottom
// in GraphedBackward::apply() at the end of this file.
#include "aten_engine.hpp"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_map>

namespace cgraph {
namespace {

namespace autograd = torch::autograd;
using ExecInfo = std::unordered_map<autograd::Node*, autograd::GraphTask::ExecInfo>;

}  // namespace

// Note [Parameter gradients]
// Q: How do parameter grads reach param.grad, and why not through autograd
//    as torch's make_graphed_callables does?
// A: torch returns its static grad buffer (detached) from backward, and
//    AccumulateGrad *steals* it as param.grad when .grad is None: the next
//    replay overwrites a .grad the user holds (pytorch issue 181723; micro-
//    batch accumulation goes wrong).  And an AccumulateGrad node per
//    parameter costs host time and a kernel launch each.
//    cgraph keeps one store per parameter (GradStore) and hands it out as
//    param.grad.  The first backward graph of a parameter computes its grad
//    in place: the store is that grad's memory, kept allocated in the pool
//    (a pool store), as eager's .grad is the tensor its backward computed,
//    so the grads are not held twice.  Its param.grad is a tensor with a
//    storage of its own over that memory, as outputs are (Note [Outputs of
//    earlier calls] in aten_replay.cpp): before any replay that writes the
//    memory (that backward graph; the graphs of the pool captured before
//    it, its own forward among them) a param.grad still held is moved to
//    memory of its own, counted in stats["param_grads_copied"].  A training
//    step that sets .grad to None before its next forward (zero_grad's
//    default) never moves one; accumulating micro-batches moves each once
//    per step, at the second forward, where eager too holds the grads and
//    the next ones side by side.
//    Later graphs of the parameter (other shapes, other callables reading
//    it) share the store and end with two optional segments ("tails"),
//    each one launch of tensor_lists.cu for all their parameters of a
//    dtype, of which every replay switches on at most one before it
//    launches (and neither while a graph that may keep activations in the
//    store's memory is pending: MayWriteStores below):
//      - every .grad is None and nobody else holds its store: the copy
//        tail (store = grad), then .grad = the store's;
//      - every .grad is its store's, still in its memory (accumulation over
//        micro-batches, or zero_grad(set_to_none=False)): the add tail
//        (store += grad).
//    Anything else (a .grad the user assigned or that was moved, a store
//    the user still holds after zero_grad, some parameters frozen since
//    capture, a partial backward) takes the general path: copies and adds
//    from views of the backward graph's grads, one launch per dtype after
//    the replay, into fresh tensors where the store is held elsewhere.  No
//    path overwrites a tensor the user holds, and every path computes what
//    AccumulateGrad would, bit for bit.
//    kept_outputs="alias", and layers captured one by one into a shared
//    pool (whose stores the backwards of the layers before them would
//    overwrite every step), make regular stores instead: allocated before
//    the capture, written by the tails only, never moved.
//    A parameter with hooks (tensor hooks, post-accumulate-grad hooks, hooks
//    on its grad accumulator, which DDP registers) stays an ordinary autograd
//    edge: it gets a copy of its grad and AccumulateGrad runs the hooks.
bool delivered_by_autograd(const at::Tensor& p) {
  if (!autograd::impl::hooks(p).empty() || autograd::impl::post_acc_grad_hooks(p)) {
    return true;
  }
  const auto acc = autograd::impl::try_get_grad_accumulator(p);
  return acc && (!acc->pre_hooks().empty() || !acc->post_hooks().empty());
}

// A Python wrapper that only the tensor itself keeps alive does not count:
// torch preserves wrappers this way once Python has seen a tensor (as it has
// every .grad an optimizer read), and torch releases that carry
// impl::is_tensor_stealable, the test AccumulateGrad uses, know about it.
namespace ownership {
using namespace torch::autograd::impl;
template <class T>
auto held_at_most(const T& t, size_t refs, int) -> decltype(is_tensor_stealable(t, refs)) {
  return is_tensor_stealable(t, refs);
}
template <class T>
bool held_at_most(const T& t, size_t refs, long) {
  return t.use_count() <= refs;
}
}  // namespace ownership

bool held_at_most(const at::Tensor& t, size_t refs) {
  return ownership::held_at_most(t, refs, 0);
}

bool alias_may_be_held(const at::Tensor& handed) {
  return handed.defined() && (handed.use_count() > 1 || handed.storage().use_count() > 1);
}

namespace {

// Whether nobody but cgraph can reach `t` (or its memory).
bool sole_owner(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->storage().use_count() == 1 && held_at_most(t, 1);
}

}  // namespace

GradStore::GradStore(at::Tensor memory, uint64_t allocated_at)
    : memory(std::move(memory)), allocated_at(allocated_at) {}

GradStore::~GradStore() {
  if (in_pool() && !interpreter_finalizing()) {
    try {
      release();
    } catch (const std::exception& e) {
      TORCH_WARN("cgraph: could not copy out a held parameter grad: ", e.what());
    }
  }
}

const at::Tensor& GradStore::hand_out() {
  if (!in_pool()) {
    return memory;
  }
  if (!handed.defined() || !still_alias_of(handed, memory)) {
    handed = guarded_alias(memory);  // a changed one is nobody's but ours: release() ran
  }
  return handed;
}

bool GradStore::handed_as(const at::Tensor& grad) const {
  const at::Tensor& mine = in_pool() ? handed : memory;
  return mine.defined() && grad.unsafeGetTensorImpl() == mine.unsafeGetTensorImpl() &&
         grad.const_data_ptr() == memory.const_data_ptr();
}

bool GradStore::unheld() const {
  if (!in_pool()) {
    return sole_owner(memory);
  }
  const size_t aliases = handed.defined() ? 1 : 0;  // guarded_alias's hold on the memory
  return held_at_most(memory, 1) && memory.storage().use_count() == 1 + aliases &&
         (!handed.defined() || sole_owner(handed));
}

bool GradStore::may_be_held() const {
  return alias_may_be_held(handed);
}

bool GradStore::held_by_others() const {
  return may_be_held() && !sole_owner(handed);
}

bool GradStore::release() {
  if (!held_by_others()) {
    return false;
  }
  move_to_own_memory(memory.device().index(), *handed.storage().unsafeGetStorageImpl());
  handed = at::Tensor();  // its holders keep it, in memory of its own now
  return true;
}

namespace {

// The partial backward running now (torch.autograd.grad, .backward(inputs=)),
// or nullptr for a full one.
const ExecInfo* partial_backward() {
  const auto* exec_info = autograd::get_current_graph_task_exec_info();
  return exec_info && !exec_info->empty() ? exec_info : nullptr;
}

// During a partial backward, whether it asks for parameter p's gradient.
bool named_by_partial_backward(const ExecInfo& exec_info, const at::Tensor& p) {
  const auto acc = autograd::impl::try_get_grad_accumulator(p);
  const auto it = acc ? exec_info.find(acc.get()) : exec_info.end();
  if (it == exec_info.end()) {
    return false;
  }
  TORCH_CHECK(!it->second.captures_,
              "cgraph: torch.autograd.grad with respect to a parameter of a graphed "
              "callable is not supported, because cgraph accumulates parameter grads "
              "itself (see Note [Parameter gradients]). Register a hook on that "
              "parameter before calling the graphed callable (p.register_hook(lambda g: g)) "
              "and its grad goes through autograd.");
  return it->second.should_execute();
}

// Whether this backward may write param p's store: always where its graph
// computes it in place; for a pool store another graph computed, only while
// no graph of that pool captured before the store is between its forward
// and backward replays, whose activations may lie in the store's memory
// (it was free at the store's capture).  The pool is asked once per
// backward: its stores are all in one pool but in rare cases.
class MayWriteStores {
 public:
  bool operator()(const Param& p) {
    const GradStore& s = *p.store;
    if (p.owns_store || !s.in_pool()) {
      return true;
    }
    if (s.ledger.get() != asked_) {
      asked_ = s.ledger.get();
      earliest_ = asked_ ? earliest_pending_forward(*s.ledger) : UINT64_MAX;
    }
    return s.writable_by_others(earliest_);
  }

 private:
  const PoolLedger* asked_ = nullptr;
  uint64_t earliest_ = UINT64_MAX;
};

// The general path of Note [Parameter gradients], after the replay.
void deliver_param_grads_generally(Engine& e, const std::vector<uint32_t>& fused,
                                   const ExecInfo* partial) {
  std::vector<at::Tensor> add_dst, add_src, copy_dst, copy_src;
  MayWriteStores may_write;
  for (const uint32_t j : fused) {
    Param& p = e.params[j];
    if ((partial && !named_by_partial_backward(*partial, p.tensor)) ||
        !p.tensor.requires_grad()) {  // frozen since its forward: choose_grad_path
      continue;
    }
    at::Tensor& grad = p.tensor.mutable_grad();
    if (grad.defined()) {
      add_dst.push_back(grad);
      add_src.push_back(p.grad);
      continue;
    }
    if (p.store->unheld() && may_write(p)) {
      grad = p.store->hand_out();
      if (p.owns_store) {
        continue;  // the graph computed it there
      }
    } else {
      grad = at::empty_like(p.tensor, at::MemoryFormat::Preserve);
    }
    copy_dst.push_back(grad);
    copy_src.push_back(p.grad);
  }
  launch_list(false, copy_dst, copy_src);
  launch_list(true, add_dst, add_src);
}

// How a backward delivers the grads of the parameters cgraph accumulates.
enum class GradPath { None, CopyTail, AddTail, General };

// Before the backward replay, since the tails are part of it, and after the
// stores it writes were released: the path for the parameters in `fused`
// (those requiring grad, without hooks, with a grad at capture).  An owned
// store is never handed_as its .grad here: that .grad was moved.
GradPath choose_grad_path(const Engine& e, const std::vector<uint32_t>& fused) {
  if (fused.empty()) {
    return GradPath::None;
  }
  // A parameter frozen between the forward and this backward (requires_grad_(False)
  // on a GAN's discriminator) gets no grad, as autograd's AccumulateGrad skips it:
  // only the general path can leave one out (the tails write every grad).
  for (const uint32_t j : fused) {
    if (!e.params[j].tensor.requires_grad()) {
      return GradPath::General;
    }
  }
  bool all_fresh = !partial_backward() && fused.size() == e.backward.num_grad_params();
  bool all_ours = all_fresh;
  MayWriteStores may_write;
  for (size_t k = 0; k < fused.size() && (all_fresh || all_ours); ++k) {
    const Param& p = e.params[fused[k]];
    const at::Tensor& grad = p.tensor.mutable_grad();
    all_ours = all_ours && p.store->handed_as(grad);
    all_fresh = all_fresh && !grad.defined() && p.store->unheld();
    if ((all_ours || all_fresh) && !may_write(p)) {
      all_ours = all_fresh = false;
    }
  }
  return all_ours ? GradPath::AddTail : all_fresh ? GradPath::CopyTail : GradPath::General;
}

// After the backward replay: param.grad for the parameters in `fused`.
void deliver_param_grads(Engine& e, const std::vector<uint32_t>& fused, GradPath path) {
  switch (path) {
    case GradPath::None:
      return;
    case GradPath::AddTail:
      ++e.stats.grads_added;
      return;
    case GradPath::CopyTail:
      for (const uint32_t j : fused) {
        e.params[j].tensor.mutable_grad() = e.params[j].store->hand_out();
      }
      ++e.stats.grads_copied;
      return;
    case GradPath::General:
      deliver_param_grads_generally(e, fused, partial_backward());
      ++e.stats.grads_slow;
      return;
  }
}

// Note [Incoming grads]
// Q: How does an incoming grad reach the backward graph's buffer for it?
// A: As an argument reaches the forward's (Note [Argument copies inside the
//    graph]), with two more ways in, since autograd hands a backward node
//    grads that no memcpy can copy:
//      - dense, laid out as the buffer: the buffer's copy slot;
//      - every element one element in memory (the expanded grad of .sum(),
//        of a broadcast): the graph copies that element into a one-element
//        buffer (a second copy slot), then broadcasts it into the buffer (an
//        optional segment, one kernel);
//      - no grad at all (an output the loss does not use): an optional
//        segment zeroes the buffer;
//      - anything else (a transposed grad): ATen copies it before the replay.
//    Every replay sets all four, so the graph's own ways cost no ATen call
//    and no launch of their own.
//    The buffers hold a grad only from these ways in to the graph's last
//    read of it, so they are temporaries of the backward graph, like its
//    other ones: the capture frees them into the pool, and later captures
//    take their blocks (varlen's layers held 16 MiB of them, one per layer
//    and shape).  The rules of Note [Captures that share a
//    pool] (aten_pool.cpp) that keep a graph's temporaries from overwriting
//    outputs, grads and activations still held cover them as they cover the
//    rest.  One thing is theirs alone: the graph writes them before it reads
//    anything, and an incoming grad may lie in one (the grad a later layer
//    captured into the freed block handed back), so a grad that overlaps a
//    buffer of this graph, other than lying exactly in its own, is cloned
//    first (counted in copied_before).  Lying exactly in its own, it is read
//    there: no copy at all.  (A backward that writes its grad_output in
//    place then writes that grad, which only autograd holds: one held
//    elsewhere was moved out first, Note [Grads handed to autograd], but
//    for kept_outputs='alias', which moves nothing.)
bool aliases_one_element(const at::Tensor& t) {
  if (t.numel() <= 1) {
    return false;
  }
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) != 0) {
      return false;
    }
  }
  return true;
}

// The bytes `t` spans, as [begin, end): strides are never negative.
std::pair<uintptr_t, uintptr_t> bytes_spanned(const at::Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  return {begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

// Whether `grad` overlaps an incoming-grad buffer of `e` other than lying
// exactly in `own`'s: the graph writes those before it reads `grad` (Note
// [Incoming grads]).
bool overlaps_grad_buffers(const Engine& e, const GradIn& own, const at::Tensor& grad) {
  if (!grad.defined() || grad.numel() == 0 || !grad.is_cuda()) {
    return false;
  }
  const auto [begin, end] = bytes_spanned(grad);
  for (const Output& o : e.outputs) {
    if (!o.grad_in || o.grad_in->buffer.numel() == 0) {
      continue;
    }
    const at::Tensor& b = o.grad_in->buffer;
    const auto [b_begin, b_end] = bytes_spanned(b);
    const bool exactly_own = &*o.grad_in == &own && begin == b_begin &&
                             grad.sizes().equals(b.sizes()) && grad.strides().equals(b.strides());
    if (begin < b_end && b_begin < end && !exactly_own) {
      return true;
    }
  }
  return false;
}

// Before the backward replay: sets every way into in.buffer for `grad`.
// Returns true if the caller must copy *staged into the buffer first.
bool route_incoming_grad(Engine& e, const GradIn& in, const at::Tensor& grad,
                         at::Tensor* staged) {
  Graph& g = *e.bwd;
  bool copy = false, element = false, zero = false, before = false;
  if (!grad.defined()) {
    zero = true;
  } else if (needs_copy(in.buffer, grad, staged)) {
    element = aliases_one_element(grad) && g.copy_in_from(in.element, grad.const_data_ptr());
    copy = !element && g.copy_in(in.copy, in.buffer, *staged);
    before = !element && !copy;
  }
  if (!copy) {
    g.skip_copy_in(in.copy);
  }
  if (!element) {
    g.skip_copy_in(in.element);
  }
  g.set_segment(in.broadcast, element);
  g.set_segment(in.zero, zero);
  e.stats.copied_in_graph += copy || element;
  return before;
}

struct GraphedBackward final : autograd::Node {
  GraphedBackward(std::shared_ptr<Engine> engine, BackwardWiring&& wiring)
      : autograd::Node(std::move(wiring.edges)),
        engine(std::move(engine)),
        generation(this->engine->generation),
        ran(false),
        sources(std::move(wiring.sources)),
        fused_params(std::move(wiring.fused)),
        ungraded(wiring.ungraded) {}

  std::string name() const override { return "CGraphBackward"; }
  autograd::variable_list apply(autograd::variable_list&& grads) override;

  std::shared_ptr<Engine> engine;
  uint64_t generation;  // the forward replay this backward belongs to
  // Set when apply() starts: Note [Calls before their backwards].
  std::atomic<bool> ran;
  std::vector<EdgeSource> sources;     // per next edge
  std::vector<uint32_t> fused_params;  // parameters whose grads apply() accumulates
  bool ungraded;                       // some edge is an UngradedInput

 private:
  void refuse_double_backward() const;
  void refuse_ungraded_inputs();
  void check_replayable() const;
  TensorVec route_incoming_grads(const autograd::variable_list& grads);
  void launch(GradPath path);
  autograd::variable_list edge_grads();
};

// An argument that required grad unlike its sample has no grad in the
// backward graph: a backward that needs it raises, one that does not (it
// asks for other grads, or the argument's history needs none) goes on.
void GraphedBackward::refuse_ungraded_inputs() {
  for (size_t m = 0; ungraded && m < sources.size(); ++m) {
    const EdgeSource& s = sources[m];
    TORCH_CHECK(s.kind != EdgeSource::Kind::UngradedInput || !task_should_compute_output(m),
                "cgraph: argument '", engine->inputs[s.index].name, "' requires grad, but "
                "its sample did not, so the backward graph computes no grad for it. Graph "
                "again with a sample that requires grad (sample.requires_grad_()), or pass "
                "the argument detached.");
  }
}

void GraphedBackward::check_replayable() const {
  const Engine& e = *engine;
  TORCH_CHECK(e.alive(), "cgraph: backward through a graphed callable that was reset() "
              "after this forward ran.");
  TORCH_CHECK(!ran.load(), "cgraph: a second backward through the same graphed call "
              "(retain_graph=True). The backward graph reuses the memory of the forward's "
              "activations, so each call supports one backward: sum the losses and run one "
              "backward ((loss1 + loss2).backward()), or call the graphed callable again "
              "before the next backward.");
  TORCH_CHECK(generation == e.generation, "cgraph: this graphed callable ran forward ",
              e.generation - generation, " more time(s) before this backward, which "
              "overwrote the activations it needs. Please report this: cgraph runs such "
              "calls eagerly (Note [Calls before their backwards]).");
}

// 1. Incoming grads into the graph's grad buffers, by the graph where it
//    can: Note [Incoming grads].  grads[k] is the k-th output attached.
// Returns the clones the graph copies from, to keep alive until the launch.
TensorVec GraphedBackward::route_incoming_grads(const autograd::variable_list& grads) {
  Engine& e = *engine;
  TensorVec dst, src, clones;
  size_t k = 0;
  for (const Output& o : e.outputs) {
    if (!attaches(o, ungraded)) {
      continue;
    }
    at::Tensor staged, apart;
    if (o.grad_in && C10_UNLIKELY(overlaps_grad_buffers(e, *o.grad_in, grads[k]))) {
      apart = grads[k].detach().clone();
      ++e.stats.copied_before;
    }
    if (o.grad_in &&
        route_incoming_grad(e, *o.grad_in, apart.defined() ? apart : grads[k], &staged)) {
      dst.push_back(o.grad_in->buffer);
      src.push_back(std::move(staged));
    } else if (staged.defined() && !staged.is_same(grads[k])) {
      clones.push_back(std::move(staged));
    }
    ++k;
  }
  e.stats.copied_before += dst.size();
  copy_all(dst, src);
  return clones;
}

// 3. The backward graph, with the tail `path` chose.
void GraphedBackward::launch(GradPath path) {
  Engine& e = *engine;
  e.bwd->set_segment(e.backward.tail_copy(), path == GradPath::CopyTail);
  e.bwd->set_segment(e.backward.tail_add(), path == GradPath::AddTail);
  if (e.rng.has_regions()) {
    e.rng.before_backward_replay();
  }
  RECORD_FUNCTION("cgraph::replay_backward_graph", std::vector<c10::IValue>());
  e.launch(*e.bwd);
  ++e.stats.backward;
}

// 4. Grads for the autograd edges.  Inputs: the static buffers, handed out
//    as Note [Grads handed to autograd] (aten_replay.cpp) says.  Hooked
//    parameters: a copy, since their grads are graph temporaries.
autograd::variable_list GraphedBackward::edge_grads() {
  Engine& e = *engine;
  autograd::variable_list out(sources.size());
  for (size_t m = 0; m < sources.size(); ++m) {
    const EdgeSource& s = sources[m];
    if (s.kind == EdgeSource::Kind::Input) {
      out[m] = e.hand_out_grad(e.inputs[s.index]);
    } else if (s.kind == EdgeSource::Kind::Param) {
      out[m] = e.params[s.index].grad.clone();
    }
  }
  return out;
}

// Autograd runs a node with grad mode on only under create_graph=True
// (torch.autograd.grad(..., create_graph=True), a gradient penalty, a
// Hessian-vector product): the grads this node hands back and accumulates
// are replayed, without history, so a second backward through them would
// silently miss the graphed part's terms.
void GraphedBackward::refuse_double_backward() const {
  TORCH_CHECK(!at::GradMode::is_enabled(), "cgraph: a backward with create_graph=True "
              "(double backward: a gradient penalty, a Hessian-vector product) through a "
              "graphed callable, whose backward graph replays grads without their history. "
              "Run it eagerly for such passes: the function you graphed itself, or a graphed "
              "module's class forward (type(module).forward(module, *args)); or reset() its "
              "graphs (module.forward.reset() for a module cgraph graphed in place).");
}

autograd::variable_list GraphedBackward::apply(autograd::variable_list&& grads) {
  refuse_double_backward();
  refuse_ungraded_inputs();
  if (!engine->backward.exists()) {
    return autograd::variable_list(sources.size());  // only ungraded edges, none needed
  }
  check_replayable();
  engine->check_backward_replayable();  // Note [Captures that share a pool] (aten_pool.cpp)
  engine->check_param_memory(CG_BACKWARD);
  engine->release_later_outputs(CG_BACKWARD, grads);
  ran = true;
  const TensorVec clones = route_incoming_grads(grads);
  // 2. Which tail delivers the parameter grads: Note [Parameter gradients].
  const GradPath path = choose_grad_path(*engine, fused_params);
  launch(path);
  {
    RECORD_FUNCTION("cgraph::parameter_grads", std::vector<c10::IValue>());
    deliver_param_grads(*engine, fused_params, path);
  }
  return edge_grads();
}

}  // namespace

bool attaches(const Output& o, bool ungraded) {
  return o.requires_grad || (ungraded && at::isFloatingType(o.buffer.scalar_type()));
}

// Note [Calls before their backwards]
// Q: A graph keeps one set of activations.  What if a callable is called
//    again before the backward of its previous call ran (a siamese model,
//    several micro-batches' forwards before their backwards, an eval loop
//    under grad mode that keeps its outputs)?
// A: A replay would overwrite the activations that backward needs; torch's
//    make_graphed_callables then computes wrong grads without a word.
//    cgraph knows whether the latest replay's backward is still to run: the
//    engine holds its node weakly, and the node says when it has run.  While
//    it is pending, a call replays another instance of the graph, with
//    activations of its own, or runs the callable eagerly (graphed.c: Note
//    [Several graphs per callable]; counted in stats as eager_pending), so
//    every backward, in any order, sees its own activations.  A node that
//    was dropped without running (its outputs freed, or no backward needed
//    it) is no longer pending.
bool Engine::backward_pending() const {
  const NodePtr node = latest_node.lock();
  return node && !static_cast<const GraphedBackward*>(node.get())->ran.load();
}

NodePtr make_backward_node(std::shared_ptr<Engine> engine, BackwardWiring&& wiring) {
  return make_node<GraphedBackward>(std::move(engine), std::move(wiring));
}


}  // namespace cgraph
