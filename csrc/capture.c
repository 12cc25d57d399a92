/*
 * capture.c -- the first two places of the graph lifecycle: warm-up and
 * capture, for the callables of one make_graphed_callables call.
 *
 * Python equivalent (the contract; the real thing is below):
 *
 *     def graph_callables(specs, device, pool, num_warmup_iters,
 *                         allow_unused_input, capture_error_mode, guard_outputs):
 *         pool = pool or new_pool()           # one pool for all callables
 *         engines = [Engine(s.leaves, s.names, s.params, s.buffers)
 *                    for s in specs]
 *         with capture_stream(device):        # warm-up and capture share it
 *             for s, e in zip(specs, engines):                    # warm-up
 *                 for _ in range(num_warmup_iters):
 *                     with e.warmup():        # notes RNG use (aten_rng.cpp)
 *                         out = s.fn(*s.args, **s.kwargs)
 *                     e.warmup_backward(tree_leaves(out))
 *             torch.cuda.empty_cache()   # warm-up's cache, not beside the pool
 *             for s, e in zip(specs, engines):            # forwards 1..N
 *                 with e.capture(FORWARD, pool):
 *                     out = s.fn(*s.args, **s.kwargs)
 *                 e.set_outputs(tree_leaves(out))
 *             for e in reversed(engines):                # backwards N..1
 *                 e.capture_backward(pool)
 *             for e in engines:
 *                 e.restore_buffers()   # BatchNorm stats, grad accumulators
 *         return tuple(Graphed(e, ...) for e in engines)
 *
 * Capturing in the order the graphs will replay is what makes sharing one
 * pool safe: a graph only reuses memory that earlier graphs are done with.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "module.h"

/* One callable, as make_graphed_callables (cgraph/_api.py _describe)
 * describes it.  All borrowed from the spec tuple. */
typedef struct {
    PyObject *fn;            /* what to call: the module or function */
    PyObject *args;          /* tuple: the sample args, as given */
    PyObject *kwargs;        /* dict: the sample kwargs, sorted by name */
    PyObject *leaves;        /* tuple of tensors: the tensor leaves of (args, kwargs) */
    PyObject *names;         /* tuple of str: a name per tensor leaf */
    PyObject *params;        /* tuple of parameters */
    PyObject *buffers;       /* tuple of buffers */
    int flat_args;           /* args are all tensors and there are no kwargs */
    PyObject *in_spec;       /* TreeSpec of (args, kwargs), or None if flat */
    PyObject *constants;     /* tuple of (leaf position, name, value) */
    PyObject *module;        /* the nn.Module or None */
    PyObject *eager;         /* forward for the other train/eval mode, or None */
    int eager_takes_module;
    PyObject *verify;        /* verify(module): raises if parameters were replaced */
} callable_spec;

/* 0 on success, -1 with an exception. */
static int
parse_spec(PyObject *tuple, callable_spec *spec)
{
    return PyArg_ParseTuple(tuple, "OO!O!O!O!O!O!pOO!OOpO;cgraph: malformed callable spec",
                            &spec->fn, &PyTuple_Type, &spec->args, &PyDict_Type, &spec->kwargs,
                            &PyTuple_Type, &spec->leaves, &PyTuple_Type, &spec->names,
                            &PyTuple_Type, &spec->params, &PyTuple_Type, &spec->buffers,
                            &spec->flat_args, &spec->in_spec, &PyTuple_Type, &spec->constants,
                            &spec->module, &spec->eager, &spec->eager_takes_module,
                            &spec->verify) ? 0 : -1;
}

/* Calls the callable with its sample arguments.  Returns a NEW reference,
 * or NULL with an exception set. */
static PyObject *
call_sample(const callable_spec *spec)
{
    return PyObject_Call(spec->fn, spec->args,
                         PyDict_GET_SIZE(spec->kwargs) ? spec->kwargs : NULL);
}

/* The pytree leaves of `out` and how to rebuild it.  Returns a NEW
 * reference to a sequence of leaves and stores a NEW reference to the spec
 * (or NULL) in *spec_out, or returns NULL with an exception set. */
static PyObject *
output_leaves(PyObject *out, cg_out_kind *kind, PyObject **spec_out)
{
    PyObject *flat, *leaves;

    *spec_out = NULL;
    if (PyTuple_CheckExact(out)) {
        int all_tensors = 1;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(out); i++) {
            /* A tuple of tuples is a tree; a tuple of tensors (or things
             * the engine will reject with a clear message) is flat. */
            PyObject *item = PyTuple_GET_ITEM(out, i);
            if (PyTuple_Check(item) || PyList_Check(item) || PyDict_Check(item) ||
                item == Py_None) {
                all_tensors = 0;
                break;
            }
        }
        if (all_tensors) {
            *kind = CG_OUT_TUPLE;
            return Py_NewRef(out);
        }
    }
    flat = PyObject_CallOneArg(cgm.tree_flatten, out);
    if (flat == NULL) {
        return NULL;
    }
    leaves = Py_NewRef(PyTuple_GET_ITEM(flat, 0));
    *spec_out = Py_NewRef(PyTuple_GET_ITEM(flat, 1));
    Py_DECREF(flat);
    /* A lone tensor flattens to one leaf with a leaf spec: return it bare. */
    *kind = (PyList_GET_SIZE(leaves) == 1 && PyList_GET_ITEM(leaves, 0) == out)
                ? CG_OUT_SINGLE : CG_OUT_TREE;
    if (*kind == CG_OUT_SINGLE) {
        Py_CLEAR(*spec_out);
    }
    return leaves;
}

/* Capture failures, by the CUDA error torch reports, with what to do. */
static const struct {
    const char *marker;
    const char *advice;
} capture_advice[] = {
    {"operation not permitted when stream is capturing",
     "an operation that waits for the GPU ran inside the callable (cudaError 900): "
     ".item(), .cpu(), .numpy(), .tolist(), print(tensor), torch.cuda.synchronize(), "
     "a data-dependent shape (nonzero, boolean masking) or a pinned-memory allocation. "
     "Move it out of the graphed callable, or keep it on the GPU (torch.where instead "
     "of `if tensor:`)."},
    {"operation failed due to a previous error during capture",
     "an earlier operation in the callable broke the capture (cudaError 900/901), "
     "typically a GPU sync (.item(), .cpu(), print(tensor)) or work on another "
     "thread. Move syncs out of the graphed callable; use capture_error_mode="
     "'thread_local' if another thread (a DataLoader's pin_memory) uses CUDA."},
    {"Cannot copy between CPU and CUDA",
     "the callable copies between the host and the GPU during capture: .cpu(), "
     ".item(), .tolist(), print(tensor), or a CPU tensor used on the GPU. A graph replays GPU work "
     "only: move the copy out of the graphed callable, or pass the data in as a CUDA "
     "tensor argument."},
    {"capture was invalidated",
     "another thread used CUDA during the capture (cudaError 901): a DataLoader "
     "pin_memory thread or a second stream. Pass capture_error_mode='thread_local'."},
    {"unjoined",
     "work forked onto another stream was not joined back before the capture ended "
     "(cudaError 904): make the capture stream wait for it "
     "(torch.cuda.current_stream().wait_stream(side_stream))."},
    {"legacy stream",
     "the callable put work on the default (legacy) stream during capture (cudaError "
     "906), where it would run once instead of in the graph: use "
     "torch.cuda.current_stream(), not torch.cuda.default_stream() or stream 0 "
     "(a library or extension may launch there: pass it the current stream)."},
    {"Cannot prepare for replay during capturing",
     "the callable contains torch.compile(mode='reduce-overhead') (or another "
     "cudagraph-trees user), which records and replays CUDA graphs of its own; those "
     "cannot run inside cgraph's capture. Compile with mode='default' or "
     "'max-autotune-no-cudagraphs' inside cgraph: cgraph's graph already removes the "
     "launch overhead reduce-overhead would."},
    {"random generator state changed during capture",
     "the callable seeded a random generator (torch.manual_seed, torch.cuda.manual_seed, "
     "set_rng_state) or drew host-side random numbers (torch.rand on the CPU, Python's "
     "random) during capture. That ran once, at capture; replays would not repeat it. "
     "Seed outside the graphed callable and draw random numbers on the GPU "
     "(device='cuda'). torch.utils.checkpoint is handled by cgraph."},
    {"CUDAGeneratorImpl",
     "the callable seeded a random generator or read its seed during capture "
     "(torch.cuda.manual_seed, torch.cuda.initial_seed(), a custom RNG tracker). Do it "
     "outside the graphed callable; torch.utils.checkpoint is handled by cgraph."},
};

/* Replaces the pending exception with CaptureError naming the callable,
 * the pass, the likely cause and the fix; the original becomes __cause__.
 * Always returns NULL. */
static PyObject *
raise_capture_error(Py_ssize_t index, const char *pass)
{
    PyObject *type, *cause, *traceback, *text = NULL, *message = NULL, *error = NULL;
    const char *utf8 = NULL;
    const char *advice =
        "the callable did something a CUDA graph cannot record (see __cause__). "
        "Graphed callables must run GPU work only, with fixed shapes and no syncs.";

    PyErr_Fetch(&type, &cause, &traceback);
    PyErr_NormalizeException(&type, &cause, &traceback);
    if (cause != NULL && traceback != NULL) {
        PyException_SetTraceback(cause, traceback);
    }
    text = cause ? PyObject_Str(cause) : NULL;
    utf8 = text ? PyUnicode_AsUTF8(text) : NULL;
    PyErr_Clear();
    for (size_t i = 0; utf8 && i < sizeof(capture_advice) / sizeof(capture_advice[0]); i++) {
        if (strstr(utf8, capture_advice[i].marker) != NULL) {
            advice = capture_advice[i].advice;
            break;
        }
    }
    message = PyUnicode_FromFormat(
        "cgraph: capturing the %s of callable %zd failed: %s Torch said: %s",
        pass, index, advice, utf8 ? utf8 : "(no message)");
    error = message ? PyObject_CallOneArg(cgm.CaptureError, message) : NULL;
    if (error != NULL) {
        PyException_SetCause(error, Py_XNewRef(cause));  /* steals the new ref */
        PyErr_SetObject(cgm.CaptureError, error);
        Py_DECREF(error);
    }
    Py_XDECREF(message);
    Py_XDECREF(type);
    Py_XDECREF(cause);
    Py_XDECREF(traceback);
    Py_XDECREF(text);
    return NULL;
}

PyObject *
cg_graph_callables(PyObject *self, PyObject *args)
{
    PyObject *specs, *pool_obj, *result = NULL;
    int device, warmup_iters, allow_unused, mode, guard_outputs;
    Py_ssize_t n = 0, built = 0;
    callable_spec *spec = NULL;
    cg_engine **engines = NULL;
    cg_graphed_info *infos = NULL;
    cg_setup *setup = NULL;
    cg_pool pool = {0, 0};

    if (!PyArg_ParseTuple(args, "O!iOipip", &PyTuple_Type, &specs, &device, &pool_obj,
                          &warmup_iters, &allow_unused, &mode, &guard_outputs)) {
        return NULL;
    }
    n = PyTuple_GET_SIZE(specs);
    spec = PyMem_Calloc((size_t)n + 1, sizeof(*spec));
    engines = PyMem_Calloc((size_t)n + 1, sizeof(*engines));
    infos = PyMem_Calloc((size_t)n + 1, sizeof(*infos));
    if (spec == NULL || engines == NULL || infos == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_spec(PyTuple_GET_ITEM(specs, i), &spec[i]) < 0) {
            goto done;
        }
    }
    if (pool_obj == Py_None) {
        if (cg_new_pool(&pool) < 0) {
            goto done;
        }
    } else if (!PyArg_ParseTuple(pool_obj, "KK;cgraph: pool must be a pair of ints",
                                 &pool.first, &pool.second)) {
        goto done;
    }

    for (Py_ssize_t i = 0; i < n; i++) {
        engines[i] = cg_engine_new(spec[i].leaves, spec[i].names, spec[i].params,
                                   spec[i].buffers, allow_unused, guard_outputs);
        if (engines[i] == NULL) {
            goto done;
        }
    }
    setup = cg_setup_begin(device);
    if (setup == NULL) {
        goto done;
    }

    /* 1. Warm-up: lazy initialization, autotuning and allocator growth
     *    happen here, outside any capture. */
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int k = 0; k < warmup_iters; k++) {
            cg_out_kind kind;
            PyObject *spec_out, *leaves, *out;
            if (cg_engine_warmup_begin(engines[i]) < 0) {
                goto done;
            }
            out = call_sample(&spec[i]);
            if (cg_engine_warmup_end(engines[i], out != NULL) < 0 || out == NULL) {
                Py_XDECREF(out);
                goto done;
            }
            leaves = output_leaves(out, &kind, &spec_out);
            Py_DECREF(out);
            Py_XDECREF(spec_out);
            if (leaves == NULL) {
                goto done;
            }
            if (cg_engine_warmup_backward(engines[i], leaves) < 0) {
                Py_DECREF(leaves);
                goto done;
            }
            Py_DECREF(leaves);
        }
    }

    if (cg_setup_release_warmup_memory(setup) < 0) {
        goto done;
    }

    /* 2. Capture forwards in call order... */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *out, *leaves;
        if (cg_engine_capture_begin(engines[i], CG_FORWARD, pool, (cg_capture_mode)mode) < 0) {
            raise_capture_error(i, "forward");
            goto done;
        }
        out = call_sample(&spec[i]);
        if (out == NULL) {
            cg_engine_capture_abort(engines[i], CG_FORWARD);
            raise_capture_error(i, "forward");
            goto done;
        }
        if (cg_engine_capture_end(engines[i], CG_FORWARD) < 0) {
            Py_DECREF(out);
            raise_capture_error(i, "forward");
            goto done;
        }
        leaves = output_leaves(out, &infos[i].out_kind, &infos[i].out_spec);
        Py_DECREF(out);
        if (leaves == NULL || cg_engine_set_outputs(engines[i], leaves) < 0) {
            Py_XDECREF(leaves);
            goto done;
        }
        Py_DECREF(leaves);
    }
    /* ...and backwards in the reverse order, the order backward runs them. */
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        if (cg_engine_capture_backward(engines[i], pool, (cg_capture_mode)mode) < 0) {
            raise_capture_error(i, "backward");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cg_engine_restore_buffers(engines[i]) < 0) {
            goto done;
        }
    }
    cg_setup_end(setup);
    setup = NULL;

    result = PyTuple_New(n);
    if (result == NULL) {
        goto done;
    }
    for (built = 0; built < n; built++) {
        PyObject *graphed;
        infos[built].flat_args = spec[built].flat_args;
        infos[built].in_spec = spec[built].in_spec;
        infos[built].kwargs = spec[built].kwargs;
        infos[built].constants = spec[built].constants;
        infos[built].module = spec[built].module;
        infos[built].eager = spec[built].eager;
        infos[built].eager_takes_module = spec[built].eager_takes_module;
        infos[built].verify = spec[built].verify;
        graphed = Graphed_create(engines[built], &infos[built]);  /* takes the engine */
        engines[built] = NULL;
        if (graphed == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyTuple_SET_ITEM(result, built, graphed);
    }

done:
    cg_setup_end(setup);
    for (Py_ssize_t i = 0; engines != NULL && i < n; i++) {
        cg_engine_free(engines[i]);
    }
    for (Py_ssize_t i = 0; infos != NULL && i < n; i++) {
        Py_XDECREF(infos[i].out_spec);
    }
    PyMem_Free(spec);
    PyMem_Free(engines);
    PyMem_Free(infos);
    return result;
}
