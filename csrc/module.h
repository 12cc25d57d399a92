/*
 * module.h -- what the C files share among themselves (not a C/C++
 * boundary: that is cgraph.h alone).
 */
#ifndef CGRAPH_MODULE_H
#define CGRAPH_MODULE_H

#include <Python.h>

#include "cgraph.h"

/* Objects the module creates once, at import (owned by the module). */
typedef struct {
    PyObject *CaptureError;   /* cgraph.CaptureError(RuntimeError) */
    PyObject *tree_flatten;   /* torch.utils._pytree.tree_flatten */
    PyObject *tree_unflatten; /* torch.utils._pytree.tree_unflatten */
    PyObject *str_training;   /* interned "training" */
    /* Bumped whenever any module registers a parameter, buffer or submodule
     * (torch's global registration hooks, installed by cgraph/_api.py).  A
     * graphed module re-checks its parameters only when this moved, so the
     * call path pays one comparison. */
    unsigned long long module_epoch;
} cgm_state;

extern cgm_state cgm;

/* ---- graphed.c ---------------------------------------------------------- */

extern PyTypeObject Graphed_Type;

/* How a graphed callable's outputs were structured at capture. */
typedef enum {
    CG_OUT_SINGLE = 0, /* one tensor */
    CG_OUT_TUPLE = 1,  /* a flat tuple of tensors */
    CG_OUT_TREE = 2    /* anything else: rebuilt with tree_unflatten */
} cg_out_kind;

/* Everything the Graphed object needs besides its engine; every PyObject*
 * is borrowed here and may be NULL where noted. */
typedef struct {
    int flat_args;          /* the sample args were a flat tuple of tensors */
    PyObject *in_spec;      /* TreeSpec of (args, kwargs) (NULL/None if flat) */
    PyObject *kwargs;       /* the sample kwargs, sorted by name (a dict) */
    PyObject *constants;    /* tuple of (leaf position, name, value) */
    cg_out_kind out_kind;
    PyObject *out_spec;     /* TreeSpec of the outputs (NULL unless TREE) */
    PyObject *module;       /* the nn.Module, or NULL/None for a function */
    PyObject *eager;        /* forward to run in the other train/eval mode */
    int eager_takes_module; /* `eager` is unbound: pass the module first */
    PyObject *verify;       /* verify(module) raises if its parameters or
                               buffers were replaced since capture; or None */
} cg_graphed_info;

/* Wraps `engine`, taking ownership of it (also on failure).
 * Returns a NEW reference, or NULL with an exception set. */
PyObject *Graphed_create(cg_engine *engine, const cg_graphed_info *info);

/* ---- capture.c ---------------------------------------------------------- */

/* _C.graph_callables(specs, device, pool, num_warmup_iters,
 *                    allow_unused_input, capture_error_mode) -> tuple
 * Returns a NEW reference to a tuple of Graphed, or NULL. */
PyObject *cg_graph_callables(PyObject *self, PyObject *args);

#endif /* CGRAPH_MODULE_H */
