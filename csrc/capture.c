/*
 * capture.c -- the first two places of the graph lifecycle: warm-up and
 * capture, for the callables of one make_graphed_callables call.
 *
 * Python equivalent (the contract; the real thing is below):
 *
 *     def graph_callables(specs, pool, num_warmup_iters, allow_unused_input,
 *                         capture_error_mode, kept_outputs, warm_in_pool,
 *                         keep_activations, what=None):
 *         pool = pool or new_pool()           # one pool for all callables
 *         engines = [Engine(s, keep_activations) for s in specs]
 *         release_kept_activations(pool, engines)  # of backwards that ran since
 *         if warm_in_pool: move_held_out_of_freed(pool)  # Note [Warm-up in the pool]
 *         with capture_stream(specs[0].device):   # warm-up and capture share it
 *             if warm_in_pool: allocate_from(pool)   # Note [Warm-up in the pool]
 *             for s, e in zip(specs, engines):                    # warm-up
 *                 for _ in range(num_warmup_iters):
 *                     with e.warmup():        # notes RNG use (aten_rng.cpp)
 *                         out = s.target()(*s.args, **s.kwargs)
 *                     e.warmup_backward(tree_leaves(out))
 *             if warm_in_pool and pool has blocks warm-up left:
 *                 move_kept_tensors(them, gc.get_objects())  # Python's over them
 *             torch.cuda.empty_cache()   # warm-up's cache, not beside the pool
 *             if memory is still left there: raise CaptureError("warmup_state")
 *             with gc_paused():          # Note [No garbage collection while capturing]
 *                 for s, e in zip(specs, engines):        # forwards 1..N
 *                     with e.capture(FORWARD, pool):  # an input read in place
 *                         args, kwargs = unflatten(e.capture_inputs())  # as a view
 *                         out = s.target()(*args, **kwargs)     # made for it
 *                     e.set_outputs(tree_leaves(out))
 *                 for e in reversed(engines):            # backwards N..1
 *                     e.capture_backward(pool)
 *                 for e in reversed(engines):  # BatchNorm stats, grad accumulators:
 *                     e.finish_setup()         # last set aside, first put back
 *         return tuple(Graphed(s, e, out_layout) for s, e in zip(specs, engines))
 *
 * Each callable's warm-up, forward capture and backward capture reports a
 * "progress" event (cgraph/_log.py draws a progress bar from them).
 *
 * Capturing in the order the graphs will replay is what makes sharing one
 * pool safe: a graph only reuses memory that earlier graphs are done with.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "module.h"

/* One make_graphed call in progress.  Arrays have one entry per callable. */
typedef struct {
    cg_state *state;
    Py_ssize_t n;
    cg_spec **specs;        /* borrowed from the specs tuple */
    PyObject **targets;     /* owned: what warm-up and capture call */
    cg_engine **engines;    /* owned until wrapped in a Graphed */
    cg_out_layout *outs;    /* how each callable's outputs are structured */
    cg_pool pool;
    cg_capture_mode mode;
    int warmup_iters;
    int allow_unused;
    int kept_outputs;       /* a cg_kept_outputs */
    int warm_in_pool;       /* warm up in `pool`: Note [Warm-up in the pool] */
    int keep_activations;   /* Note [Layers captured one by one into one pool] */
    const char *what;       /* how failures name the callable: "the training
                               step"; NULL: "callable <i>" after the stage */
    cg_setup *setup;        /* the capture stream, while warm-up and capture run */
} session;

/* ---- capture failures --------------------------------------------------- */

/* Note [Capture failures]
 * Q: How does CaptureError know what went wrong?
 * A: From types, not from message text, wherever there is one: the CUDA
 *    error code that torch's AcceleratorError carries (Python's .error_code,
 *    C++'s get_error_code()), or the kind of one of cgraph's own checks (a
 *    Refusal: raised by the C++ half as cgraph::Refusal, by the Python hooks
 *    of cgraph/_capture.py as _C.Refusal).  Three errors torch raises
 *    during capture carry neither, so torch_texts matches their text, the
 *    only place that does.  The kinds and their names (CaptureError.kind)
 *    are CG_FAILURE_KINDS in cgraph.h, the one list Python reads too
 *    (_C.FAILURE_KINDS); each kind has one entry in `advice` below: what to
 *    do.  cg_add_failure_kinds checks at import that none lacks one. */

/* Each kind's name (CaptureError.kind) and the name of its int in _C. */
static const struct {
    const char *name;
    const char *constant;
} failure_names[CG_FAILURE_COUNT] = {
#define FAILURE_NAMES(id, name) [CG_FAILURE_##id] = {name, "FAILURE_" #id},
    CG_FAILURE_KINDS(FAILURE_NAMES)
#undef FAILURE_NAMES
};

int
cg_capture_error_is(cg_state *state, PyObject *exc, cg_failure kind)
{
    PyObject *type, *value, *trace, *name;
    int is;

    if (!PyObject_TypeCheck(exc, (PyTypeObject *)state->CaptureError)) {
        return 0;
    }
    PyErr_Fetch(&type, &value, &trace);
    name = PyObject_GetAttrString(exc, "kind");
    is = name != NULL && PyUnicode_Check(name) &&
         PyUnicode_CompareWithASCIIString(name, failure_names[kind].name) == 0;
    Py_XDECREF(name);
    PyErr_Clear();
    PyErr_Restore(type, value, trace);
    return is;
}

/* Each kind's advice: what to do. */
static const char *const advice[CG_FAILURE_COUNT] = {
    [CG_FAILURE_OTHER] =
     "the callable did something a CUDA graph cannot record (see __cause__). "
     "Graphed callables must run GPU work only, with fixed shapes and no syncs.",
    [CG_FAILURE_SYNC] =
     "an operation that waits for the GPU ran inside the callable (cudaError 900): "
     ".item(), .cpu(), .numpy(), .tolist(), print(tensor), torch.cuda.synchronize(), "
     "a data-dependent shape (nonzero, boolean masking) or a pinned-memory allocation. "
     "Move it out of the graphed callable, or keep it on the GPU (torch.where instead "
     "of `if tensor:`).",
    [CG_FAILURE_INVALIDATED] =
     "an earlier operation in the callable broke the capture (cudaError 901), "
     "typically a GPU sync (.item(), .cpu(), print(tensor)) or work on another "
     "thread. Move syncs out of the graphed callable; use capture_error_mode="
     "'thread_local' if another thread (a DataLoader's pin_memory) uses CUDA.",
    [CG_FAILURE_UNJOINED] =
     "work forked onto another stream was not joined back before the capture ended "
     "(cudaError 904): make the capture stream wait for it "
     "(torch.cuda.current_stream().wait_stream(side_stream)).",
    [CG_FAILURE_WRONG_THREAD] =
     "another thread used CUDA during the capture (cudaError 905): a DataLoader "
     "pin_memory thread or a second stream. Pass capture_error_mode='thread_local'.",
    [CG_FAILURE_LEGACY_STREAM] =
     "the callable put work on the default (legacy) stream during capture (cudaError "
     "906), where it would run once instead of in the graph: use "
     "torch.cuda.current_stream(), not torch.cuda.default_stream() or stream 0 "
     "(a library or extension may launch there: pass it the current stream).",
    [CG_FAILURE_HOST_COPY] =
     "the callable copies between the host and the GPU during capture: .cpu(), "
     ".item(), .tolist(), print(tensor), or a CPU tensor used on the GPU. A graph "
     "replays GPU work only: move the copy out of the graphed callable, or pass the "
     "data in as a CUDA tensor argument.",
    [CG_FAILURE_NESTED_GRAPHS] =
     "the callable contains torch.compile(mode='reduce-overhead') (or another "
     "cudagraph-trees user), which records and replays CUDA graphs of its own; those "
     "cannot run inside cgraph's capture. Compile with mode='default' or "
     "'max-autotune-no-cudagraphs' inside cgraph: cgraph's graph already removes the "
     "launch overhead reduce-overhead would.",
    [CG_FAILURE_SEED_READ] =
     "the callable seeded a random generator or read its seed during capture "
     "(torch.cuda.manual_seed, torch.cuda.initial_seed(), a custom RNG tracker). Do it "
     "outside the graphed callable; torch.utils.checkpoint is handled by cgraph.",
    [CG_FAILURE_RNG_CHANGED] =
     "the callable seeded a random generator (torch.manual_seed, torch.cuda.manual_seed, "
     "set_rng_state), drew host-side random numbers (torch.rand on the CPU, Python's "
     "random, NumPy's global np.random) or ran a random op on a DTensor (whose RNG "
     "tracker moves the generator on the host) during capture. That ran once, at capture; replays would not repeat it. "
     "Seed outside the graphed callable, draw random numbers on the GPU (device='cuda'), "
     "and run random ops on plain tensors (use_local_output=True, or .to_local()). "
     "torch.utils.checkpoint is handled by cgraph.",
    [CG_FAILURE_RNG_REGIONS] =
     "the callable asked for the CUDA RNG state (torch.utils.checkpoint does) a "
     "different number of times during capture than in its last warm-up call. Make "
     "RNG use the same on every call; if the first call compiles (torch.compile), use "
     "num_warmup_iters >= 2.",
    [CG_FAILURE_REENTRANT_LEAF] =
     "a torch.utils.checkpoint(use_reentrant=True) region reads a tensor that requires "
     "grad but is neither an argument nor a parameter (see __cause__). Make it an "
     "nn.Parameter of the module, pass it as an argument, or use use_reentrant=False.",
    [CG_FAILURE_WARMUP_STATE] =
     "a warm-up call left memory allocated in the graph pool that outlives it and that "
     "no Python tensor holds, so cgraph could not move it out of the way of the pool's "
     "earlier graphs (Note [Warm-up in the pool]): state the callable keeps that only C++ "
     "reaches, such as the autograd history of a tensor it keeps that requires grad. "
     "That state now lies where those graphs write: discard it, and keep such state "
     "detached (.detach()), or graph this callable with a pool of its own (no pool=). "
     "Later captures of this callable raise this too.",
};

/* torch's capture errors that carry no code: Note [Capture failures]. */
static const struct {
    const char *text;
    cg_failure kind;
} torch_texts[] = {
    {"Cannot copy between CPU and CUDA", CG_FAILURE_HOST_COPY},
    {"Cannot prepare for replay during capturing", CG_FAILURE_NESTED_GRAPHS},
    {"CUDAGeneratorImpl", CG_FAILURE_SEED_READ},
};

/* The CUDA error code torch's AcceleratorError carries (.error_code): a
 * NEW reference to an int, or NULL (no exception set) if `exc` has none. */
static PyObject *
error_code(cg_state *state, PyObject *exc)
{
    PyObject *code = PyObject_GetAttr(exc, state->str_error_code);

    if (code == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();  /* not an AcceleratorError: no code is the answer */
    } else if (code == NULL) {
        PyErr_WriteUnraisable(exc);  /* a broken attribute: report it, go on */
    }
    if (code != NULL && !PyLong_Check(code)) {
        Py_CLEAR(code);
    }
    return code;
}

/* The kind of one exception (not its causes), or CG_FAILURE_OTHER.  Never
 * raises. */
static cg_failure
kind_of_exception(cg_state *state, PyObject *exc)
{
    cg_failure kind = CG_FAILURE_OTHER;
    PyObject *code = NULL, *text = NULL;
    const char *utf8;

    if (PyErr_GivenExceptionMatches(exc, state->Refusal)) {
        PyObject *args = PyObject_GetAttrString(exc, "args");
        if (args && PyTuple_Check(args) && PyTuple_GET_SIZE(args) == 2 &&
            PyLong_Check(PyTuple_GET_ITEM(args, 1))) {
            long value = PyLong_AsLong(PyTuple_GET_ITEM(args, 1));
            /* Python passes any int: one that is no kind (-1) is OTHER. */
            kind = value > 0 && value < CG_FAILURE_COUNT ? (cg_failure)value
                                                          : CG_FAILURE_OTHER;
        }
        Py_XDECREF(args);
    } else if ((code = error_code(state, exc)) != NULL) {
        kind = cg_failure_of_cuda_error((int)PyLong_AsLong(code));
    } else if ((text = PyObject_Str(exc)) != NULL && (utf8 = PyUnicode_AsUTF8(text))) {
        for (size_t i = 0; i < sizeof(torch_texts) / sizeof(torch_texts[0]); i++) {
            if (strstr(utf8, torch_texts[i].text) != NULL) {
                kind = torch_texts[i].kind;
                break;
            }
        }
    }
    Py_XDECREF(code);
    Py_XDECREF(text);
    if (PyErr_Occurred()) {
        PyErr_WriteUnraisable(exc);  /* a broken __str__: report it, keep going */
    }
    return kind < CG_FAILURE_COUNT ? kind : CG_FAILURE_OTHER;
}

/* The kind of a capture failure: the native half's, if it knew; else that
 * of the exception or of the first exception it was raised from. */
static cg_failure
classify(cg_state *state, PyObject *exc, cg_failure native)
{
    PyObject *link = Py_XNewRef(exc);
    cg_failure kind = native;

    for (int depth = 0; kind == CG_FAILURE_OTHER && link != NULL && depth < 8; depth++) {
        PyObject *next = PyException_GetCause(link);
        kind = kind_of_exception(state, link);
        if (next == NULL) {
            next = PyException_GetContext(link);
        }
        Py_SETREF(link, next);
    }
    Py_XDECREF(link);
    return kind;
}

/* What was going on when a failure happened, for CaptureError's message. */
static const char *const stages[] = {
    [CG_FORWARD] = "capturing the forward of",
    [CG_BACKWARD] = "capturing the backward of",
};
static const char *const warming_up = "warming up";

/* A NEW reference to a CaptureError saying what failed (`what`: "capturing
 * the forward of callable 0"), its cause (.kind) and the fix, with `cause`
 * (borrowed; may be NULL) as __cause__; NULL with an exception set if even
 * that failed. */
static PyObject *
capture_error_for(cg_state *state, PyObject *cause, const char *what, cg_failure native)
{
    cg_failure kind = classify(state, cause, native);
    PyObject *text = cause ? PyObject_Str(cause) : NULL, *message, *error, *name;
    const char *utf8 = text ? PyUnicode_AsUTF8(text) : NULL;

    if (utf8 == NULL) {
        PyErr_WriteUnraisable(cause);  /* the message is lost, not the error */
    }
    /* "Cause:", not "Torch said:": the cause may be one of cgraph's own
     * refusals (a Refusal), whose text names the case more closely. */
    message = PyUnicode_FromFormat("cgraph: %s failed: %s Cause: %s", what,
                                   advice[kind], utf8 ? utf8 : "(no message)");
    error = message ? PyObject_CallOneArg(state->CaptureError, message) : NULL;
    name = error ? PyUnicode_FromString(failure_names[kind].name) : NULL;
    if (name == NULL || PyObject_SetAttrString(error, "kind", name) < 0) {
        Py_CLEAR(error);
    } else {
        PyException_SetCause(error, Py_XNewRef(cause));  /* steals the new ref */
    }
    Py_XDECREF(name);
    Py_XDECREF(message);
    Py_XDECREF(text);
    return error;
}

/* Whether the pending exception goes on as raised rather than as a
 * CaptureError: an interrupt or exit (not an Exception: Ctrl-C during a
 * capture must stop the program, not be advised about syncs, and callers
 * that fall back to eager on a failed capture catch Exception), or running
 * out of memory (callers catch torch.OutOfMemoryError to try a smaller
 * batch; nothing about graphs to fix). */
static int
passes_through(const cg_state *state)
{
    return !PyErr_ExceptionMatches(PyExc_Exception) ||
           (state->OutOfMemoryError != Py_None && PyErr_ExceptionMatches(state->OutOfMemoryError));
}

/* Replaces the pending exception with CaptureError naming the stage, the
 * callable, the cause (.kind) and the fix; the original becomes __cause__
 * (interrupts and out-of-memory errors go on unchanged: passes_through).
 * Always returns -1. */
static int
raise_capture_error(session *s, Py_ssize_t index, const char *stage, cg_failure native)
{
    if (passes_through(s->state)) {
        return -1;
    }
    PyObject *cause = cg_err_take(), *what, *error = NULL;

    what = s->what ? PyUnicode_FromFormat("capturing %s", s->what)
                   : PyUnicode_FromFormat("%s callable %zd", stage, index);
    if (what != NULL) {
        error = capture_error_for(s->state, cause, PyUnicode_AsUTF8(what), native);
    }
    if (error != NULL) {
        cg_err_restore(error);
    }
    Py_XDECREF(what);
    Py_XDECREF(cause);
    return -1;
}

int
cg_add_failure_kinds(PyObject *module)
{
    PyObject *names = PyTuple_New(CG_FAILURE_COUNT);
    int status = names ? 0 : -1;

    for (int kind = 0; status == 0 && kind < CG_FAILURE_COUNT; kind++) {
        PyObject *name;
        if (advice[kind] == NULL) {
            PyErr_Format(PyExc_SystemError,
                         "cgraph: failure kind '%s' has no advice: give it an entry in "
                         "csrc/capture.c's advice table (Note [Capture failures])",
                         failure_names[kind].name);
            status = -1;
            break;
        }
        name = PyUnicode_InternFromString(failure_names[kind].name);
        if (name == NULL) {
            status = -1;
            break;
        }
        PyTuple_SET_ITEM(names, kind, name);
        status = PyModule_AddIntConstant(module, failure_names[kind].constant, kind);
    }
    if (status == 0) {
        status = PyModule_AddObjectRef(module, "FAILURE_KINDS", names);
    }
    Py_XDECREF(names);
    return status;
}

/* ---- the session's set-up and teardown ---------------------------------- */

/* cgraph._describe.flatten_outputs(out): (leaves, spec), each None among
 * the outputs a node without leaves (Note [None among the outputs]).
 * Returns a NEW reference, or NULL with an exception set. */
static PyObject *
flatten_outputs(PyObject *out)
{
    PyObject *describe = PyImport_ImportModule("cgraph._describe");
    PyObject *flatten = describe ? PyObject_GetAttrString(describe, "flatten_outputs") : NULL;
    PyObject *flat = flatten ? PyObject_CallOneArg(flatten, out) : NULL;

    Py_XDECREF(describe);
    Py_XDECREF(flatten);
    return flat;
}

/* The pytree leaves of `out` and how to rebuild it.  Returns a NEW
 * reference to a sequence of leaves and stores the layout in *layout (its
 * spec a NEW reference, or NULL), or returns NULL with an exception set. */
static PyObject *
output_leaves(PyObject *out, cg_out_layout *layout)
{
    PyObject *flat, *leaves;

    layout->spec = NULL;
    layout->kind = CG_OUT_TUPLE;
    if (PyTuple_CheckExact(out)) {
        Py_ssize_t i = 0;
        /* A tuple of tuples is a tree; a tuple of tensors (or things the
         * engine will reject with a clear message) is flat. */
        for (; i < PyTuple_GET_SIZE(out); i++) {
            PyObject *item = PyTuple_GET_ITEM(out, i);
            if (PyTuple_Check(item) || PyList_Check(item) || PyDict_Check(item) ||
                item == Py_None) {
                break;
            }
        }
        if (i == PyTuple_GET_SIZE(out)) {
            return Py_NewRef(out);
        }
    }
    flat = flatten_outputs(out);
    if (flat == NULL) {
        return NULL;
    }
    leaves = Py_NewRef(PyTuple_GET_ITEM(flat, 0));
    /* A lone tensor flattens to one leaf with a leaf spec: return it bare. */
    if (PyList_GET_SIZE(leaves) == 1 && PyList_GET_ITEM(leaves, 0) == out) {
        layout->kind = CG_OUT_SINGLE;
    } else {
        layout->kind = CG_OUT_TREE;
        layout->spec = Py_NewRef(PyTuple_GET_ITEM(flat, 1));
    }
    Py_DECREF(flat);
    return leaves;
}

/* Reads graph_callables' arguments into `s` and allocates its arrays.
 * 0 or -1. */
static int
session_open(session *s, PyObject *module, PyObject *args)
{
    PyObject *specs, *pool;
    int mode;

    memset(s, 0, sizeof(*s));
    s->state = (cg_state *)PyModule_GetState(module);
    if (!PyArg_ParseTuple(args, "O!Oipiipp|z", &PyTuple_Type, &specs, &pool,
                          &s->warmup_iters, &s->allow_unused, &mode, &s->kept_outputs,
                          &s->warm_in_pool, &s->keep_activations, &s->what)) {
        return -1;
    }
    s->mode = (cg_capture_mode)mode;
    s->n = PyTuple_GET_SIZE(specs);
    s->specs = PyMem_Calloc((size_t)s->n + 1, sizeof(*s->specs));
    s->targets = PyMem_Calloc((size_t)s->n + 1, sizeof(*s->targets));
    s->engines = PyMem_Calloc((size_t)s->n + 1, sizeof(*s->engines));
    s->outs = PyMem_Calloc((size_t)s->n + 1, sizeof(*s->outs));
    if (!s->specs || !s->targets || !s->engines || !s->outs) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < s->n; i++) {
        PyObject *item = PyTuple_GET_ITEM(specs, i);
        if (!PyObject_TypeCheck(item, s->state->Spec_Type)) {
            PyErr_SetString(PyExc_TypeError, "graph_callables: specs must be CallableSpec");
            return -1;
        }
        s->specs[i] = (cg_spec *)item;
    }
    if (pool == Py_None) {
        return cg_new_pool(&s->pool);
    }
    if (!PyTuple_Check(pool)) {  /* PyArg_ParseTuple takes a tuple only */
        PyErr_SetString(PyExc_TypeError, "cgraph: pool must be a pair of ints");
        return -1;
    }
    return PyArg_ParseTuple(pool, "KK;cgraph: pool must be a pair of ints",
                            &s->pool.first, &s->pool.second) ? 0 : -1;
}

/* Resolves every callable and makes its engine.  0 or -1. */
static int
session_make_engines(session *s)
{
    for (Py_ssize_t i = 0; i < s->n; i++) {
        const cg_spec *spec = s->specs[i];
        cg_engine_config config = {
            .inputs = spec->tensors, .names = spec->names, .params = spec->params,
            .buffers = spec->buffers, .device = spec->device,
            .allow_unused_input = s->allow_unused,
            .kept_outputs = (cg_kept_outputs)s->kept_outputs,
            .keep_activations = s->keep_activations,
        };
        unsigned long long *offsets = NULL;
        s->targets[i] = cg_spec_forward(spec);
        if (s->targets[i] == NULL) {
            return -1;
        }
        if (spec->rng_warmup != Py_None) {
            if (cg_spec_rng_warmup(spec, &offsets, &config.rng_offsets_count,
                                   &config.rng_increment) < 0) {
                return -1;
            }
            config.rng_warmed = 1;
            config.rng_offsets = offsets;
        }
        s->engines[i] = cg_engine_new(&config);
        PyMem_Free(offsets);
        if (s->engines[i] == NULL) {
            return -1;
        }
    }
    return 0;
}

/* Frees everything the session still owns.  Keeps a pending exception. */
static void
session_close(session *s)
{
    cg_setup_end(s->setup);
    for (Py_ssize_t i = s->n - 1; s->engines && i >= 0; i--) {
        cg_engine_free(s->engines[i]);  /* last set aside, first put back: Note [A set-up
                                          * puts back what it changed] (aten_setup.cpp) */
    }
    for (Py_ssize_t i = 0; i < s->n; i++) {
        if (s->targets) {
            Py_XDECREF(s->targets[i]);
        }
        if (s->outs) {
            Py_XDECREF(s->outs[i].spec);
        }
    }
    PyMem_Free(s->specs);
    PyMem_Free(s->targets);
    PyMem_Free(s->engines);
    PyMem_Free(s->outs);
}

/* ---- warm-up -------------------------------------------------------------- */

/* Calls callable i with its sample arguments.  Returns a NEW reference, or
 * NULL with an exception set. */
static PyObject *
call_sample(const session *s, Py_ssize_t i)
{
    const cg_spec *spec = s->specs[i];
    return PyObject_Call(s->targets[i], spec->args,
                         PyDict_GET_SIZE(spec->kwargs) ? spec->kwargs : NULL);
}

/* Calls callable i for its forward capture: with its samples, but an input
 * read in place passed as the view the engine made for the capture
 * (cg_engine_capture_inputs).  Returns a NEW reference, or NULL with an
 * exception set. */
static PyObject *
call_captured(const session *s, Py_ssize_t i)
{
    const cg_spec *spec = s->specs[i];
    PyObject *tensors = cg_engine_capture_inputs(s->engines[i]), *call, *kwargs, *out;

    if (tensors == NULL) {
        return NULL;
    }
    if (tensors == Py_None) {
        Py_DECREF(tensors);
        return call_sample(s, i);
    }
    if (spec->flat) {
        out = PyObject_Call(s->targets[i], tensors, NULL);
        Py_DECREF(tensors);
        return out;
    }
    call = cg_call_from_tensors(s->state, spec, tensors);
    Py_DECREF(tensors);
    if (call == NULL) {
        return NULL;
    }
    kwargs = PyTuple_GET_ITEM(call, 1);
    out = PyObject_Call(s->targets[i], PyTuple_GET_ITEM(call, 0),
                        PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) ? kwargs : NULL);
    Py_DECREF(call);
    return out;
}

/* One eager forward and backward of callable i: lazy initialization,
 * autotuning and allocator growth happen here, outside any capture.
 * 0 or -1. */
static int
warm_up_once(session *s, Py_ssize_t i)
{
    cg_out_layout layout;
    PyObject *out, *leaves;
    int status;

    if (cg_engine_warmup_begin(s->engines[i]) < 0) {
        return -1;
    }
    out = call_sample(s, i);
    if (cg_engine_warmup_end(s->engines[i], out != NULL) < 0 || out == NULL) {
        Py_XDECREF(out);
        return -1;
    }
    leaves = output_leaves(out, &layout);
    Py_DECREF(out);
    Py_XDECREF(layout.spec);
    if (leaves == NULL) {
        return -1;
    }
    status = cg_engine_warmup_backward(s->engines[i], leaves);
    Py_DECREF(leaves);
    return status;
}

/* Before the session, on the caller's stream: activations kept for
 * backwards that have run since, static memory whose pass is over and
 * outputs whose readers have captured are free for this warm-up and
 * capture; a warm-up in the pool, which writes that memory, first moves out
 * what is still held there.  0 or -1. */
static int
release_pool(session *s)
{
    if (cg_pool_release_kept(s->pool, s->engines, s->n) < 0) {
        return -1;
    }
    return s->warm_in_pool ? cg_pool_move_held(s->pool) : 0;
}

/* Note [Warm-up in the pool] (aten_setup.cpp): every tensor the collector
 * tracks that owns memory the warm-up left in the pool moves out of it.
 * The walk is asked for here, so that the C++ half calls no Python.
 * Returns 1 if memory is still left where earlier graphs may write it, 0
 * if not, -1 with an exception set. */
static int
move_out_of_pool(session *s)
{
    PyObject *gc = PyImport_ImportModule("gc");
    PyObject *objects = gc ? PyObject_CallMethod(gc, "get_objects", NULL) : NULL;
    int left = objects ? cg_setup_move_out_of_pool(s->setup, objects) : -1;

    Py_XDECREF(objects);
    Py_XDECREF(gc);
    return left;
}

/* The warm-up waited for and ended, and what it left in the pool moved out
 * of it: after a warm-up that returned and after one that raised alike.
 * Returns 1 if memory is still left where earlier graphs may write it, 0 if
 * not, -1 with an exception set. */
static int
finish_warm_up(session *s)
{
    int left = cg_setup_end_warm_up(s->setup);
    return left > 0 ? move_out_of_pool(s) : left;
}

/* A warm-up in the pool that raised: what it left in the pool moves out of
 * it, as after one that returned (Note [Warm-up in the pool]), so that a
 * caller going on (an out-of-memory retried at a smaller batch) does not
 * keep state (a cache the callable grew) where earlier graphs' replays
 * write.  The warm-up's error stays the one raised.  Where the move fails in
 * turn (out of memory again: it copies what the error's traceback holds
 * too) or memory is still left (held by C++), a warning says so: the error
 * is the callable's own, not the warmup_state CaptureError a returned
 * warm-up raises there.  -1. */
static int
warm_up_failed_in_pool(session *s)
{
    PyObject *type, *value, *trace;
    int left;

    PyErr_Fetch(&type, &value, &trace);
    left = finish_warm_up(s);
    if (left != 0) {
        PyErr_Clear();
        if (PyErr_WarnEx(PyExc_RuntimeWarning,
                         "cgraph: a warm-up that raised left memory in the graph pool that "
                         "could not be moved out of it: state the callable kept from that "
                         "call may be overwritten by the replays of the pool's other graphs. "
                         "Before going on, reset() the graphed callables of that pool, or "
                         "drop the state (a cache) the failed call made.", 1) < 0) {
            PyErr_Clear();  /* warnings as errors: the warm-up's error is the one raised */
        }
    }
    PyErr_Restore(type, value, trace);
    return -1;
}

/* Every callable's warm-up calls, once each warm-up iteration.  A refusal
 * of cgraph's (Note [Capture failures]) becomes a CaptureError; the
 * callable's own errors go on as they are.  0 or -1. */
static int
warm_up_calls(session *s)
{
    for (Py_ssize_t i = 0; i < s->n; i++) {
        for (int k = 0; k < s->warmup_iters; k++) {
            if (warm_up_once(s, i) == 0) {
                continue;
            }
            if (PyErr_ExceptionMatches(s->state->Refusal)) {
                return raise_capture_error(s, i, warming_up, CG_FAILURE_OTHER);
            }
            return -1;
        }
        if (cg_report_event(s->state, "progress", Py_None) < 0) {
            return -1;
        }
    }
    return 0;
}

/* The warm-up, and what it left in the pool moved out.  0 or -1. */
static int
warm_up(session *s)
{
    int left;

    if (s->warm_in_pool && cg_setup_warm_up_in(s->setup, s->pool) < 0) {
        return -1;
    }
    if (warm_up_calls(s) < 0) {
        return s->warm_in_pool ? warm_up_failed_in_pool(s) : -1;
    }
    left = finish_warm_up(s);
    if (left < 0 || cg_setup_release_warmup_memory(s->setup) < 0) {
        return -1;
    }
    if (left == 0) {
        return 0;
    }
    PyErr_SetString(PyExc_RuntimeError,
                    "warm-up in the graph pool left memory allocated that no Python tensor holds");
    return raise_capture_error(s, 0, warming_up, CG_FAILURE_WARMUP_STATE);
}

/* ---- capture -------------------------------------------------------------- */

/* Note [Python's random numbers drawn during capture]
 * Q: A callable that draws from Python's `random` or NumPy's global
 *    generator (mixup's `lam = np.random.beta(a, a)`, a flip chosen with
 *    `random.random() < 0.5`, a random crop's offsets) draws once, at
 *    capture: every replay would reuse that draw, silently.  torch's own
 *    generators are compared by the C++ half around each capture
 *    (EngineRng::check_host_untouched); these are Python objects.  What of
 *    them?
 * A: Their states are compared around each callable's forward capture (a
 *    whole training step's, backward and optimizer included): the state of
 *    `random`'s global generator and, where numpy.random is loaded, of
 *    NumPy's global one, pickled together.  A change raises CaptureError
 *    kind rng_changed.  Not seen: generators of the caller's own (a
 *    random.Random instance, np.random.default_rng()), a draw in a per-layer
 *    backward hook (its backward is captured apart), and draws that leave
 *    the state as they found it.  Capture only: the warm-up's calls are
 *    eager calls, free to draw.  Another Python thread drawing from them
 *    while a capture runs (torch releases the GIL around its ops) is taken
 *    for the callable's draw: the refusal says so. */

/* A NEW reference to a bytes object that is equal for equal states of
 * Python's global random generator and NumPy's (where numpy.random is
 * loaded), or NULL with an exception set. */
static PyObject *
host_random_states(void)
{
    /* NumPy's as a dict (legacy=False): its legacy tuple warns at every
     * call where the global bit generator is not MT19937. */
    static const struct {
        const char *module, *method;
        int legacy_keyword;
    } generators[] = {{"random", "getstate", 0}, {"numpy.random", "get_state", 1}};
    PyObject *states = PyList_New(0), *pickle, *fingerprint = NULL;

    for (size_t i = 0; states != NULL && i < sizeof(generators) / sizeof(generators[0]); i++) {
        PyObject *name = PyUnicode_FromString(generators[i].module);
        PyObject *module = name ? PyImport_GetModule(name) : NULL;  /* only where loaded */
        PyObject *get = module ? PyObject_GetAttrString(module, generators[i].method) : NULL;
        PyObject *kwargs = get && generators[i].legacy_keyword
                               ? Py_BuildValue("{s:O}", "legacy", Py_False) : NULL;
        PyObject *state = get && (kwargs || !generators[i].legacy_keyword)
                              ? PyObject_VectorcallDict(get, NULL, 0, kwargs) : NULL;

        if (state != NULL ? PyList_Append(states, state) < 0 : PyErr_Occurred() != NULL) {
            Py_CLEAR(states);
        }
        Py_XDECREF(state);
        Py_XDECREF(kwargs);
        Py_XDECREF(get);
        Py_XDECREF(module);
        Py_XDECREF(name);
    }
    pickle = states ? PyImport_ImportModule("pickle") : NULL;
    fingerprint = pickle ? PyObject_CallMethod(pickle, "dumps", "(O)", states) : NULL;
    Py_XDECREF(pickle);
    Py_XDECREF(states);
    return fingerprint;
}

/* Raises the Refusal of Note [Python's random numbers drawn during
 * capture].  Returns NULL. */
static PyObject *
refuse_host_draws(const session *s)
{
    PyObject *refusal = PyObject_CallFunction(
        s->state->Refusal, "si",
        "cgraph: Python's random or NumPy's global random generator drew numbers during "
        "capture (random.random(), np.random.beta(...)): a replay would reuse that one draw. "
        "(If another thread drew from them meanwhile, a thread augmenting data, give that "
        "thread a generator of its own: random.Random(seed), np.random.default_rng(seed).)",
        (int)CG_FAILURE_RNG_CHANGED);

    if (refusal != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(refusal), refusal);
        Py_DECREF(refusal);
    }
    return NULL;
}

/* call_captured, refused where it drew from Python's or NumPy's global
 * random generator: Note [Python's random numbers drawn during capture].
 * Returns a NEW reference, or NULL with an exception set. */
static PyObject *
call_for_capture(const session *s, Py_ssize_t i)
{
    PyObject *before = host_random_states(), *out, *after;
    int same;

    if (before == NULL) {
        return NULL;
    }
    out = call_captured(s, i);
    after = out ? host_random_states() : NULL;
    same = after ? PyObject_RichCompareBool(before, after, Py_EQ) : -1;
    Py_XDECREF(after);
    Py_DECREF(before);
    if (same != 1) {
        PyObject *pending = cg_err_take();  /* the outputs' destructors run without it */

        Py_CLEAR(out);
        if (pending != NULL) {
            cg_err_restore(pending);
        }
        return same == 0 ? refuse_host_draws(s) : NULL;
    }
    return out;
}

/* Captures callable i's forward graph and records its outputs.  0 or -1
 * (a CaptureError when the capture itself failed). */
static int
capture_forward(session *s, Py_ssize_t i)
{
    cg_engine *engine = s->engines[i];
    cg_failure failure = CG_FAILURE_OTHER;
    PyObject *out, *leaves;
    int status;

    if (cg_engine_capture_begin(engine, CG_FORWARD, s->pool, s->mode, &failure) < 0) {
        return raise_capture_error(s, i, stages[CG_FORWARD], failure);
    }
    out = call_for_capture(s, i);
    if (out == NULL) {
        cg_engine_capture_abort(engine, CG_FORWARD);
        return raise_capture_error(s, i, stages[CG_FORWARD], failure);
    }
    if (cg_engine_capture_end(engine, CG_FORWARD, &failure) < 0) {
        Py_DECREF(out);
        return raise_capture_error(s, i, stages[CG_FORWARD], failure);
    }
    leaves = output_leaves(out, &s->outs[i]);
    Py_DECREF(out);
    status = leaves ? cg_engine_set_outputs(engine, leaves) : -1;
    Py_XDECREF(leaves);
    return status;
}

/* Forwards in call order, then backwards in the reverse order, the order
 * backward runs them.  0 or -1. */
static int
capture_passes(session *s)
{
    for (Py_ssize_t i = 0; i < s->n; i++) {
        if (capture_forward(s, i) < 0 || cg_report_event(s->state, "progress", Py_None) < 0) {
            return -1;
        }
    }
    for (Py_ssize_t i = s->n - 1; i >= 0; i--) {
        cg_failure failure = CG_FAILURE_OTHER;
        if (cg_engine_capture_backward(s->engines[i], s->pool, s->mode, &failure) < 0) {
            return raise_capture_error(s, i, stages[CG_BACKWARD], failure);
        }
        if (cg_report_event(s->state, "progress", Py_None) < 0) {
            return -1;
        }
    }
    /* Last set aside, first put back: Note [A set-up puts back what it
     * changed] in aten_setup.cpp. */
    for (Py_ssize_t i = s->n - 1; i >= 0; i--) {
        if (cg_engine_finish_setup(s->engines[i]) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Note [No garbage collection while capturing]
 * Q: Why is Python's cyclic garbage collector off while a capture runs?
 * A: A collection may start at any allocation the captured Python code
 *    makes, and it runs the destructors of every unreachable cycle inside
 *    the capture.  The caching allocator defers its work for CUDA memory
 *    freed while a capture is under way, but the pinned host allocator
 *    records an event on each stream a freed block was used on (a
 *    non_blocking copy): on the legacy default stream that is an error
 *    inside a capture, thrown from a destructor, and the process aborts.  A
 *    CPU-offloaded FSDP2 model, dropped in a reference cycle and collected
 *    while a later step was captured, did that on an H200.  So the
 *    collector is off for the captures only (the warm-up runs as the caller
 *    left it) and back as it was found after them: the garbage waits for
 *    the next collection.  An explicit gc.collect() still collects.
 *    A set-up can run inside another on the same thread (a graphed layer's
 *    first call inside a step being captured; set-ups on two threads are
 *    refused: Note [One set-up at a time] in cgraph/_capture.py), so the
 *    pause is counted: the first capture in switches the collector off, the
 *    last one out puts back what the first found. */
static int gc_pauses;        /* captures under way; read and written under the GIL */
static int gc_was_collecting; /* what the first of them found */

static void
gc_pause(void)
{
    if (gc_pauses++ == 0) {
        gc_was_collecting = PyGC_Disable();
    }
}

static void
gc_resume(void)
{
    if (--gc_pauses == 0 && gc_was_collecting) {
        PyGC_Enable();
    }
}

static int
capture(session *s)
{
    gc_pause();
    int status = capture_passes(s);

    gc_resume();
    return status;
}

/* The Graphed of every callable, taking their engines.  Returns a NEW
 * reference to a tuple, or NULL with an exception set. */
static PyObject *
wrap_graphed(session *s)
{
    PyObject *result = PyTuple_New(s->n);

    for (Py_ssize_t i = 0; result != NULL && i < s->n; i++) {
        PyObject *graphed = cg_graphed_new(s->state, s->specs[i], s->engines[i], &s->outs[i]);
        s->engines[i] = NULL;  /* taken, also on failure */
        if (graphed == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyTuple_SET_ITEM(result, i, graphed);
    }
    return result;
}

PyObject *
cg_graph_callables(PyObject *module, PyObject *args)
{
    session s;
    PyObject *result = NULL;

    if (session_open(&s, module, args) == 0 && session_make_engines(&s) == 0 && s.n > 0 &&
        release_pool(&s) == 0) {
        s.setup = cg_setup_begin(s.specs[0]->device);
        if (s.setup != NULL && warm_up(&s) == 0 && capture(&s) == 0) {
            cg_setup_end(s.setup);
            s.setup = NULL;
            result = wrap_graphed(&s);
        }
    } else if (!PyErr_Occurred()) {
        result = PyTuple_New(0);
    }
    session_close(&s);
    return result;
}
