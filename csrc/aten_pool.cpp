// aten_pool.cpp -- the graphs that share one memory pool, and when each of
// them may replay without overwriting memory another one still needs.
#include "aten_engine.hpp"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>

namespace cgraph {

// Note [Captures that share a pool]
// Q: Graphs of one callable (Note [Several graphs per callable] in graphed.c), callables
//    graphed together, and callables graphed separately with one pool= (cgraph/_group.py)
//    capture into one pool.  When may one of them replay?
// A: A capture takes the pool's free blocks, which its replays write again: earlier captures'
//    temporaries, and an earlier forward capture's activations once its backward capture ran
//    (autograd freed them).  Two kinds of data outlive a replay:
//    - Activations: engine H needs them from its forward replay to its backward replay (H is
//      pending), and only a graph G captured while they were allocated, from H's forward
//      capture to its backward capture (or later: Note [Layers captured one by one into one
//      pool]), could not take them.  So G may replay only while every pending H but its own
//      engine (for its backward) spans G's capture (activations_span()): always, when
//      forwards captured in call order and backwards in reverse (capture.c) replay so.
//    - What H handed out: its outputs, allocated at its forward capture, and its input grads
//      and param.grad, at its backward capture (Note [Outputs of earlier calls] and Note
//      [Grads handed to autograd] in aten_replay.cpp; Note [Parameter gradients] in
//      aten_backward.cpp).  Kept allocated (until freed: Notes [Static memory freed once its
//      pass is over] and [An output freed once its reader has captured]), they are written
//      only by H's replays and graphs captured before them, so before G replays, forward or
//      backward (later engines may have replayed since G's forward), what was allocated after
//      G's capture and is still held moves to memory of its own (release_later_outputs).
//    PoolLedger numbers the captures, lists the engines and keeps the parameter grads' stores
//    gone engines left to others.  torch leaves both rules to the user ("replay in capture
//    order"); cgraph runs a forward that may not replay (may_replay_forward) eagerly or
//    captures it again elsewhere, and refuses such a backward, which has no eager fallback
//    (check_backward_replayable).  Checked (Note [Checked invariants]): a backward numbered
//    after its forward (note_capture); with CGRAPH_DEBUG=1, may_replay_forward() at each
//    forward replay and held_where_written(), release_later_outputs redone without shortcuts.
//
// Note [Layers captured one by one into one pool]
// Q: Layers graphed separately with one pool= and no samples (cgraph/_group.py) are each
//    captured on their first call, forward and backward together, while the layers after them
//    are still to run.  How can the next layer's capture share the pool without taking the
//    memory of this layer's activations, which its backward will read?
// A: These captures keep their activations (keep_activations): the backward capture retains
//    the forward's autograd graph and the engine holds its outputs' autograd nodes
//    (PoolMember::keep_history), so no later capture takes those blocks.  The next layer's
//    may take this backward capture's temporaries: that layer is done with its activations
//    and grad buffers when this backward replays (after its own), and its outputs and grads
//    still held move out first (Note [Captures that share a pool]).  The activations are
//    released at the first capture into the pool after the backward ran (or the outputs
//    died), which release_kept numbers as the end of activations_span().  So a pass's
//    forwards replay while earlier layers' backwards are pending, and its backwards in
//    reverse, as if captured together, with no eager pass and no warm-up but each layer's
//    own.  Within one pass: a second (a layer called again, its backward pending) is captured
//    elsewhere (cg_pool_open_to_layers says why).  Checked: keep_activations in
//    keep_history(), always; the spans as in Note [Captures that share a pool].
//
// Note [A layer reading the one before it in place]
// Q: Layer k+1 is called with layer k's output, both graphed into one pool
//    (cgraph/_group.py).  Why copy it into a static input of its own?
// A: It need not be: its graphs are captured reading layer k's static output in place (the
//    sample is a view of it: static_output_in) and take only calls that pass that memory
//    itself (Input::in_place, fits), so nothing copies into it: a buffer per layer and shape
//    and a copy per call saved.  Exact because only layer k's forward replays and graphs
//    captured before layer k (their temporaries may lie there) write that memory: before any
//    of them replays, a held output of layer k moves out (a call passing it then passes other
//    memory, misses, and gets a graph that copies), and none replays while layer k+1, whose
//    backward may read it too, is pending (they lie outside its activations_span()).
//    Input::owner keeps the memory allocated: Notes [Static memory freed once its pass is
//    over] and [An output freed once its reader has captured].  Not an output that is itself
//    a view of another (a layer returning a view of its input): that one copies.  Checked with
//    CGRAPH_DEBUG=1: reads_in_place_from_owner() at each forward replay.
//
// Note [Static memory freed once its pass is over]
// Q: Layers captured one by one into one pool keep every graph's static outputs (and input
//    grads that were not freed at their capture) allocated while the graphs live, each new
//    shape's beside the older shapes' (varlen's pool grew 24 MiB over three new shapes).  Must
//    they stay allocated?
// A: Only from a replay to the end of its pass, as the activations: then only a caller who
//    kept one reads them, and the engine's next replay writes them afresh.  So
//    release_kept_activations frees them too for engines whose pass is over (pass_finished,
//    free_statics; an output mostly went earlier: Note [An output freed once its reader has
//    captured]); the graphs keep the addresses (non-owning views), and later captures take
//    the blocks as they take temporaries.  Exact because:
//    - Graphs captured after the free may write the blocks: before one replays, what the
//      engine handed out and is still held moves out, as for an engine captured after it
//      (freed_statics_before, in release_later_outputs; earlier graphs skip the walk).  The
//      engine's own replays may write what those graphs use, but theirs moved out already,
//      and neither replays while the other is pending (the free follows the end of the
//      engine's activations_span()).
//    - An output the next layer reads in place (Note [A layer reading the one before it in
//      place]) is held by that layer's engine too from before its capture (Input::owner, set
//      by claim_read_in_place, since the sample the spec keeps is a non-owning view), so it
//      is freed only once that layer is done with it too.  No capture reads in place an
//      output of an engine that freed memory (static_output_in), nor does an engine free any
//      at the release of a capture about to read its output: that capture could take the
//      very block it reads or, if later, move its own argument out as a freed engine's.
//    - An engine that freed memory moves out what the caller still holds of it as it goes
//      (~Engine): nothing keeps that memory then, and the pool may go with the engine.
//    A storage is freed only when the engines' own references are all it has: memory anybody
//    else holds stays allocated (an output the caller kept, a module's buffer returned as an
//    output, an input buffer, which may lie outside the pool), as does that of
//    kept_outputs='alias', handed out untracked.  Checked: past_capture() of every engine
//    whose memory free_statics frees, always; a capture reading freed memory in place is
//    refused (note_inputs_in_place); with CGRAPH_DEBUG=1, held_where_written() and
//    reads_in_place_from_owner() at replay.
//
// Note [An output freed once its reader has captured]
// Q: Even so, a pass of layers captured one by one held every layer's output beside the next
//    layers' activations (the sharded benchmark's twelve decoder layers: 0.75 GiB at a large
//    batch), where eager frees each once the next layer has read it.  Must they stay so long?
// A: Only while somebody may read them: the callers, the layer reading the output in place
//    (its forward), and a backward that saved it.  So release_kept_activations frees an
//    engine's outputs once its backward is captured (past_capture), nobody else holds them,
//    and the layer reading one in place is done with it: captured too, and its forward capture
//    kept nothing of it (Input::kept_by_capture).  Exact because:
//    - The kept activations are the outputs' autograd nodes, not the outputs
//      (forget_capture_autograd): what the engine's own backward saved of an output holds
//      its storage, so the output stays.
//    - The reader's callable ran its forward capture on a view of its own (capture_inputs,
//      aten_capture.cpp): a storage made for that capture alone, passing grads through to the
//      sample.  Whatever its autograd saved, a module, a closure or a ctx attribute kept of
//      the argument, or an output that is a view of it, keeps that storage alive as the
//      backward capture starts, when all the backward graph will read is; a weak reference
//      tells then (note_capture_views_kept), not later: a backward may drop what it read.
//      (The sample cannot tell: the spec keeps it, and autograd's accumulator of its grad.
//      Warm-up calls pass the sample, so a callable that kept its warm-up argument and used
//      that, not its argument, in the capture would pass unseen: state of that kind is
//      outside what graphs replay anyway.)
//    - Graphs captured after the free may write the blocks, in a pass after the reader's
//      forward: before one replays, a held output moves out (freed_statics_before, as in
//      Note [Static memory freed once its pass is over]); a caller keeping an output across
//      them (a skip connection) passes the moved copy on, which misses the graph reading it
//      in place and takes another.  The graphs captured before the free that write the block
//      (the engine's forward) replay only while no later capture's backward is pending
//      (may_replay_forward), as for any temporaries.
//    Only the engine whose output it is counts as having freed memory: freeing the reader's
//    Input::owner so moves nothing of the reader's, since no output of the reader is a view
//    of it (one would have kept the capture's view).  Freed once the reader's pass is over,
//    it counts for the reader too, whose outputs may be.  Checked as in the Note above.
//
// Note [Input grads freed at their capture]
// Q: A layer captured one by one into a shared pool kept the grads its backward graph computes
//    for its inputs allocated from its capture until its pass was over, so every layer's at
//    once: the sharded benchmark's twelve decoder layers held 0.75 GiB of them at a large
//    batch, where eager frees each once the layer below has read it.  Must they stay?
// A: No: once the backward capture ends they are temporaries of its graph (free_input_grads),
//    whose blocks later captures (the next layer's forward first) may take; the graph keeps the
//    addresses.  A replay hands each out as before (Input::handed, Note [Grads handed to
//    autograd] in aten_replay.cpp), and the layer below reads it as its backward starts, right
//    after, before any graph captured later replays.  Exact because the only graphs that may
//    now write a block besides those captured before it (which Note [Captures that share a
//    pool] covers already) are those captured after the free, and before one of them replays a
//    handed grad still held moves out (freed_grads_before, in move_later_outputs), as for
//    memory freed once a pass is over; so before a warm-up in the pool (move_held_out_of_freed)
//    and when the engine goes (borrows_memory).  Only a grad whose memory nothing else refers
//    to is freed (not a view of a buffer that another input's grad shares), and not with
//    kept_outputs='alias', which hands the buffers out untracked.  Checked with CGRAPH_DEBUG=1:
//    held_where_written() at each replay.
struct PoolLedger {
  std::mutex mutex;  // backward replays check it from autograd's threads
  uint64_t captures = 0;
  std::vector<std::weak_ptr<Engine>> engines;  // in the order of their forward captures
  // The numbers of the latest forward and backward captures: a replay of
  // the engine captured last has no later engine's outputs or grads to
  // move, and skips the mutex.
  std::atomic<uint64_t> latest_forward{0};
  std::atomic<uint64_t> latest_backward{0};
  // The earliest capture number its engines' statics or input grads were freed at: a replay
  // of a graph captured before it has no freed memory to look after either.
  std::atomic<uint64_t> earliest_freed{UINT64_MAX};
  // The pool stores of parameter grads whose first engine is gone while
  // later graphs share them (while it lives, it releases them itself):
  // Note [Parameter gradients].
  std::vector<std::weak_ptr<GradStore>> orphans;
  // A layer was called again before its backward ran (a second pass), and a
  // backward of the pool has been pending ever since: cg_pool_open_to_layers.
  bool later_pass = false;
};

namespace {

std::mutex ledgers_mutex;
std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<PoolLedger>> ledgers;

// The ledger of `pool`, made on its first capture.
std::shared_ptr<PoolLedger> ledger_of(at::cuda::MempoolId_t pool, bool make) {
  std::lock_guard<std::mutex> hold(ledgers_mutex);
  for (auto it = ledgers.begin(); it != ledgers.end();) {
    it = it->second.expired() ? ledgers.erase(it) : std::next(it);
  }
  auto& weak = ledgers[{pool.first, pool.second}];
  std::shared_ptr<PoolLedger> ledger = weak.lock();
  if (!ledger && make) {
    ledger = std::make_shared<PoolLedger>();
    weak = ledger;
  }
  return ledger;
}

// The live engines of `ledger`; under its mutex.  An engine whose last
// other reference goes meanwhile is destroyed after the mutex is released:
// its destructor frees autograd nodes, which may take the GIL.
template <class Visit>
void for_each_engine(PoolLedger& ledger, Visit&& visit) {
  c10::SmallVector<std::shared_ptr<Engine>, 4> last;  // outlives `hold`
  std::lock_guard<std::mutex> hold(ledger.mutex);
  for (const auto& weak : ledger.engines) {
    if (auto engine = weak.lock()) {
      visit(engine);
      if (engine.use_count() == 1) {
        last.push_back(std::move(engine));
      }
    }
  }
}

// The orphaned pool stores allocated after capture number `at` that may be
// held.
c10::SmallVector<std::shared_ptr<GradStore>, 4> orphans_after(PoolLedger& ledger, uint64_t at) {
  c10::SmallVector<std::shared_ptr<GradStore>, 4> found;
  std::lock_guard<std::mutex> hold(ledger.mutex);
  for (const auto& weak : ledger.orphans) {
    auto store = weak.lock();
    if (store && store->allocated_at > at && store->may_be_held()) {
      found.push_back(std::move(store));
    }
  }
  return found;
}

}  // namespace

// ---- PoolMember: an engine's place in its pool, written only here -------

void PoolMember::note_capture(Engine& engine, at::cuda::MempoolId_t pool, cg_pass pass) {
  if (!ledger_) {
    ledger_ = ledger_of(pool, /*make=*/true);
  }
  std::lock_guard<std::mutex> hold(ledger_->mutex);
  captured_at_[pass] = ++ledger_->captures;
  CG_INVARIANT(pass == CG_FORWARD || (captured_at_[CG_FORWARD] != 0 &&
                                      captured_at_[CG_FORWARD] < captured_at_[CG_BACKWARD]),
               "a backward capture numbered before its forward's.");
  if (pass == CG_BACKWARD) {  // the capture frees the activations, unless kept
    released_at_ = keep_activations_ ? UINT64_MAX : captured_at_[pass];
    ledger_->latest_backward.store(captured_at_[pass]);
  }
  if (pass == CG_FORWARD) {
    auto& engines = ledger_->engines;
    engines.erase(std::remove_if(engines.begin(), engines.end(),
                                 [](const auto& weak) { return weak.expired(); }),
                  engines.end());
    engines.push_back(engine.weak_from_this());
    ledger_->latest_forward.store(captured_at_[pass]);
  }
}

void PoolMember::keep_history(NodePtr node) {
  CG_INVARIANT(keep_activations_, "activations kept by an engine not captured to keep them.");
  kept_history_.push_back(std::move(node));
}

std::vector<NodePtr> PoolMember::release_kept(uint64_t at) {
  released_at_ = at;  // later captures may take them
  return std::exchange(kept_history_, {});
}

void PoolMember::note_statics_freed(uint64_t at) {
  statics_freed_at_ = std::min(statics_freed_at_, at);
}

void PoolMember::note_input_grads_freed() {
  std::lock_guard<std::mutex> hold(ledger_->mutex);
  input_grads_freed_at_ = ++ledger_->captures;  // later captures may take them
  ledger_->earliest_freed.store(
      std::min(ledger_->earliest_freed.load(), input_grads_freed_at_));
}

void PoolMember::forget_history() noexcept {
  kept_history_.clear();
}

namespace {

// Whether `b` and `sample` are the same view: the same memory, laid out
// alike (a sample is a view of static output `b`).
bool same_view(const at::Tensor& b, const at::Tensor& sample) {
  return b.defined() && b.const_data_ptr() == sample.const_data_ptr() &&
         b.sizes().equals(sample.sizes()) && b.strides().equals(sample.strides()) &&
         b.scalar_type() == sample.scalar_type();
}

}  // namespace

// The samples of cgraph/_group.py's captures, the only ones that keep their
// activations, are copies or the non-owning views static_output_in made:
// an input is read in place exactly when claim_read_in_place found the
// output its view shows.
void Engine::note_inputs_in_place() {
  for (Input& in : inputs) {
    TORCH_CHECK(in.owner.defined() || !is_non_owning_view(in.buffer), "cgraph: argument '",
                in.name, "' is the output of a graph that was reset, or whose memory was "
                "freed, before this capture, which would read it in place. Call the "
                "callable again.");
    in.in_place = in.owner.defined();
  }
}

std::optional<at::Tensor> static_output_in(at::cuda::MempoolId_t pool, const at::Tensor& t) {
  const std::shared_ptr<PoolLedger> ledger = ledger_of(pool, /*make=*/false);
  std::optional<at::Tensor> found;
  if (!ledger || !t.is_cuda() || !t.has_storage()) {
    return found;
  }
  const void* where = nullptr;
  try {
    where = t.const_data_ptr();
  } catch (const c10::Error&) {
    return found;  // an output kept_outputs='error' made unreadable
  }
  for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
    for (const Output& o : h->outputs) {
      // Not an engine that freed memory (Note [Static memory freed once its
      // pass is over]), nor an output that is a view of another's memory,
      // which no engine could keep allocated (claim_read_in_place).
      if (!found && h->alive() && !h->member.freed_statics() && where != nullptr &&
          !is_non_owning_view(o.buffer) && same_view(o.buffer, t)) {
        found = non_owning_view(o.buffer);  // the reader's Input::owner keeps it
      }
    }
  });
  return found;
}

void Engine::note_latest_node(const NodePtr& node) {
  // Only a node that replays the backward graph reads the activations.
  WeakNodePtr latest(backward.exists() ? node : NodePtr());
  // Backward replays on autograd's threads read it (check_backward_replayable).
  std::unique_lock<std::mutex> hold;
  if (const auto& ledger = member.ledger()) {
    hold = std::unique_lock<std::mutex>(ledger->mutex);
  }
  latest_node = std::move(latest);
}

bool Engine::may_replay_forward() const {
  bool may = true;
  if (const auto& ledger = member.ledger()) {
    const uint64_t at = member.captured_at(CG_FORWARD);
    for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
      may = may && !(h->backward_pending() && !h->member.activations_span(at));
    });
  }
  return may;
}

void Engine::check_backward_replayable() const {
  bool may = true;
  if (const auto& ledger = member.ledger()) {
    const uint64_t at = member.captured_at(CG_BACKWARD);
    for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
      may = may && (h.get() == this || !h->backward_pending() || h->member.activations_span(at));
    });
  }
  TORCH_CHECK(may, "cgraph: this backward would overwrite activations that another graph of "
              "its memory pool still needs for its own backward, which has not run yet. "
              "Graphs sharing a pool (graphed together, or with one pool=) must run their "
              "backwards in the reverse order of their forwards: compute one loss from "
              "every output and call backward once, or graph these callables with pools "
              "of their own.");
}

// Whether another engine's backward was captured after capture number `at`
// of this one; false only where none was.
bool Engine::later_backward_of_another(uint64_t at) const {
  const uint64_t latest = member.ledger()->latest_backward.load();
  const uint64_t own = member.captured_at(CG_BACKWARD);
  return latest > at && !(latest == own && own - at <= 1);  // none between `at` and own
}

void Engine::release_later_outputs(cg_pass pass, at::ArrayRef<at::Tensor> consumed) {
  release_handed_grads(consumed);  // both of its graphs may write them
  if (C10_LIKELY(!planted(Fault::SkipLaterMoves))) {
    move_later_outputs(pass, consumed);
  }
  CG_DEBUG_INVARIANT(!held_where_written(pass, consumed), "a replay of the ",
                     pass == CG_FORWARD ? "forward" : "backward", " graph (capture ",
                     member.captured_at(pass), " of its pool) would overwrite an output or "
                     "grad that somebody still holds (Note [Captures that share a pool]).");
}

void Engine::move_later_outputs(cg_pass pass, at::ArrayRef<at::Tensor> consumed) {
  const uint64_t at = member.captured_at(pass);
  const auto& ledger = member.ledger();
  if (!ledger || (ledger->latest_forward.load() <= at && !later_backward_of_another(at) &&
                  ledger->earliest_freed.load() > at)) {
    return;
  }
  c10::SmallVector<std::shared_ptr<Engine>, 8> outputs_of, grads_of;
  for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
    // Note [Static memory freed once its pass is over]
    const bool freed_before = h->member.freed_statics_before(at);
    if ((h->member.captured_at(CG_FORWARD) > at || freed_before) && h->handed.has_outputs()) {
      outputs_of.push_back(h);
    }
    // Note [Input grads freed at their capture]
    if (h.get() != this &&
        (h->member.captured_at(CG_BACKWARD) > at || h->member.freed_grads_before(at)) &&
        h->may_hold_grads()) {
      grads_of.push_back(h);
    }
  });
  for (const auto& h : outputs_of) {  // outside the mutex: this allocates
    h->release_earlier_outputs();
  }
  for (const auto& h : grads_of) {
    h->release_handed_grads(consumed);
  }
  for (const auto& store : orphans_after(*ledger, at)) {
    stats.param_grads_copied += store->release();
  }
}

// Note [Checked invariants] (aten_checks.cpp): what release_later_outputs
// decided with its shortcuts, recomputed without them.
bool Engine::held_where_written(cg_pass pass, at::ArrayRef<at::Tensor> consumed) const {
  bool held = holds_grads_in_place(consumed) || (pass == CG_FORWARD && holds_outputs_in_place());
  const auto& ledger = member.ledger();
  if (!ledger) {
    return held;
  }
  const uint64_t at = member.captured_at(pass);
  for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
    const bool freed_before = h->member.freed_statics_before(at);
    held = held || ((h->member.captured_at(CG_FORWARD) > at || freed_before) &&
                    h->holds_outputs_in_place());
    held = held ||
           ((h->member.captured_at(CG_BACKWARD) > at || h->member.freed_grads_before(at)) &&
            h->holds_grads_in_place(consumed));
  });
  for (const auto& store : orphans_after(*ledger, at)) {
    held = held || store->held_by_others();
  }
  return held;
}

void note_orphan_store(const std::shared_ptr<GradStore>& store) {
  PoolLedger& ledger = *store->ledger;
  std::lock_guard<std::mutex> hold(ledger.mutex);
  auto& stores = ledger.orphans;
  stores.erase(std::remove_if(stores.begin(), stores.end(),
                              [](const auto& weak) { return weak.expired(); }),
               stores.end());
  stores.push_back(store);
}

bool Engine::shares_pool_with_others() const {
  bool others = false;
  if (const auto& ledger = member.ledger()) {
    for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
      others = others || h.get() != this;
    });
  }
  return others;
}

uint64_t earliest_pending_forward(PoolLedger& ledger) {
  uint64_t earliest = UINT64_MAX;
  for_each_engine(ledger, [&](const std::shared_ptr<Engine>& h) {
    if (h->backward_pending()) {
      earliest = std::min(earliest, h->member.captured_at(CG_FORWARD));
    }
  });
  return earliest;
}

bool pool_busy(at::cuda::MempoolId_t pool, bool unkept_only) {
  const std::shared_ptr<PoolLedger> ledger = ledger_of(pool, /*make=*/false);
  bool busy = false;
  if (ledger) {
    for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
      busy = busy || (h->backward_pending() && !(unkept_only && h->member.holds_activations()));
    });
  }
  return busy;
}

}  // namespace cgraph

// Note [Layers captured one by one into one pool]: a layer called again
// before its backward ran (a second micro-batch, of any shape) starts a
// second pass, whose captures go elsewhere: the first pass's backwards run
// before the second's and would overwrite their activations.  The pass
// lasts while a backward of the pool is pending, and a layer first called
// in it can tell only from here.  (One first called as the pass's very first
// call cannot be told from a layer of the first pass: its capture makes the
// first pass's backward raise, in check_backward_replayable.)
extern "C" int cg_pool_open_to_layers(cg_pool pool, int called_again) {
  try {
    const at::cuda::MempoolId_t id{pool.first, pool.second};
    const std::shared_ptr<cgraph::PoolLedger> ledger = cgraph::ledger_of(id, /*make=*/false);
    const bool busy = cgraph::pool_busy(id, false), released_only = cgraph::pool_busy(id, true);
    bool later = called_again != 0;
    if (ledger) {  // else no graph there: no pass to remember
      std::lock_guard<std::mutex> hold(ledger->mutex);
      ledger->later_pass = later = (ledger->later_pass && busy) || later;
    }
    return later || released_only ? 0 : 1;
  } catch (const std::exception&) {
    return 0;  // a capture elsewhere is always exact
  }
}

namespace cgraph {

namespace {

// Whether engine `e`'s pass is over: its backward ran and its kept
// activations were released, so it reads its static memory again only at its
// next replay, which writes it first.  Its outputs must be tracked to be
// moved out of the way (not kept_outputs='alias').
bool pass_finished(const Engine& e) {
  return e.alive() && e.backward.exists() && e.member.keeps_activations() &&
         e.kept_outputs != CG_KEEP_ALIAS && e.member.released_kept() && !e.backward_pending();
}

// Whether engine `e` captured its backward keeping its activations: its
// outputs need no longer stay allocated, only what its pending backward
// reads (Note [An output freed once its reader has captured]).
bool past_capture(const Engine& e) {
  return e.alive() && e.backward.exists() && e.member.keeps_activations() &&
         e.kept_outputs != CG_KEEP_ALIAS && e.member.captured_at(CG_BACKWARD) != 0;
}

// A reference an engine keeps to static memory, which freeing that memory
// replaces with a non-owning view.
struct StaticRef {
  c10::StorageImpl* storage;
  at::Tensor* tensor;
  Engine* engine;
  // An output of an engine past its capture, one read in place by an engine
  // done with it, an input grad or in-place input of one whose pass is over.
  bool freeable;
  // Whether freeing it frees memory of the engine's: memory its outputs or
  // grads may lie in, so that it counts as having freed (freed_statics).
  // Not Input::owner freed once the reader's capture kept nothing of it,
  // which no output of the reader can alias.
  bool engines_memory;
};

// The references `e` keeps to memory that is still its own (not a
// non-owning view already).  Its outputs stay while a capture about to read
// them (`read_now`) could take their blocks.
void collect_static_refs(Engine& e, bool read_now, std::vector<StaticRef>& refs) {
  const bool over = pass_finished(e) && !read_now;
  const bool captured = past_capture(e);
  const auto add = [&](at::Tensor& t, bool freeable, bool engines_memory = true) {
    if (t.defined() && t.has_storage() && !is_non_owning_view(t)) {
      refs.push_back({t.storage().unsafeGetStorageImpl(), &t, &e, freeable, engines_memory});
    }
  };
  for (Output& o : e.outputs) {
    add(o.buffer, captured && !read_now);
  }
  for (Input& in : e.inputs) {
    if (over && !alias_may_be_held(in.handed)) {
      in.handed = at::Tensor();  // the engine's own alias keeps the grad's memory
    }
    add(in.buffer, over && in.in_place);  // a copied-in buffer may lie outside the pool
    // Its forward replay reads it, its backward only where its capture kept the view.
    const bool done_early = captured && !in.kept_by_capture;
    add(in.owner, over || done_early, /*engines_memory=*/!done_early);
    add(in.grad, over);
  }
}

// Whether the references [first, last) to one storage are all it has, each
// freeable: nobody else holds the memory.
bool only_freeable_refs(const StaticRef* first, const StaticRef* last) {
  c10::SmallVector<std::pair<const at::Tensor*, size_t>, 4> impls;  // distinct, with counts
  for (const StaticRef* r = first; r != last; ++r) {
    if (!r->freeable) {
      return false;
    }
    auto same = std::find_if(impls.begin(), impls.end(), [&](const auto& seen) {
      return seen.first->unsafeGetTensorImpl() == r->tensor->unsafeGetTensorImpl();
    });
    if (same == impls.end()) {
      impls.emplace_back(r->tensor, 1);
    } else {
      ++same->second;
    }
  }
  for (const auto& [tensor, count] : impls) {
    if (!held_at_most(*tensor, count)) {
      return false;
    }
  }
  return first->tensor->storage().use_count() == impls.size();
}

// Notes [Static memory freed once its pass is over] and [An output freed
// once its reader has captured]: the memory of `engines` that only their
// references hold, each of them freeable, goes back to the pool; not the
// outputs of the engines in `read_now`, which a capture is about to read in
// place.
void free_statics(PoolLedger& ledger, at::ArrayRef<std::shared_ptr<Engine>> engines,
                  const std::vector<const Engine*>& read_now) {
  std::vector<StaticRef> refs, freed;
  for (const auto& e : engines) {
    const bool read = std::find(read_now.begin(), read_now.end(), e.get()) != read_now.end();
    collect_static_refs(*e, read, refs);
  }
  std::sort(refs.begin(), refs.end(),
            [](const StaticRef& a, const StaticRef& b) { return a.storage < b.storage; });
  for (size_t i = 0, j = 0; i < refs.size(); i = j) {
    for (j = i; j < refs.size() && refs[j].storage == refs[i].storage; ++j) {
    }
    if (only_freeable_refs(&refs[i], &refs[j])) {
      freed.insert(freed.end(), refs.begin() + i, refs.begin() + j);
    }
  }
  if (freed.empty()) {
    return;
  }
  for (const StaticRef& r : freed) {
    CG_INVARIANT(past_capture(*r.engine), "static memory freed of an engine whose backward "
                 "was not captured (Note [An output freed once its reader has captured]).");
  }
  uint64_t at = 0;
  {
    std::lock_guard<std::mutex> hold(ledger.mutex);
    at = ++ledger.captures;  // later captures may take the memory
    for (const StaticRef& r : freed) {  // before the memory is free
      if (r.engines_memory) {
        r.engine->member.note_statics_freed(at);
      }
    }
    ledger.earliest_freed.store(std::min(ledger.earliest_freed.load(), at));
  }
  std::vector<at::Tensor> dropped;  // after every replacement: a destructor may run Python
  dropped.reserve(freed.size());
  for (const StaticRef& r : freed) {
    dropped.push_back(std::exchange(*r.tensor, non_owning_view(*r.tensor)));
  }
}

// Each input of `capturing` that static_output_in made, a non-owning view of
// a static output of the pool, gets that output's memory as its owner: the
// memory its capture reads stays allocated, and stays so until it is done
// with it too (Note [An output freed once its reader has captured]).
// Returns the engines whose outputs they read.
std::vector<const Engine*> claim_read_in_place(PoolLedger& ledger,
                                               at::ArrayRef<Engine*> capturing) {
  std::vector<const Engine*> read;
  for_each_engine(ledger, [&](const std::shared_ptr<Engine>& h) {
    for (Engine* e : capturing) {
      for (Input& in : e->inputs) {
        for (const Output& o : h->outputs) {
          if (!in.owner.defined() && is_non_owning_view(in.buffer) &&
              !is_non_owning_view(o.buffer) && same_view(o.buffer, in.buffer)) {
            in.owner = o.buffer.detach();
            read.push_back(h.get());
          }
        }
      }
    }
  });
  return read;
}

}  // namespace

void release_kept_activations(at::cuda::MempoolId_t pool, at::ArrayRef<Engine*> capturing) {
  const std::shared_ptr<PoolLedger> ledger = ledger_of(pool, /*make=*/false);
  std::vector<NodePtr> released;
  c10::SmallVector<std::shared_ptr<Engine>, 8> engines;
  if (ledger) {
    for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
      if (h->member.holds_activations() && !h->backward_pending()) {
        std::vector<NodePtr> history = h->member.release_kept(++ledger->captures);
        std::move(history.begin(), history.end(), std::back_inserter(released));
      }
      engines.push_back(h);
    });
  }
  // Dropped here, outside the ledger's mutex: the history's nodes go with
  // them, and a Python node's destructor takes the GIL.
  released.clear();
  if (ledger) {
    // What was not freed stays allocated: still exact.  An input left
    // without its owner is refused at its capture (note_inputs_in_place).
    try {
      free_statics(*ledger, engines, claim_read_in_place(*ledger, capturing));
    } catch (const InvariantError&) {
      throw;
    } catch (const std::exception& e) {
      TORCH_WARN("cgraph: could not free graphs' static memory for later captures: ", e.what());
    }
  }
}

// Note [Input grads freed at their capture]: after the backward capture of
// a layer captured one by one into a shared pool.
void Engine::free_input_grads() {
  if (!member.keeps_activations() || kept_outputs == CG_KEEP_ALIAS || !member.ledger()) {
    return;
  }
  c10::SmallVector<Input*, 4> freeable;
  for (Input& in : inputs) {
    if (in.grad.defined() && in.grad.has_storage() && !is_non_owning_view(in.grad) &&
        in.grad.storage().use_count() == 1 && held_at_most(in.grad, 1)) {
      freeable.push_back(&in);
    }
  }
  if (freeable.empty()) {
    return;
  }
  member.note_input_grads_freed();  // before the memory is free
  std::vector<at::Tensor> dropped;  // after every replacement
  dropped.reserve(freeable.size());
  for (Input* in : freeable) {
    dropped.push_back(std::exchange(in->grad, non_owning_view(in->grad)));
  }
}

void move_held_out_of_freed(at::cuda::MempoolId_t pool) {
  const std::shared_ptr<PoolLedger> ledger = ledger_of(pool, /*make=*/false);
  c10::SmallVector<std::shared_ptr<Engine>, 8> freed, grads_freed;
  if (ledger) {
    for_each_engine(*ledger, [&](const std::shared_ptr<Engine>& h) {
      if (h->member.freed_statics()) {
        freed.push_back(h);
      } else if (h->member.freed_grads()) {  // its outputs stay allocated: the next layer's
        grads_freed.push_back(h);            // warm-up is called with one
      }
    });
  }
  for (const auto& h : freed) {  // outside the mutex: this allocates
    h->release_earlier_outputs();
    h->release_handed_input_grads({});
  }
  for (const auto& h : grads_freed) {
    h->release_handed_input_grads({});
  }
}

}  // namespace cgraph
