/*
 * graphed.c -- the Graphed type: one graphed callable as Python sees it.
 * Third and fourth places of the lifecycle: replay (Graphed_vectorcall) and
 * reset (Graphed_reset).
 *
 * Python equivalent (the contract; the real thing is below):
 *
 *     class Graphed:
 *         spec: CallableSpec                  # spec.c, kept as captured
 *         def __call__(self, *args, **kwargs):
 *             module = self.spec.module()     # weakref; None for functions
 *             if module is not None and module.training != self.spec.training:
 *                 return self.spec.eager(module, *args, **kwargs)  # as torch does
 *             if module is not None and modules_changed_since_last_check:
 *                 self.spec.verify(module)    # parameters replaced? then raise
 *             tensors = args if self.spec.flat else call_tensors(self.spec, args, kwargs)
 *             outs = self._engine.replay(tensors)          # aten_replay.cpp
 *             return outs[0] | outs | tree_unflatten(outs, self._out_spec)
 *
 *         def reset(self): ...   # free graphs, static tensors, pool and spec
 *         pool: tuple[int, int]  # usable as pool= for other captures
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stddef.h>
#include <string.h>

#include "module.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    cg_state *state;     /* the module's state; the type keeps the module alive */
    cg_spec *spec;       /* owned: what was captured, and how calls are checked;
                            NULL once reset() */
    cg_engine *engine;   /* owned; NULL once reset() */
    cg_pool pool;        /* the engine's pool, kept after reset() */
    cg_out_layout out;   /* how outputs are rebuilt; out.spec owned */
    unsigned long long verified_epoch;  /* state->module_epoch at the last check */
    unsigned long long eager_pending;   /* calls run eagerly: a backward was pending */
    PyObject *weakreflist;
} GraphedObject;

static PyObject *Graphed_vectorcall(PyObject *callable, PyObject *const *args,
                                    size_t nargsf, PyObject *kwnames);

/* ---- construction and GC ------------------------------------------------ */

PyObject *
cg_graphed_new(cg_state *state, cg_spec *spec, cg_engine *engine, cg_out_layout *out)
{
    GraphedObject *self = PyObject_GC_New(GraphedObject, state->Graphed_Type);

    if (self == NULL) {
        cg_engine_free(engine);
        Py_CLEAR(out->spec);
        return NULL;
    }
    self->vectorcall = Graphed_vectorcall;
    self->state = state;
    self->spec = (cg_spec *)Py_NewRef(spec);
    self->engine = engine;
    self->pool = cg_engine_pool(engine);
    self->out = *out;
    out->spec = NULL;  /* ours now */
    self->verified_epoch = 0;
    self->eager_pending = 0;
    self->weakreflist = NULL;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static int
Graphed_traverse(GraphedObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->spec);
    Py_VISIT(self->out.spec);
    return 0;
}

static int
Graphed_clear(GraphedObject *self)
{
    Py_CLEAR(self->spec);
    Py_CLEAR(self->out.spec);
    return 0;
}

static void
Graphed_dealloc(GraphedObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    Graphed_clear(self);
    cg_engine_free(self->engine);  /* graphs and pool go with the last reference */
    self->engine = NULL;
    PyObject_GC_Del(self);
    Py_DECREF(type);
}

/* ---- replay --------------------------------------------------------------- */

/* Always returns NULL, with the error of a call after reset(). */
static PyObject *
raise_reset(void)
{
    PyErr_SetString(PyExc_RuntimeError,
                    "cgraph: this graphed callable was reset(); graph the "
                    "callable again to use it.");
    return NULL;
}

/* Runs the callable itself: a function, or the module's own forward (as
 * torch does when the module is in the other train/eval mode than at
 * capture).  Returns a NEW reference. */
static PyObject *
call_eager(const cg_spec *spec, PyObject *module, PyObject *const *args, Py_ssize_t nargs,
           PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject **full;
    PyObject *result;

    if (module == NULL) {
        return PyObject_Vectorcall(spec->function, args, (size_t)nargs, kwnames);
    }
    if (!spec->eager_takes_module) {
        return PyObject_Vectorcall(spec->eager, args, (size_t)nargs, kwnames);
    }
    full = PyMem_Malloc((size_t)(nargs + nkw + 1) * sizeof(PyObject *));
    if (full == NULL) {
        return PyErr_NoMemory();
    }
    full[0] = module;
    memcpy(full + 1, args, (size_t)(nargs + nkw) * sizeof(PyObject *));
    result = PyObject_Vectorcall(spec->eager, full, (size_t)(nargs + 1), kwnames);
    PyMem_Free(full);
    return result;
}

/* For a graphed module: 1 if it is in the other train/eval mode than at
 * capture (run it eagerly), 0 if the graphs replay, -1 with an exception
 * set.  Re-checks its parameters and buffers when some module anywhere
 * registered new ones (state->module_epoch moved): load_state_dict(
 * assign=True) or `module.weight = nn.Parameter(...)` would leave the graphs
 * reading the old tensors.  Stores a NEW reference to the module. */
static int
route_module_call(GraphedObject *self, const cg_spec *spec, PyObject **module)
{
    PyObject *training, *ok;
    int is_training;

    *module = cg_spec_target(spec);
    if (*module == NULL) {
        return -1;
    }
    training = PyObject_GetAttr(*module, self->state->str_training);
    is_training = training ? PyObject_IsTrue(training) : -1;
    Py_XDECREF(training);
    if (is_training < 0 || is_training != spec->training) {
        return is_training < 0 ? -1 : 1;
    }
    if (spec->verify == Py_None || self->verified_epoch == self->state->module_epoch) {
        return 0;
    }
    ok = PyObject_CallOneArg(spec->verify, *module);
    if (ok == NULL) {
        return -1;
    }
    Py_DECREF(ok);
    self->verified_epoch = self->state->module_epoch;
    return 0;
}

/* The engine's replay for a call that is not the fast one: the callable's
 * defaults stripped, then its tensors checked against the capture.
 * Returns a NEW reference to the tuple of output leaves, or NULL with an
 * exception set. */
static PyObject *
replay_slowly(GraphedObject *self, const cg_spec *spec, PyObject *const *args,
              Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *tensors = NULL, *outs = NULL;
    cg_call call;

    if (cg_strip_defaults(spec, args, nargs, kwnames, &call) < 0) {
        return NULL;
    }
    if (spec->flat && call.kwnames != NULL) {
        PyErr_Format(PyExc_TypeError,
                     "cgraph: unexpected keyword argument %R: the graph was captured "
                     "without keywords. Capture with sample_kwargs= to pass keywords.",
                     PyTuple_GET_ITEM(call.kwnames, 0));
    } else if (spec->flat) {
        outs = cg_engine_replay(self->engine, call.args, call.nargs);
    } else {
        tensors = cg_call_tensors(self->state, spec, call.args, call.nargs, call.kwnames);
    }
    /* Flattening ran Python (pytree, __eq__ of constants): reset since? */
    if (tensors != NULL) {
        outs = self->engine == NULL
                   ? raise_reset()
                   : cg_engine_replay(self->engine, PySequence_Fast_ITEMS(tensors),
                                      PyList_GET_SIZE(tensors));
    }
    Py_XDECREF(tensors);
    Py_XDECREF(call.owned);
    return outs;
}

/* The engine's replay for this call: the fast path when the call passes a
 * flat tuple of tensors as captured.  Returns a NEW reference to the tuple
 * of output leaves, or NULL with an exception set. */
static PyObject *
replay(GraphedObject *self, const cg_spec *spec, PyObject *const *args, Py_ssize_t nargs,
       PyObject *kwnames)
{
    if (spec->flat && nargs == PyTuple_GET_SIZE(spec->args) &&
        (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)) {
        return cg_engine_replay(self->engine, args, nargs);
    }
    return replay_slowly(self, spec, args, nargs, kwnames);
}

/* The outputs as the callable returned them at capture.  Steals `outs`;
 * returns a NEW reference, or NULL with an exception set. */
static PyObject *
rebuild_outputs(GraphedObject *self, PyObject *outs)
{
    PyObject *result;

    switch (self->out.kind) {
    case CG_OUT_SINGLE:
        result = Py_NewRef(PyTuple_GET_ITEM(outs, 0));
        break;
    case CG_OUT_TUPLE:
        return outs;
    default:
        result = PyObject_CallFunctionObjArgs(self->state->tree_unflatten, outs,
                                              self->out.spec, NULL);
    }
    Py_DECREF(outs);
    return result;
}

/* Whether this call must run eagerly because the backward of the previous
 * replay is still to run (Note [Calls before their backwards] in
 * aten_backward.cpp): 1 (counted, and reported once to the event hook), 0,
 * or -1 with an exception set. */
static int
backward_pending(GraphedObject *self)
{
    if (!cg_engine_backward_pending(self->engine)) {
        return 0;
    }
    if (self->eager_pending++ == 0 &&
        cg_report_event(self->state, "eager_pending", (PyObject *)self) < 0) {
        return -1;
    }
    return 1;
}

/* The call path: the module routed, the graph replayed (or the callable run
 * eagerly), the outputs rebuilt.  Returns a NEW reference, or NULL with an
 * exception set. */
static PyObject *
call(GraphedObject *self, const cg_spec *spec, PyObject *const *args, Py_ssize_t nargs,
     PyObject *kwnames)
{
    PyObject *module = NULL, *outs, *result = NULL;
    int eager = spec->module != Py_None ? route_module_call(self, spec, &module) : 0;

    if (eager == 0 && self->engine == NULL) {  /* verify() ran Python: reset since? */
        eager = -1;
        raise_reset();
    }
    if (eager == 0) {
        eager = backward_pending(self);
    }
    if (eager > 0) {
        result = call_eager(spec, module, args, nargs, kwnames);
    } else if (eager == 0) {
        outs = replay(self, spec, args, nargs, kwnames);
        result = outs ? rebuild_outputs(self, outs) : NULL;
    }
    Py_XDECREF(module);
    return result;
}

/* Holds the spec for the duration of the call: Python code it runs (an
 * eager forward, a verify) could reset() this callable.  Returns a NEW
 * reference, or NULL with an exception set. */
static PyObject *
Graphed_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                   PyObject *kwnames)
{
    GraphedObject *self = (GraphedObject *)callable;
    PyObject *spec = (PyObject *)self->spec, *result;

    if (self->engine == NULL || spec == NULL) {
        return raise_reset();
    }
    Py_INCREF(spec);
    result = call(self, (cg_spec *)spec, args, PyVectorcall_NARGS(nargsf), kwnames);
    Py_DECREF(spec);
    return result;
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
    Py_CLEAR(self->spec);  /* and the samples it holds */
    Py_RETURN_NONE;
}

static PyMethodDef Graphed_methods[] = {
    {"reset", (PyCFunction)Graphed_reset, METH_NOARGS, Graphed_reset_doc},
    {NULL, NULL, 0, NULL}
};

/* Returns a NEW reference. */
static PyObject *
Graphed_get_spec(GraphedObject *self, void *closure)
{
    if (self->spec == NULL) {
        Py_RETURN_NONE;
    }
    return Py_NewRef(self->spec);
}

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
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsK}", "forward", stats.forward,
                         "backward", stats.backward, "grads_copied", stats.grads_copied,
                         "grads_added", stats.grads_added, "grads_slow", stats.grads_slow,
                         "copied_in_graph", stats.copied_in_graph,
                         "copied_before", stats.copied_before,
                         "outputs_copied", stats.outputs_copied,
                         "eager_pending", self->eager_pending);
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
    {"spec", (getter)Graphed_get_spec, NULL,
     "The CallableSpec the graphs were captured from.", NULL},
    {"stats", (getter)Graphed_get_stats, NULL,
     "How often each replay path ran: forward and backward replays; backwards whose\n"
     "parameter grads were copied (.grad was None), added (.grad accumulating) or\n"
     "took the slow path; arguments and incoming grads copied into the static\n"
     "buffers by the graph itself or, for layouts a memcpy cannot copy, before it;\n"
     "outputs of earlier calls still held, moved to memory of their own before a\n"
     "replay (kept_outputs='copy'); calls run eagerly because the backward of the\n"
     "previous call had not run yet.", NULL},
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

static PyMemberDef Graphed_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(GraphedObject, vectorcall), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(GraphedObject, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(Graphed_doc,
"A callable replaying CUDA graphs of a captured callable.\n\n"
"Made by cgraph.make_graphed / make_graphed_callables; not constructible.");

static PyType_Slot Graphed_slots[] = {
    {Py_tp_dealloc, Graphed_dealloc},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_doc, (void *)Graphed_doc},
    {Py_tp_traverse, Graphed_traverse},
    {Py_tp_clear, Graphed_clear},
    {Py_tp_methods, Graphed_methods},
    {Py_tp_getset, Graphed_getset},
    {Py_tp_members, Graphed_members},
    {0, NULL},
};

PyType_Spec cg_graphed_type_spec = {
    .name = "cgraph._C.Graphed",
    .basicsize = sizeof(GraphedObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Graphed_slots,
};
