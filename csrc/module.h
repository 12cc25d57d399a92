/*
 * module.h -- what the C files share among themselves (not a C/C++
 * boundary: that is cgraph.h alone).
 */
#ifndef CGRAPH_MODULE_H
#define CGRAPH_MODULE_H

#include <Python.h>

#include "cgraph.h"

/* PyWeakref_GetRef (Python 3.13) for older Pythons: 1 and a NEW reference
 * in *out if the referent is alive, 0 and NULL if it is gone, -1 with an
 * exception set.  Never hands out the borrowed result of
 * PyWeakref_GetObject, which code that may run Python could free. */
#if PY_VERSION_HEX < 0x030D0000
static inline int
cg_weakref_get(PyObject *ref, PyObject **out)
{
    PyObject *obj = PyWeakref_GetObject(ref); /* borrowed, deprecated in 3.13 */
    *out = NULL;
    if (obj == NULL) {
        return -1;
    }
    if (obj == Py_None) {
        return 0;
    }
    *out = Py_NewRef(obj);
    return 1;
}
#else
#define cg_weakref_get PyWeakref_GetRef
#endif

/* PyErr_GetRaisedException and PyErr_SetRaisedException (Python 3.12) for
 * Python 3.11: take the pending exception as one normalized object (a NEW
 * reference, or NULL if none), and raise one again (stealing it). */
static inline PyObject *
cg_err_take(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (value != NULL && traceback != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
#endif
}

static inline void
cg_err_restore(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* The module's state (PyModule_GetState), made at import (module.c). */
typedef struct {
    PyObject *CaptureError;     /* cgraph.CaptureError(RuntimeError) */
    PyObject *Refusal;          /* _C.Refusal(message, kind): cgraph's own refusals
                                   raised from Python during capture */
    PyTypeObject *Spec_Type;    /* _C.CallableSpec (spec.c) */
    PyTypeObject *Graphed_Type; /* _C.Graphed (graphed.c) */
    PyTypeObject *CaptureSite_Type; /* _C.CaptureSite (graphed.c) */
    PyObject *tree_flatten;     /* torch.utils._pytree.tree_flatten */
    PyObject *tree_unflatten;   /* torch.utils._pytree.tree_unflatten */
    PyTypeObject *Tensor_Type;  /* torch.Tensor */
    PyObject *OutOfMemoryError; /* torch.OutOfMemoryError, or None where torch has none */
    PyObject *str_training;     /* interned "training" */
    PyObject *str_error_code;   /* interned "error_code" (torch.AcceleratorError's) */
    PyObject *event_hook;       /* hook(event: str, graphed) or None: cgraph/_log.py
                                   logs what happened (an eager fallback, ...) */
    /* Bumped whenever any module registers a parameter, buffer or submodule
     * (torch's global registration hooks, installed by cgraph/_describe.py).
     * A graphed module calls its check only when this moved, so the call
     * path pays one comparison. */
    unsigned long long module_epoch;
} cg_state;

/* Reports `event` about `graphed` to the event hook, if one is set (module.c).
 * 0, or -1 with the hook's exception set. */
int cg_report_event(cg_state *state, const char *event, PyObject *graphed);

/* ---- spec.c ------------------------------------------------------------- */

/* _C.CallableSpec: one callable as make_graphed_callables describes it
 * (cgraph/_describe.py drafts its fields; cgraph/_capture.py graph() builds
 * it by keyword).  Immutable; capture reads it and the Graphed made from it
 * keeps it, so it flows from Python to the call path unchanged.  It holds a
 * module only weakly: the module's forward holds the Graphed, which holds
 * this. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t index;        /* position among the callables graphed together */
    PyObject *function;      /* what to call, for a function; else None */
    PyObject *module;        /* weakref to the nn.Module; else None */
    PyObject *eager;         /* the module's forward, run eagerly in the other
                                train/eval mode; None for a function */
    char eager_takes_module; /* `eager` is unbound: pass the module first */
    char training;           /* module.training at capture */
    PyObject *modes;         /* (modules: tuple, modes: tuple of bool): the
                                submodules whose methods read `training` and
                                their flags at capture (_modes.Modes);
                                empty for a function: Note [Submodules'
                                modes in per-module graphs] in
                                cgraph/_modes.py */
    PyObject *args;          /* tuple: the sample args, as called at capture */
    PyObject *kwargs;        /* dict: the sample kwargs, sorted by name */
    PyObject *kw_names;      /* tuple: the kwargs' names, sorted */
    PyObject *tensors;       /* tuple: the tensor leaves, the static inputs */
    PyObject *names;         /* tuple of str: a name per tensor leaf */
    PyObject *params;        /* tuple: the module's parameters */
    PyObject *buffers;       /* tuple: the module's buffers */
    char flat;               /* args are all tensors and there are no kwargs */
    PyObject *in_spec;       /* TreeSpec of (args, kwargs); None if flat */
    PyObject *walk;          /* None, or (args, kwargs): the samples' containers,
                                a copy never handed to the callable, that calls
                                are walked beside instead of flattened: Note
                                [Arguments walked in C] in arguments.c */
    PyObject *constants;     /* tuple of (position, name, value), leaf order:
                                _describe.Constant, a NamedTuple */
    PyObject *defaults;      /* tuple of (name, position, value, by_keyword):
                                _describe.Default, the callable's parameters the
                                samples leave out whose defaults a call may
                                pass again (position -1: keyword only) */
    PyObject *verify;        /* verify(module) raises if parameters were
                                replaced since capture; None for a function */
    PyObject *rng_warmup;    /* None, or (entry offsets: tuple of int, increment:
                                int): where an eager run outside cgraph (a
                                training step's last warm-up) asked for the CUDA
                                RNG state, and how far it moved it, in place of
                                cgraph's own warm-up: Note [RNG inside a graphed
                                step] in cgraph/_step.py */
    int device;              /* the CUDA device the graphs run on */
} cg_spec;

/* Fields of a Constant (a tuple): its leaf position, name and value. */
enum { CG_CONSTANT_POSITION = 0, CG_CONSTANT_NAME = 1, CG_CONSTANT_VALUE = 2 };

/* Fields of a Default (a tuple). */
enum { CG_DEFAULT_NAME = 0, CG_DEFAULT_POSITION = 1, CG_DEFAULT_VALUE = 2,
       CG_DEFAULT_BY_KEYWORD = 3 };

/* Fields of a Modes (a tuple). */
enum { CG_MODES_MODULES = 0, CG_MODES_FLAGS = 1 };

extern PyType_Spec cg_spec_type_spec;

/* A NEW reference to `module.training`, read from the instance dict where
 * nn.Module keeps it (else through the attribute protocol), or NULL with an
 * exception set.  The one reader of the flag: a module's own mode
 * (graphed.c) and its submodules' (cg_modes_are). */
PyObject *cg_training_of(const cg_state *state, PyObject *module);

/* 1 if each module of the tuple `modules` has as its `training` flag the
 * bool at its place in the tuple `modes` (as many), 0 if one does not, -1
 * with an exception set.  A dict lookup and a pointer compare per module
 * (cg_training_of): nn.Module.train() stores a bool, one of two objects,
 * in the instance dict. */
int cg_modes_are(const cg_state *state, PyObject *modules, PyObject *modes);

/* cg_modes_are over spec->modes: whether the submodules' modes are still
 * those the spec was captured in.  1, 0, or -1 with an exception set. */
int cg_spec_modes_hold(const cg_state *state, const cg_spec *spec);

/* Reads spec->rng_warmup (not None): *offsets (a PyMem_Malloc'ed array the
 * caller frees, of *count entries) and *increment; with offsets NULL, only
 * checks its types.  0, or -1 with a TypeError set. */
int cg_spec_rng_warmup(const cg_spec *spec, unsigned long long **offsets, Py_ssize_t *count,
                       unsigned long long *increment);

/* What to call for warm-up and capture: the function, or the module the
 * weakref points to.  Returns a NEW reference, or NULL with an exception. */
PyObject *cg_spec_target(const cg_spec *spec);

/* What warm-up and capture call: the function, or the module's own forward
 * (not module(...): make_graphed_callables replaces a module's forward with
 * its Graphed, and a later capture must reach the original).  Returns a
 * NEW reference, or NULL with an exception. */
PyObject *cg_spec_forward(const cg_spec *spec);

/* ---- graphed.c ---------------------------------------------------------- */

extern PyType_Spec cg_graphed_type_spec;

/* How a graphed callable's outputs were structured at capture. */
typedef enum {
    CG_OUT_SINGLE = 0, /* one tensor */
    CG_OUT_TUPLE = 1,  /* a flat tuple of tensors */
    CG_OUT_TREE = 2    /* anything else: rebuilt with tree_unflatten */
} cg_out_kind;

typedef struct {
    cg_out_kind kind;
    PyObject *spec;    /* owned TreeSpec of the outputs; NULL unless TREE */
} cg_out_layout;

/* Wraps `engine` for `spec`, taking ownership of the engine and of
 * out->spec (also on failure; *out is cleared).  Returns a NEW reference,
 * or NULL with an exception set. */
PyObject *cg_graphed_new(cg_state *state, cg_spec *spec, cg_engine *engine,
                         cg_out_layout *out);

/* _C.new_graphed(on_miss, max_graphs=1, *, first=None, shared_pool=None,
 *                layer=False, eager=None, casts=False) -> Graphed
 * A Graphed that captures a graph for each call its graphs do not take,
 * through on_miss(graphed, args, kwargs, site) -> Graphed, up to max_graphs
 * (Note [Several graphs per callable] in graphed.c); its first graph is
 * taken from `first` (a Graphed graph_callables made), or captured on its
 * first call.  Returns a NEW reference, or NULL with an exception set. */
PyObject *cg_new_graphed(PyObject *module, PyObject *args, PyObject *kwargs);

/* _C.CaptureSite: the record on_miss is handed (graphed.c).  Returns a NEW
 * reference to the type, or NULL with an exception set. */
PyTypeObject *cg_capture_site_type(void);

/* ---- arguments.c -------------------------------------------------------- */

/* A call's arguments as vectorcall passes them (positional, then keyword
 * values named by kwnames). */
typedef struct {
    PyObject *const *args;
    Py_ssize_t nargs;
    PyObject *kwnames;  /* NULL if no keywords */
    PyObject *owned;    /* NULL, or a NEW reference keeping args and kwnames alive */
} cg_call;

/* The call without the arguments the samples left out whose values are the
 * callable's own defaults (spec->defaults): a call that binds as the
 * capture did replays.  Another value for such an argument raises
 * ValueError.  Fills *out (release with Py_XDECREF(out->owned)); 0, or -1
 * with an exception set. */
int cg_strip_defaults(const cg_spec *spec, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames, cg_call *out);

/* The tensor leaves of a call whose arguments are nested, keyword or
 * constant, checked against the spec: the captured keywords, structure and
 * constant values.  *flattened is incremented where torch's tree_flatten
 * had to look at them (Note [Arguments walked in C] in arguments.c).
 * Returns a NEW reference to a list, or NULL with an exception set. */
PyObject *cg_call_tensors(cg_state *state, const cg_spec *spec, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames,
                          unsigned long long *flattened);

/* The inverse: the (args, kwargs) of a call of `spec` with `tensors` (a
 * tuple) for its tensor leaves and its constants where they were.  Returns
 * a NEW reference to a 2-tuple, or NULL with an exception set. */
PyObject *cg_call_from_tensors(const cg_state *state, const cg_spec *spec, PyObject *tensors);

/* ---- capture.c ---------------------------------------------------------- */

/* _C.graph_callables(specs, pool, num_warmup_iters, allow_unused_input,
 *                    capture_error_mode, kept_outputs, warm_in_pool,
 *                    keep_activations, what=None) -> tuple[Graphed, ...]
 * specs: a tuple of CallableSpec; pool: a pair of ints, or None for a fresh
 * pool; capture_error_mode a cg_capture_mode, kept_outputs a
 * cg_kept_outputs; `what` names the callable in CaptureError ("the
 * training step"; None: "callable <i>").  Returns a NEW reference to a
 * tuple of Graphed, or NULL with an exception set. */
PyObject *cg_graph_callables(PyObject *module, PyObject *args);

/* Adds the failure kinds to the module, from CG_FAILURE_KINDS (cgraph.h):
 * _C.FAILURE_KINDS, the tuple of their names (CaptureError.kind) indexed
 * by kind, and an int _C.FAILURE_<ID> per kind.  0, or -1 with an
 * exception set (SystemError if a kind has no advice in capture.c). */
int cg_add_failure_kinds(PyObject *module);
/* 1 if `exc` (borrowed) is a CaptureError of `kind`, else 0.  Never raises
 * (an exception set on entry is kept). */
int cg_capture_error_is(cg_state *state, PyObject *exc, cg_failure kind);

#endif /* CGRAPH_MODULE_H */
