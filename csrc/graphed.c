/*
 * graphed.c -- the Graphed type: one graphed callable as Python sees it.
 * Third and fourth places of the lifecycle: replay (Graphed_vectorcall) and
 * reset (Graphed_reset).
 *
 * Python equivalent (the contract; the real thing is below):
 *
 *     class Graphed:
 *         def __call__(self, *args, **kwargs):
 *             module = self._module()      # weakref; absent for functions
 *             if module is not None and module.training != self._training:
 *                 return self._eager(module, *args)   # as torch does
 *             if module is not None and modules_changed_since_last_check:
 *                 self._verify(module)    # parameters replaced? then raise
 *             leaves = args if self._flat_args else checked_leaves(args, kwargs)
 *                      # structure, keywords and constants as captured
 *             outs = self._engine.replay(leaves)      # aten_replay.cpp
 *             return outs[0] | outs | tree_unflatten(outs, self._out_spec)
 *
 *         def reset(self): ...   # free graphs, static tensors and pool
 *         pool: tuple[int, int]  # usable as pool= for other captures
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <string.h>

#include "module.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    cg_engine *engine;      /* owned; NULL once reset() */
    cg_pool pool;           /* the engine's pool, kept after reset() */
    int flat_args;          /* the sample args were a flat tuple of tensors */
    PyObject *in_spec;      /* owned TreeSpec of (args, kwargs), or NULL */
    PyObject *kw_names;     /* owned tuple of the captured keywords, sorted */
    PyObject *constants;    /* owned tuple of (leaf position, name, value) */
    cg_out_kind out_kind;
    PyObject *out_spec;     /* owned TreeSpec of the outputs, or NULL */
    PyObject *module_ref;   /* owned weakref to the nn.Module, or NULL */
    PyObject *eager;        /* owned forward for the other train/eval mode */
    int eager_takes_module; /* `eager` is unbound: pass the module first */
    int training;           /* module.training at capture */
    PyObject *verify;       /* owned verify(module), or NULL: raises if the
                               module's parameters were replaced */
    unsigned long long verified_epoch;  /* cgm.module_epoch at the last check */
    PyObject *weakreflist;
} GraphedObject;

static PyObject *Graphed_vectorcall(PyObject *callable, PyObject *const *args,
                                    size_t nargsf, PyObject *kwnames);

/* ---- construction and GC ------------------------------------------------ */

PyObject *
Graphed_create(cg_engine *engine, const cg_graphed_info *info)
{
    GraphedObject *self = PyObject_GC_New(GraphedObject, &Graphed_Type);
    if (self == NULL) {
        cg_engine_free(engine);
        return NULL;
    }
    self->vectorcall = NULL;  /* set last: a half-built object is not callable */
    self->in_spec = self->kw_names = self->constants = NULL;
    self->out_spec = self->module_ref = self->eager = self->weakreflist = NULL;
    self->verify = NULL;
    self->verified_epoch = 0;
    self->engine = engine;
    self->pool = cg_engine_pool(engine);
    self->flat_args = info->flat_args;
    self->in_spec = Py_XNewRef(info->in_spec);
    self->kw_names = info->kwargs ? PyDict_Keys(info->kwargs) : PyList_New(0);
    self->constants = Py_XNewRef(info->constants);
    self->out_kind = info->out_kind;
    self->out_spec = Py_XNewRef(info->out_spec);
    self->eager = Py_XNewRef(info->eager);
    self->eager_takes_module = info->eager_takes_module;
    self->verify = info->verify != Py_None ? Py_XNewRef(info->verify) : NULL;
    self->training = 0;
    if (self->kw_names == NULL || PyList_Sort(self->kw_names) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    Py_SETREF(self->kw_names, PyList_AsTuple(self->kw_names));
    if (self->kw_names == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    if (info->module != NULL && info->module != Py_None) {
        /* A weak reference: module.forward holds this object, and a strong
         * one back would keep the module (and its graphs) alive until the
         * cycle collector ran. */
        PyObject *training = PyObject_GetAttr(info->module, cgm.str_training);
        self->training = training ? PyObject_IsTrue(training) : -1;
        Py_XDECREF(training);
        self->module_ref = self->training < 0 ? NULL : PyWeakref_NewRef(info->module, NULL);
        if (self->module_ref == NULL) {
            Py_DECREF(self);
            return NULL;
        }
    }
    self->vectorcall = Graphed_vectorcall;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static int
Graphed_traverse(GraphedObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->in_spec);
    Py_VISIT(self->kw_names);
    Py_VISIT(self->constants);
    Py_VISIT(self->out_spec);
    Py_VISIT(self->module_ref);
    Py_VISIT(self->eager);
    Py_VISIT(self->verify);
    return 0;
}

static int
Graphed_clear(GraphedObject *self)
{
    Py_CLEAR(self->in_spec);
    Py_CLEAR(self->kw_names);
    Py_CLEAR(self->constants);
    Py_CLEAR(self->out_spec);
    Py_CLEAR(self->module_ref);
    Py_CLEAR(self->eager);
    Py_CLEAR(self->verify);
    return 0;
}

static void
Graphed_dealloc(GraphedObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    Graphed_clear(self);
    cg_engine_free(self->engine);  /* graphs and pool go with the last reference */
    self->engine = NULL;
    PyObject_GC_Del(self);
}

/* ---- replay --------------------------------------------------------------- */

/* 1 if the module is in the other train/eval mode than at capture, 0 if not,
 * -1 with an exception set.  Stores a borrowed reference to the module. */
static int
mode_differs(GraphedObject *self, PyObject **module)
{
    PyObject *training;
    int is_training;

    *module = PyWeakref_GetObject(self->module_ref);  /* borrowed */
    if (*module == NULL) {
        return -1;
    }
    if (*module == Py_None) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cgraph: the module this graph was captured from no longer "
                        "exists; graph the new module instead.");
        return -1;
    }
    training = PyObject_GetAttr(*module, cgm.str_training);
    if (training == NULL) {
        return -1;
    }
    is_training = PyObject_IsTrue(training);
    Py_DECREF(training);
    if (is_training < 0) {
        return -1;
    }
    return is_training != self->training;
}

/* Runs the module's own forward, as torch does when the module is in the
 * other train/eval mode than at capture.  Returns a NEW reference. */
static PyObject *
call_eager(GraphedObject *self, PyObject *module, PyObject *const *args,
           Py_ssize_t nargs, PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject **full;
    PyObject *result;

    if (!self->eager_takes_module) {
        return PyObject_Vectorcall(self->eager, args, (size_t)nargs, kwnames);
    }
    full = PyMem_Malloc((size_t)(nargs + nkw + 1) * sizeof(PyObject *));
    if (full == NULL) {
        return PyErr_NoMemory();
    }
    full[0] = module;
    memcpy(full + 1, args, (size_t)(nargs + nkw) * sizeof(PyObject *));
    result = PyObject_Vectorcall(self->eager, full, (size_t)(nargs + 1), kwnames);
    PyMem_Free(full);
    return result;
}

/* Re-checks the module's parameters and buffers after some module anywhere
 * registered new ones (cgm.module_epoch moved): load_state_dict(assign=True)
 * or `module.weight = nn.Parameter(...)` would leave the graph reading the
 * old tensors.  0 if they are the captured ones, else -1 with the error. */
static int
verify_module(GraphedObject *self, PyObject *module)
{
    PyObject *ok;

    Py_INCREF(module);
    ok = PyObject_CallOneArg(self->verify, module);
    Py_DECREF(module);
    if (ok == NULL) {
        return -1;
    }
    Py_DECREF(ok);
    self->verified_epoch = cgm.module_epoch;
    return 0;
}

/* 0 if the call passes exactly the captured keywords, else -1 with a
 * TypeError naming a missing or an unexpected one. */
static int
check_keywords(GraphedObject *self, PyObject *kwnames)
{
    Py_ssize_t ncaptured = PyTuple_GET_SIZE(self->kw_names);
    Py_ssize_t ngiven = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;

    for (Py_ssize_t i = 0; i < ngiven; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        int known = PySequence_Contains(self->kw_names, name);
        if (known <= 0) {
            if (known == 0) {
                PyErr_Format(PyExc_TypeError,
                             "cgraph: unexpected keyword argument %R; the graph was captured "
                             "with keywords %R (sample_kwargs).", name, self->kw_names);
            }
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < ncaptured; i++) {
        PyObject *name = PyTuple_GET_ITEM(self->kw_names, i);
        int given = kwnames ? PySequence_Contains(kwnames, name) : 0;
        if (given <= 0) {
            if (given == 0) {
                PyErr_Format(PyExc_TypeError,
                             "cgraph: missing keyword argument %R; the graph was captured "
                             "with keywords %R (sample_kwargs).", name, self->kw_names);
            }
            return -1;
        }
    }
    return 0;
}

/* 0 if every captured constant is passed again (same type, equal value),
 * else -1 with a ValueError naming the argument. */
static int
check_constants(GraphedObject *self, PyObject *leaves)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->constants); i++) {
        PyObject *entry = PyTuple_GET_ITEM(self->constants, i);
        Py_ssize_t position = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
        PyObject *captured = PyTuple_GET_ITEM(entry, 2);
        PyObject *given = PyList_GET_ITEM(leaves, position);
        int same = Py_TYPE(given) == Py_TYPE(captured)
                       ? PyObject_RichCompareBool(given, captured, Py_EQ) : 0;
        if (same <= 0) {
            if (same == 0) {
                PyErr_Format(PyExc_ValueError,
                             "cgraph: argument '%U' was captured as %R, got %R. A graph "
                             "replays the value it was captured with: pass %R, pass the "
                             "value as a tensor, or graph once per value.",
                             PyTuple_GET_ITEM(entry, 1), captured, given, captured);
            }
            return -1;
        }
    }
    return 0;
}

/* The tensor leaves of a call with nested arguments, keywords or constants,
 * checked against what was captured.  Returns a NEW reference to a list,
 * or NULL with an exception set. */
static PyObject *
call_leaves(GraphedObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *positional = NULL, *keywords = NULL, *tree = NULL, *flat = NULL;
    PyObject *leaves, *tensors = NULL;
    int same;

    if (check_keywords(self, kwnames) < 0) {
        return NULL;
    }
    positional = PyTuple_New(nargs);
    keywords = PyDict_New();
    if (positional == NULL || keywords == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyTuple_SET_ITEM(positional, i, Py_NewRef(args[i]));
    }
    /* In the captured (sorted) order, so the flattened leaves line up. */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->kw_names); i++) {
        PyObject *name = PyTuple_GET_ITEM(self->kw_names, i);
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
            if (PyUnicode_Compare(name, PyTuple_GET_ITEM(kwnames, k)) == 0 &&
                PyDict_SetItem(keywords, name, args[nargs + k]) < 0) {
                goto done;
            }
        }
    }
    tree = PyTuple_Pack(2, positional, keywords);
    flat = tree ? PyObject_CallOneArg(cgm.tree_flatten, tree) : NULL;
    if (flat == NULL) {
        goto done;
    }
    same = PyObject_RichCompareBool(PyTuple_GET_ITEM(flat, 1), self->in_spec, Py_EQ);
    if (same <= 0) {
        if (same == 0) {
            PyErr_Format(PyExc_TypeError,
                         "cgraph: the arguments are structured as %R, but the graph was "
                         "captured with %R. Pass arguments nested as the samples were.",
                         PyTuple_GET_ITEM(flat, 1), self->in_spec);
        }
        goto done;
    }
    leaves = PyTuple_GET_ITEM(flat, 0);
    if (check_constants(self, leaves) < 0) {
        goto done;
    }
    tensors = PyList_New(0);
    for (Py_ssize_t i = 0, c = 0; tensors != NULL && i < PyList_GET_SIZE(leaves); i++) {
        /* Constants are listed in leaf order: skip each at its position. */
        PyObject *constant = c < PyTuple_GET_SIZE(self->constants)
                                 ? PyTuple_GET_ITEM(self->constants, c) : NULL;
        if (constant && PyLong_AsSsize_t(PyTuple_GET_ITEM(constant, 0)) == i) {
            c++;
        } else if (PyList_Append(tensors, PyList_GET_ITEM(leaves, i)) < 0) {
            Py_CLEAR(tensors);
        }
    }
done:
    Py_XDECREF(flat);
    Py_XDECREF(tree);
    Py_XDECREF(keywords);
    Py_XDECREF(positional);
    return tensors;
}

/* The call path.  Returns a NEW reference, or NULL with an exception set. */
static PyObject *
Graphed_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                   PyObject *kwnames)
{
    GraphedObject *self = (GraphedObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *outs, *leaves, *result;

    if (self->module_ref != NULL) {
        PyObject *module;
        int differs = mode_differs(self, &module);
        if (differs < 0) {
            return NULL;
        }
        if (differs) {
            return call_eager(self, module, args, nargs, kwnames);
        }
        if (self->verify != NULL && self->verified_epoch != cgm.module_epoch &&
            verify_module(self, module) < 0) {
            return NULL;
        }
    }
    if (self->flat_args && kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyErr_Format(PyExc_TypeError,
                     "cgraph: unexpected keyword argument %R: the graph was captured "
                     "without keywords. Capture with sample_kwargs= to pass keywords.",
                     PyTuple_GET_ITEM(kwnames, 0));
        return NULL;
    }
    if (self->engine == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cgraph: this graphed callable was reset(); graph the "
                        "callable again to use it.");
        return NULL;
    }

    if (self->flat_args) {
        outs = cg_engine_replay(self->engine, args, nargs);
    } else {
        leaves = call_leaves(self, args, nargs, kwnames);
        if (leaves == NULL) {
            return NULL;
        }
        outs = cg_engine_replay(self->engine, PySequence_Fast_ITEMS(leaves),
                                PyList_GET_SIZE(leaves));
        Py_DECREF(leaves);
    }
    if (outs == NULL) {
        return NULL;
    }
    switch (self->out_kind) {
    case CG_OUT_SINGLE:
        result = Py_NewRef(PyTuple_GET_ITEM(outs, 0));
        Py_DECREF(outs);
        return result;
    case CG_OUT_TUPLE:
        return outs;
    default:
        result = PyObject_CallFunctionObjArgs(cgm.tree_unflatten, outs, self->out_spec, NULL);
        Py_DECREF(outs);
        return result;
    }
}

/* ---- reset and introspection ---------------------------------------------- */

PyDoc_STRVAR(Graphed_reset_doc,
"reset()\n\n"
"Free this callable's graphs, static tensors and pool memory.  Later calls\n"
"raise; so does the backward of a call made before reset().");

/* Returns a NEW reference (None). */
static PyObject *
Graphed_reset(GraphedObject *self, PyObject *unused)
{
    if (self->engine != NULL) {
        cg_engine_reset(self->engine);
        cg_engine_free(self->engine);
        self->engine = NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Graphed_methods[] = {
    {"reset", (PyCFunction)Graphed_reset, METH_NOARGS, Graphed_reset_doc},
    {NULL, NULL, 0, NULL}
};

/* Returns a NEW reference. */
static PyObject *
Graphed_get_pool(GraphedObject *self, void *closure)
{
    return Py_BuildValue("(KK)", self->pool.first, self->pool.second);
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_is_reset(GraphedObject *self, void *closure)
{
    return PyBool_FromLong(self->engine == NULL);
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_num_inputs(GraphedObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->engine ? cg_engine_num_inputs(self->engine) : 0);
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_num_params(GraphedObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->engine ? cg_engine_num_params(self->engine) : 0);
}

/* Returns a NEW reference: a dict of counters. */
static PyObject *
Graphed_get_stats(GraphedObject *self, void *closure)
{
    cg_stats stats = {0};
    if (self->engine != NULL) {
        stats = cg_engine_stats(self->engine);
    }
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "forward", stats.forward,
                         "backward", stats.backward, "grads_copied", stats.grads_copied,
                         "grads_added", stats.grads_added, "grads_slow", stats.grads_slow,
                         "copied_in_graph", stats.copied_in_graph,
                         "copied_before", stats.copied_before);
}

/* A NEW reference to a dict describing one pass's graph, to None if the
 * pass has no graph, or NULL with an exception set. */
static PyObject *
graph_shape_dict(cg_engine *engine, cg_pass pass)
{
    cg_graph_shape shape;
    int found = engine ? cg_engine_graph_shape(engine, pass, &shape) : 0;

    if (found < 0) {
        return NULL;
    }
    if (found == 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "nodes", shape.nodes, "kernels", shape.kernels,
                         "memcpys", shape.memcpys, "memsets", shape.memsets,
                         "others", shape.others, "roots", shape.roots, "edges", shape.edges);
}

/* Returns a NEW reference: {"forward": ..., "backward": ...}. */
static PyObject *
Graphed_get_graphs(GraphedObject *self, void *closure)
{
    PyObject *forward = graph_shape_dict(self->engine, CG_FORWARD);
    PyObject *backward = forward ? graph_shape_dict(self->engine, CG_BACKWARD) : NULL;
    PyObject *result = backward ? Py_BuildValue("{sOsO}", "forward", forward,
                                                "backward", backward) : NULL;
    Py_XDECREF(forward);
    Py_XDECREF(backward);
    return result;
}

static PyGetSetDef Graphed_getset[] = {
    {"stats", (getter)Graphed_get_stats, NULL,
     "How often each replay path ran: forward and backward replays; backwards whose\n"
     "parameter grads were copied (.grad was None), added (.grad accumulating) or\n"
     "took the slow path; arguments and incoming grads copied into the static\n"
     "buffers by the graph itself or, for layouts a memcpy cannot copy, before it.", NULL},
    {"graphs", (getter)Graphed_get_graphs, NULL,
     "What the forward and backward graphs are made of: node counts by type\n"
     "(kernels, memcpys, memsets, others), roots and edges; None for a pass\n"
     "without a graph.", NULL},
    {"pool", (getter)Graphed_get_pool, NULL,
     "The graphs' memory pool, usable as pool= for later captures.", NULL},
    {"is_reset", (getter)Graphed_get_is_reset, NULL, "Whether reset() ran.", NULL},
    {"num_inputs", (getter)Graphed_get_num_inputs, NULL,
     "Number of tensor arguments (pytree leaves) the graph takes.", NULL},
    {"num_params", (getter)Graphed_get_num_params, NULL,
     "Number of parameters (and other leaves requiring grad) the graph reads.", NULL},
    {NULL, NULL, NULL, NULL, NULL}
};

PyDoc_STRVAR(Graphed_doc,
"A callable replaying CUDA graphs of a captured callable.\n\n"
"Made by cgraph.make_graphed / make_graphed_callables; not constructible.");

PyTypeObject Graphed_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cgraph._C.Graphed",
    .tp_basicsize = sizeof(GraphedObject),
    .tp_dealloc = (destructor)Graphed_dealloc,
    .tp_vectorcall_offset = offsetof(GraphedObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = Graphed_doc,
    .tp_traverse = (traverseproc)Graphed_traverse,
    .tp_clear = (inquiry)Graphed_clear,
    .tp_weaklistoffset = offsetof(GraphedObject, weakreflist),
    .tp_methods = Graphed_methods,
    .tp_getset = Graphed_getset,
};
