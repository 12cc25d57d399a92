/*
 * cgraph.h -- the whole boundary between cgraph's C half and its C++ half.
 *
 * The C half (the csrc .c files, compiled as C11) owns everything Python sees: the
 * module, the `CallableSpec` and `Graphed` types, argument and pytree handling, and
 * the order of the graph lifecycle (warm-up -> capture -> replay -> reset).
 * The C++ half (the csrc aten_ .cpp files) owns everything ATen sees: CUDA graphs, the
 * static tensors they read and write, and the autograd node that replays the
 * backward graph.  Only this header crosses between them.
 *
 * The sections below follow the lifecycle; each names the aten_ file that
 * implements it (aten_entry.cpp holds every entry point, a thin wrapper).
 *
 * Conventions, for every function below:
 *   - `int` results are 0 on success and -1 with a Python exception set.
 *   - `PyObject *` results are NEW references, or NULL with an exception set.
 *   - `PyObject *` parameters are borrowed.
 *   - The caller holds the GIL.  No C++ exception crosses this header.
 */
#ifndef CGRAPH_H
#define CGRAPH_H

#include <Python.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One graphed callable's native state: its forward and backward graphs and
 * their static buffers.  Reference counted on the C++ side: the C half holds
 * one reference, each pending backward holds another. */
typedef struct cg_engine cg_engine;

/* The stream that warm-up and capture run on, and the device they run for. */
typedef struct cg_setup cg_setup;

/* A caching-allocator memory pool id, the pair torch calls MempoolId_t. */
typedef struct {
    unsigned long long first;
    unsigned long long second;
} cg_pool;

/* How strictly CUDA polices other threads during capture (torch's
 * capture_error_mode). */
typedef enum {
    CG_CAPTURE_GLOBAL = 0,
    CG_CAPTURE_THREAD_LOCAL = 1,
    CG_CAPTURE_RELAXED = 2
} cg_capture_mode;

typedef enum { CG_FORWARD = 0, CG_BACKWARD = 1 } cg_pass;

/* Why a capture failed, as far as cgraph can tell without reading message
 * text: CUDA's error code, or which of cgraph's own checks refused.
 *
 * The one list of the kinds, X(ID, name) each: it makes the enum's
 * CG_FAILURE_<ID>, and capture.c makes from it CaptureError.kind (`name`),
 * _C.FAILURE_KINDS (the names, indexed by kind) and _C.FAILURE_<ID> (the
 * kinds as ints, which Python passes to _C.Refusal), so that C, explain()
 * and the training step name a kind alike.  `name` is public: users test
 * CaptureError.kind against it.  capture.c gives every kind its advice
 * (Note [Capture failures] there) and refuses to import without one. */
#define CG_FAILURE_KINDS(X)                                                        \
    X(OTHER, "other")                   /* the callable raised something else */   \
    X(SYNC, "sync")                     /* cudaErrorStreamCaptureUnsupported */    \
    X(INVALIDATED, "invalidated")       /* cudaErrorStreamCaptureInvalidated */    \
    X(UNJOINED, "unjoined")             /* cudaErrorStreamCaptureUnjoined */       \
    X(WRONG_THREAD, "wrong_thread")     /* cudaErrorStreamCaptureWrongThread */    \
    X(LEGACY_STREAM, "legacy_stream")   /* cudaErrorStreamCaptureImplicit */       \
    X(HOST_COPY, "host_copy")           /* torch refused a CPU<->CUDA copy */      \
    X(NESTED_GRAPHS, "nested_graphs")   /* torch.compile's cudagraph trees */      \
    X(SEED_READ, "seed_read")           /* a CUDA generator's seed read */         \
    X(RNG_CHANGED, "rng_changed")       /* a generator seeded, host RNG drawn */   \
    X(RNG_REGIONS, "rng_regions")       /* RNG state asked for unlike warm-up */   \
    X(REENTRANT_LEAF, "reentrant_leaf") /* a closure leaf, reentrant checkpoint */ \
    X(WARMUP_STATE, "warmup_state")     /* warm-up in a pool left memory there */

/* CG_FAILURE_OTHER is 0: a zeroed cg_failure means "no kind known". */
typedef enum {
#define CG_FAILURE_ENUM(id, name) CG_FAILURE_##id,
    CG_FAILURE_KINDS(CG_FAILURE_ENUM)
#undef CG_FAILURE_ENUM
    CG_FAILURE_COUNT
} cg_failure;

/* ---- set-up (aten_setup.cpp) -------------------------------------------- */

/* Number of CUDA devices torch can see into *count (0 without CUDA). */
int cg_cuda_device_count(int *count);

/* A fresh pool id, as torch.cuda.graph_pool_handle() returns. */
int cg_new_pool(cg_pool *out);

/* Synchronizes `device_index`'s device and makes a side stream current: the
 * stream every warm-up and capture of one make_graphed call runs on.
 * Returns NULL with an exception set on failure. */
cg_setup *cg_setup_begin(int device_index);

/* Before warm-up, for a later graph of a callable (or of a layer sharing
 * one pool=): the side stream allocates from `pool`, where earlier graphs
 * keep their temporaries, until cg_setup_release_warmup_memory; the
 * session holds a reference to the pool until cg_setup_end (Note [Warm-up
 * in the pool] in aten_setup.cpp).  0, or -1 with an exception set. */
int cg_setup_warm_up_in(cg_setup *setup, cg_pool pool);

/* Between warm-up and capture, in this order:
 *
 * cg_setup_end_warm_up waits for the warm-up and ends it.  Returns 1 if a
 * warm-up in a pool left memory allocated there, 0 if not, -1 with an
 * exception set.
 *
 * Only where it returned 1: cg_setup_move_out_of_pool moves every tensor
 * among `objects` (the list of gc.get_objects(): nothing else finds the
 * tensors that own memory, Note [Warm-up in the pool] in aten_setup.cpp)
 * that owns such memory out of the pool.  Borrows `objects`.  Returns 1 if
 * memory is still left where earlier graphs may write it, 0 if not, -1
 * with an exception set.
 *
 * cg_setup_release_warmup_memory returns the memory the warm-up left cached
 * to the device, so the graph pool does not sit on top of a second copy of
 * the activations (torch.cuda.graph empties the cache before every capture;
 * this does it once).  0, or -1 with an exception set. */
int cg_setup_end_warm_up(cg_setup *setup);
int cg_setup_move_out_of_pool(cg_setup *setup, PyObject *objects);
int cg_setup_release_warmup_memory(cg_setup *setup);

/* Into *out: 1 if cg_setup_allocate_all_from may be used (the native
 * allocator, without expandable segments: Note [A step's warm-up in its
 * pool] in aten_setup.cpp), else 0.  0, or -1 with an exception set. */
int cg_can_allocate_all_from_a_pool(int *out);

/* For a training step's eager call (cgraph/_step.py), after
 * cg_setup_begin: every allocation on the device, on any stream but the
 * caller's and the legacy default stream, comes from `pool` until
 * cg_setup_end, which waits for the device first; the session holds a
 * reference to the pool until then (Note [A step's warm-up in its pool] in
 * aten_setup.cpp).  0, or -1 with an exception set. */
int cg_setup_allocate_all_from(cg_setup *setup, cg_pool pool);

/* Takes a reference to `pool` on `device`, making the pool if it is new: it
 * lives, with the memory allocated from it, until cg_pool_release, though
 * no graph holds it yet.  0, or -1 with an exception set. */
int cg_pool_hold(int device, cg_pool pool);

/* Gives back a reference cg_pool_hold took.  Never raises (a failure is
 * reported as a warning). */
void cg_pool_release(int device, cg_pool pool);

/* Restores the caller's stream and waits for the side stream.  Never raises
 * (a failure is reported as a warning); frees `setup`; NULL is allowed. */
void cg_setup_end(cg_setup *setup);

/* What happens to an output of an earlier call, still referenced, when a
 * later replay overwrites the graph's output memory: Note [Outputs of
 * earlier calls] in aten_replay.cpp. */
typedef enum {
    CG_KEEP_COPY = 0,   /* moved to memory of its own first: keeps its value */
    CG_KEEP_ERROR = 1,  /* reading it raises */
    CG_KEEP_ALIAS = 2   /* it shows the new values, as with torch */
} cg_kept_outputs;

/* What an engine is made from: one callable's description (the fields of
 * cgraph._C.CallableSpec that the C++ half needs). */
typedef struct {
    PyObject *inputs;        /* tuple of the sample tensors (pytree leaves);
                                they become the static inputs, as in torch */
    PyObject *names;         /* tuple of str, one per input, for errors */
    PyObject *params;        /* tuple of the module's parameters (may be empty) */
    PyObject *buffers;       /* tuple of the module's buffers: warm-up changes
                                them (BatchNorm), so they are restored */
    int device;              /* the CUDA device the graphs run on */
    int allow_unused_input;  /* torch's allow_unused_input */
    cg_kept_outputs kept_outputs;
    int keep_activations;    /* the forward capture's activations stay allocated
                                until its backward has replayed: Note [Layers
                                captured one by one into one pool] (aten_pool.cpp) */
    /* Where an eager run outside cgraph (a training step's last warm-up)
     * asked for the CUDA RNG state, from its start, and how far it moved the
     * stream: what cgraph's own warm-up would note (Note [RNG in checkpointed
     * regions], aten_rng.cpp).  rng_warmed 0: none given. */
    int rng_warmed;
    const unsigned long long *rng_offsets;
    Py_ssize_t rng_offsets_count;
    unsigned long long rng_increment;
} cg_engine_config;

/* Returns NULL with an exception set on failure. */
cg_engine *cg_engine_new(const cg_engine_config *config);

/* Drops the C half's reference.  Never raises.  NULL is allowed. */
void cg_engine_free(cg_engine *engine);

/* Ends set-up: puts back the module buffers that warm-up changed and the
 * parameters' own grad accumulators (Note [Grad accumulators during
 * capture]), and frees what only set-up needed. */
int cg_engine_finish_setup(cg_engine *engine);

/* ---- warm-up (aten_warmup.cpp) -------------------------------------------- */

/* Bracket each warm-up forward: cgraph notes where checkpointed regions
 * start in the RNG stream (Note [RNG in checkpointed regions]).  Pass
 * completed=0 when the forward raised: the caller's exception is kept. */
int cg_engine_warmup_begin(cg_engine *engine);
int cg_engine_warmup_end(cg_engine *engine, int completed);

/* Runs one eager backward of a warm-up forward.  `outputs` is a sequence of
 * the forward's output leaves. */
int cg_engine_warmup_backward(cg_engine *engine, PyObject *outputs);

/* The leaves requiring grad that the autograd graph of `tensors` (a
 * sequence) ends at, each once: a NEW reference to a list. */
PyObject *cg_autograd_leaves(PyObject *tensors);

/* ---- capture (aten_capture.cpp, aten_capture_backward.cpp) -------------- */

/* Starts capturing `pass` on the setup's stream into `pool`.  The autocast
 * state at the forward's capture is the one every replay must run under.
 * On failure *failure says why. */
int cg_engine_capture_begin(cg_engine *engine, cg_pass pass, cg_pool pool,
                            cg_capture_mode mode, cg_failure *failure);

/* After cg_engine_capture_begin(CG_FORWARD): the tensors to call the
 * callable with, where they are not the samples: a NEW reference to a tuple,
 * a tensor per static input, each input read in place passed as a view made
 * for this capture (Note [An output freed once its reader has captured] in
 * aten_pool.cpp); a NEW reference to None where the samples serve as they
 * are; NULL with an exception set. */
PyObject *cg_engine_capture_inputs(cg_engine *engine);

/* Ends the capture begun by cg_engine_capture_begin.  On failure the capture
 * is abandoned, its memory released and *failure set; among the failures:
 * the callable seeded a random generator or drew host-side random numbers
 * during capture. */
int cg_engine_capture_end(cg_engine *engine, cg_pass pass, cg_failure *failure);

/* Abandons a capture whose callable raised.  Keeps the caller's exception;
 * never raises. */
void cg_engine_capture_abort(cg_engine *engine, cg_pass pass);

/* Records the forward graph's output leaves (a sequence of tensors) as its
 * static outputs. */
int cg_engine_set_outputs(cg_engine *engine, PyObject *outputs);

/* Captures the backward graph of the captured forward (a no-op when no
 * output requires grad).  On failure *failure says why. */
int cg_engine_capture_backward(cg_engine *engine, cg_pool pool, cg_capture_mode mode,
                               cg_failure *failure);

/* The failure kind of a CUDA error code (a cudaError_t), as torch's
 * AcceleratorError carries it; CG_FAILURE_OTHER for codes of no capture
 * failure. */
cg_failure cg_failure_of_cuda_error(int code);

/* ---- a whole training step (aten_accumulators.cpp) ---------------------- */

/* Parameters' grad accumulators moved onto the capture stream, with the
 * streams they had. */
typedef struct cg_moved_accumulators cg_moved_accumulators;

/* Makes the live grad accumulator (AccumulateGrad node) of each tensor of
 * `params` (a sequence) run on its device's current stream, as if it had been
 * made there; its hooks stay.  A tensor without one is skipped.  *count: how
 * many moved.  NULL with an exception set on failure.  Why: Note [DDP inside
 * a graphed step] in cgraph/_ddp.py. */
cg_moved_accumulators *cg_accumulators_move(PyObject *params, Py_ssize_t *count);

/* Gives the moved accumulators their streams back and frees `moved`.  Never
 * raises; NULL is allowed. */
void cg_accumulators_restore(cg_moved_accumulators *moved);

/* Whether the grad of each tensor of `params` (a tuple) is the tensor at the
 * same place of `grads` (a tuple of tensors, and None for no grad): 1 where
 * every one is, 0 where one is not, -1 with an exception set (a parameter
 * that is not a tensor, tuples of two lengths).  The checks before and after
 * each replay of a graphed step, a pointer compare per parameter: Note
 * [Grads around a graphed step] in cgraph/_step_grads.py. */
int cg_grads_are(PyObject *params, PyObject *grads);

/* A NEW reference to a tuple, one mark per tensor of the tuple `params`:
 * (the address of the memory its kernels read, a DTensor's local shard's;
 * whether it requires grad); NULL with an exception set.  And whether each
 * parameter still has its mark: 1, 0, or -1 with an exception set.  The
 * check before each replay of a graphed step: Note [What a graphed step
 * checks before a replay] in cgraph/_step_checks.py. */
PyObject *cg_param_marks(PyObject *params);
int cg_params_are(PyObject *params, PyObject *marks);

/* ---- conditional regions of a capture (aten_conditional.cpp) ------------ */

/* An open conditional region of the capture on the current stream. */
typedef struct cg_if_region cg_if_region;

/* 1 if captures can hold conditional nodes (cgraph built with CUDA 12.4 or
 * later, and a driver as new), else 0.  Never fails. */
int cg_conditional_nodes(void);

/* During a capture by cgraph on the current stream: what the current stream
 * records from now until cg_if_end runs, at each replay, only where `flag`
 * (one bool CUDA tensor) is true then.  Until then the current stream is the
 * region's own.  NULL with an exception set on failure (no such capture, no
 * conditional nodes, a CUDA error).  Why: Note [Conditional regions]. */
cg_if_region *cg_if_begin(PyObject *flag);

/* Ends `region`, gives the caller's stream back and frees `region`.  With
 * completed=0 (what it recorded raised) keeps the caller's exception and
 * never fails; else 0, or -1 with an exception set. */
int cg_if_end(cg_if_region *region, int completed);

/* ---- fixed homes for parameters sharded by FSDP2 (aten_lend.cpp) -------- */

/* Points the storage of each tensor of `tensors` at the memory of the
 * tensor of `homes` at the same position (sequences of one length; each
 * pair contiguous, of as many bytes, on one device), which that storage
 * keeps alive until it is resized or lent again.  0, or -1 with an
 * exception set.  Why: Note [FSDP2's unsharded parameters in per-layer
 * graphs] in cgraph/_fsdp.py. */
int cg_lend_memory(PyObject *tensors, PyObject *homes);

/* ---- replay (aten_replay.cpp, aten_backward.cpp) ------------------------ */

/* The hot path.  Checks `args[0..nargs)` against the captured inputs (not
 * again when `accepted`: cg_engine_accepts just said 1 for them), copies
 * those whose memory differs into the static inputs, replays the forward
 * graph and returns a NEW tuple of the outputs, wired to a backward node
 * when autograd needs one. */
PyObject *cg_engine_replay(cg_engine *engine, PyObject *const *args, Py_ssize_t nargs,
                           int accepted);

/* 1 if cg_engine_replay would take these tensor arguments as they are: the
 * count, each one's shape, device and (floating) dtype, the autocast state,
 * grad mode (a graph captured without grad cannot serve a call with it)
 * and inference mode (one captured under it, or with samples made under
 * it, serves calls under it only: its static tensors are inference
 * tensors).  With exact_grad, also no argument that requires grad unlike
 * its sample, nor a parameter frozen at capture and unfrozen since; with
 * exact_dtype, none of another dtype (else another floating one is cast,
 * as torch's drop-in does).  0 if not; -1 with an exception set only on an
 * internal error.
 * Graphed callables with several graphs ask this of each before replaying
 * one (Note [Several graphs per callable] in graphed.c). */
int cg_engine_accepts(const cg_engine *engine, PyObject *const *args, Py_ssize_t nargs,
                      int exact_grad, int exact_dtype);

/* 1 if a forward replay now overwrites no memory that a pending backward
 * needs: no graph of the engine's pool whose backward is still to run (its
 * autograd node alive and not run) was captured outside the span of that
 * graph's forward and backward captures (Note [Captures that share a pool]
 * in aten_pool.cpp).  Its own pending backward always counts.  0: the call
 * runs eagerly, or gets a graph elsewhere.  Never fails. */
int cg_engine_may_replay(const cg_engine *engine);
/* 1 if the backward of the engine's latest replay is still to run, else 0
 * (Note [Calls before their backwards] in aten_backward.cpp).  Never fails. */
int cg_engine_backward_pending(const cg_engine *engine);
/* 1 if some graph of `pool` has a backward pending, else 0; with
 * unkept_only, only a graph whose activations are not kept (they were
 * captured without keep_activations, or released since).  Never fails. */
int cg_pool_busy(cg_pool pool, int unkept_only);
/* For a layer graphed one by one into `pool` (cgraph/_group.py), at a call
 * none of its graphs takes: 1 if it may capture there now, keeping its
 * activations (Note [Layers captured one by one into one pool] in
 * aten_pool.cpp), else 0 (it captures elsewhere).  Not in a second pass:
 * from a call of a layer called again before its backward ran
 * (called_again), for as long as a graph of the pool has a backward pending;
 * the pool's ledger keeps the pass, here (aten_pool.cpp).  Nor while a
 * pending graph of the pool no longer keeps its activations.  Never fails. */
int cg_pool_open_to_layers(cg_pool pool, int called_again);
/* 1 while autograd runs a backward on this thread (a checkpoint's
 * recompute), else 0: torch._C._current_graph_task_id() != -1.  Never
 * fails. */
int cg_in_backward(void);
/* Before the engines `capturing[0..n)` capture into `pool`: frees the kept
 * activations of its graphs whose backward is no longer pending, so the
 * capture may reuse them (Note [Layers captured one by one into one pool] in
 * aten_pool.cpp), and their static memory nobody else holds, but for what
 * `capturing` read in place (Note [Static memory freed once its pass is
 * over]).  What it cannot release stays (a warning says why); -1 with an
 * exception set only for a broken invariant (Note [Checked invariants]). */
int cg_pool_release_kept(cg_pool pool, cg_engine *const *capturing, Py_ssize_t n);
/* Before a warm-up in `pool`, which writes its free blocks: the outputs and
 * grads of its graphs still held in memory freed once their pass was over
 * get memory of their own, on the current stream (Note [Warm-up in the
 * pool] in aten_setup.cpp).  0, or -1 with an exception set. */
int cg_pool_move_held(cg_pool pool);
/* If `tensor` shows a static output of a live graph of `pool` (the same
 * memory, shape, strides and dtype): a NEW reference to a view of that
 * output's memory that does not keep it allocated (the engine captured with
 * it does: Input::owner), to capture a graph that reads it in place (Note [A
 * layer reading the one before it in place] in aten_pool.cpp).  Else a NEW
 * reference to None; NULL with an exception set on failure. */
PyObject *cg_pool_static_output(cg_pool pool, PyObject *tensor);

/* ---- random numbers (aten_rng.cpp) ------------------------------------- */

/* torch.cuda.get_rng_state(device) while cgraph warms up or captures a
 * callable (Note [RNG in checkpointed regions]).  Returns a
 * NEW reference to a state tensor; a NEW reference to None when torch should
 * answer; NULL with an exception set on failure, and *failure set when one
 * of cgraph's checks refused. */
PyObject *cg_rng_get_state(int device, cg_failure *failure);

/* torch.cuda.set_rng_state(state, device), likewise: 1 if cgraph handled it,
 * 0 if torch should, -1 with an exception set (and *failure as above). */
int cg_rng_set_state(PyObject *state, int device, cg_failure *failure);

/* ---- reset (aten_reset.cpp) --------------------------------------------- */

/* Frees the graphs, the static tensors and the pool's cached memory.  Later
 * replays raise; backward of an earlier call raises.  Never raises. */
void cg_engine_reset(cg_engine *engine);

/* From now on the interpreter is exiting (cgraph's atexit hook): resets and
 * dropped engines free their graphs only, as during finalization: no copies
 * of held outputs and grads, no device synchronization, no pool emptied
 * (Note [Resets at exit], aten_reset.cpp).  Never raises. */
void cg_exiting(void);

/* ---- introspection (aten_inspect.cpp) ------------------------------------ */

/* The pool this engine's graphs live in. */
cg_pool cg_engine_pool(const cg_engine *engine);

/* Number of static inputs and parameters. */
Py_ssize_t cg_engine_num_inputs(const cg_engine *engine);
Py_ssize_t cg_engine_num_params(const cg_engine *engine);

/* How often each replay path ran, per engine: the one list of the counters,
 * X(field, doc) each.  It makes cg_stats below; graphed.c makes from it the
 * sum over a callable's graphs, the dict Graphed.stats returns (keyed by
 * field: the names users read) and that property's docstring (`doc`, one
 * line per counter).  A new counter is a line here and the C++ code that
 * counts it.  What each counts, at length: grads_* and param_grads_copied
 * (one per grad still held), Note [Parameter gradients] (aten_backward.cpp);
 * copied_*, Note [Argument copies inside the graph] (aten_graph_nodes.cpp)
 * and Note [Incoming grads] (aten_backward.cpp); outputs_* (one per output
 * still referenced), Note [Outputs of earlier calls] (aten_replay.cpp);
 * input_grads_copied, Note [Grads handed to autograd] (aten_replay.cpp). */
#define CG_STATS_COUNTERS(X)                                                           \
    X(forward, "forward replays")                                                      \
    X(backward, "backward replays")                                                    \
    X(grads_copied, "backwards that handed parameter grads out as computed or "        \
                    "copied them in (.grad was None): the copy tail")                  \
    X(grads_added, "backwards that added into the parameters' .grad: the add tail")    \
    X(grads_slow, "backwards that took the general path (neither tail)")               \
    X(copied_in_graph, "arguments and incoming grads copied into the static "          \
                       "buffers by the graph itself")                                  \
    X(copied_before, "arguments and incoming grads copied in before the replay: "      \
                     "layouts a memcpy cannot copy, and incoming grads lying in the "  \
                     "graph's own grad buffers")                                       \
    X(written_back, "arguments the forward writes in place, copied back into the "    \
                    "tensor passed after the replay")                                  \
    X(outputs_copied, "outputs of earlier calls still held, moved to memory of their " \
                      "own before a replay (kept_outputs='copy')")                     \
    X(outputs_invalidated, "outputs of earlier calls still held, made unreadable "     \
                           "before a replay (kept_outputs='error')")                   \
    X(input_grads_copied, "grads handed to autograd for inputs, still held, moved to " \
                          "memory of their own before a replay")                       \
    X(param_grads_copied, "parameter grads (.grad in pool memory), still held, moved " \
                          "to memory of their own before a replay")

/* One counter's field; graphed.c declares its own counters with it too. */
#define CG_COUNTER_FIELD(field, doc) unsigned long long field;

typedef struct {
    CG_STATS_COUNTERS(CG_COUNTER_FIELD)
} cg_stats;

cg_stats cg_engine_stats(const cg_engine *engine);

/* What one captured graph is made of, for introspection (Graphed.graphs):
 * its nodes by type and its topology.  A straight line of work has one root
 * and nodes - 1 edges. */
typedef struct {
    unsigned long long nodes;
    unsigned long long kernels;
    unsigned long long memcpys;
    unsigned long long memsets;
    unsigned long long others;  /* event, host, empty and other nodes */
    unsigned long long roots;   /* nodes that depend on nothing */
    unsigned long long edges;
} cg_graph_shape;

/* 1 and *out filled if `pass` has a graph, 0 if it has none (a backward
 * with nothing to differentiate, or after reset()), -1 with an exception. */
int cg_engine_graph_shape(const cg_engine *engine, cg_pass pass, cg_graph_shape *out);

/* ---- checked invariants (aten_checks.cpp) ------------------------------- */

/* Turns the debug checks on or off (Note [Checked invariants]) and plants
 * `fault` (NULL or "" for none; a test's only).  -1 with a ValueError set for
 * a fault it does not know. */
int cg_set_debug(int on, const char *fault);
/* 1 while the debug checks are on, else 0.  Never raises. */
int cg_debug(void);

#ifdef __cplusplus
}
#endif

#endif /* CGRAPH_H */
