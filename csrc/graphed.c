/*
 * graphed.c -- the Graphed type: one graphed callable as Python sees it.
 * Third and fourth places of the lifecycle: replay (Graphed_vectorcall) and
 * reset (Graphed_reset).
 *
 * Python equivalent (the contract; the real thing is below):
 *
 *     class Graphed:
 *         entries: list[Entry]        # one per captured graph pair: spec, engine
 *         on_miss: Callable | None    # None: one graph, torch's rules
 *         def __call__(self, *args, **kwargs):
 *             if self.on_miss is None:                 # one graph
 *                 e = self.entries[0]
 *                 if module.training != e.spec.training:
 *                     return e.spec.eager(module, *args, **kwargs)  # as torch does
 *                 if not e.engine.may_replay():        # eager, counted
 *                     return e.spec.eager(...)
 *                 return replay(e, args, kwargs)       # raises on a mismatch
 *             for e in [hot entry, *the others]:       # several graphs
 *                 if e takes these arguments and e.engine.may_replay():
 *                     return replay(e, args, kwargs)
 *             answer = self.on_miss(self, args, kwargs, pending)
 *             if answer is True:                       # captured one more
 *                 return self(*args, **kwargs)
 *             if type(answer) is tuple:                # on_miss ran it eagerly
 *                 return answer[0]                     # (cgraph/_group.py), counted
 *             return eager(args, kwargs)               # past max_graphs, counted
 *
 *         def reset(self): ...   # free graphs, static tensors, pools and specs
 *         pool: tuple[int, int]  # the first graph's, usable as pool= elsewhere
 *
 * Note [Several graphs per callable]
 * Q: How does one callable get several graphs, and when may each replay?
 * A: A call that no entry takes (another shape, constant, autocast, grad
 *    mode or train/eval; an input that requires grad unlike the sample) goes
 *    to on_miss (cgraph/_regraph.py), which captures one more pair for it
 *    and adopts it here (_adopt).  New entries share a pool when they can:
 *    a captured forward's activations are free blocks of its pool once the
 *    backward capture ran (autograd dropped them; the engine replays into
 *    them), so a later capture in that pool may reuse them.  That is what
 *    keeps the memory of several graphs near that of the largest, and it is
 *    safe while no pending backward needs what a replay writes (Note
 *    [Captures that share a pool] in aten_pool.cpp): for graphs one
 *    callable captured on their own, while no entry of the pool is pending.
 *    A call that matches only entries that may not replay (a second forward
 *    before the first one's backward) gets an instance in a fresh pool
 *    (Transformer Engine keeps one graph per micro-batch the same way), and
 *    backwards then run in any order.  Past max_graphs, calls run eagerly
 *    and are counted.  on_miss may also run the call eagerly itself and
 *    return its result in a 1-tuple, as cgraph/_group.py does for a call
 *    inside a backward that no graph takes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stddef.h>
#include <string.h>

#include "module.h"

/* One captured forward/backward pair and what it was captured from. */
typedef struct {
    cg_spec *spec;       /* owned: the samples, and how calls are checked */
    cg_engine *engine;   /* owned */
    cg_out_layout out;   /* how outputs are rebuilt; out.spec owned */
    cg_pool pool;        /* the engine's pool */
} graph_entry;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    cg_state *state;     /* the module's state; the type keeps the module alive */
    graph_entry *entries;  /* owned; entries[0] is the first capture */
    Py_ssize_t n_entries;
    Py_ssize_t hot;      /* the entry the latest replay used: tried first */
    PyObject *on_miss;   /* NULL: one graph, torch's rules (Note [Several
                            graphs per callable]); else the handler */
    char is_reset;
    cg_pool pool;        /* the first entry's pool, kept after reset() */
    unsigned long long verified_epoch;  /* state->module_epoch at the last check */
    unsigned long long eager_pending;   /* calls run eagerly: a backward was pending */
    unsigned long long eager_past_limit;  /* calls run eagerly: no graph, no room */
    unsigned long long eager_on_miss;   /* calls on_miss ran eagerly itself */
    char kept_reported;  /* the event hook was told a replay kept an earlier output */
    PyObject *weakreflist;
} GraphedObject;

static PyObject *Graphed_vectorcall(PyObject *callable, PyObject *const *args,
                                    size_t nargsf, PyObject *kwnames);

/* ---- construction and GC ------------------------------------------------ */

/* Appends an entry, taking ownership of engine and out->spec (also on
 * failure; *out is cleared).  0, or -1 with an exception set. */
static int
add_entry(GraphedObject *self, cg_spec *spec, cg_engine *engine, cg_out_layout *out)
{
    graph_entry *grown = PyMem_Realloc(self->entries,
                                       (size_t)(self->n_entries + 1) * sizeof(graph_entry));
    if (grown == NULL) {
        cg_engine_free(engine);
        Py_CLEAR(out->spec);
        PyErr_NoMemory();
        return -1;
    }
    self->entries = grown;
    grown[self->n_entries] = (graph_entry){(cg_spec *)Py_NewRef(spec), engine, *out,
                                           cg_engine_pool(engine)};
    out->spec = NULL;  /* ours now */
    if (self->n_entries == 0) {
        self->pool = grown[0].pool;
    }
    self->hot = self->n_entries++;
    return 0;
}

/* An empty Graphed: no graph yet.  Returns a NEW reference, or NULL. */
static GraphedObject *
graphed_alloc(cg_state *state, PyObject *on_miss)
{
    GraphedObject *self = PyObject_GC_New(GraphedObject, state->Graphed_Type);

    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = Graphed_vectorcall;
    self->state = state;
    self->entries = NULL;
    self->n_entries = 0;
    self->hot = 0;
    self->on_miss = Py_XNewRef(on_miss);
    self->is_reset = 0;
    self->pool = (cg_pool){0, 0};
    self->verified_epoch = 0;
    self->eager_pending = 0;
    self->eager_past_limit = 0;
    self->eager_on_miss = 0;
    self->kept_reported = 0;
    self->weakreflist = NULL;
    PyObject_GC_Track(self);
    return self;
}

PyObject *
cg_graphed_new(cg_state *state, cg_spec *spec, cg_engine *engine, cg_out_layout *out)
{
    GraphedObject *self = graphed_alloc(state, NULL);

    if (self == NULL) {
        cg_engine_free(engine);
        Py_CLEAR(out->spec);
        return NULL;
    }
    if (add_entry(self, spec, engine, out) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

PyObject *
cg_graphed_empty(cg_state *state, PyObject *on_miss)
{
    return (PyObject *)graphed_alloc(state, on_miss);
}

static int
Graphed_traverse(GraphedObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->on_miss);
    for (Py_ssize_t k = 0; k < self->n_entries; k++) {
        Py_VISIT(self->entries[k].spec);
        Py_VISIT(self->entries[k].out.spec);
    }
    return 0;
}

/* Frees every entry: graphs and pools go with the engines' last
 * references (a pending backward holds one). */
static void
free_entries(GraphedObject *self, int reset)
{
    graph_entry *entries = self->entries;
    Py_ssize_t n = self->n_entries;

    self->entries = NULL;
    self->n_entries = 0;
    self->hot = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (reset) {
            cg_engine_reset(entries[k].engine);
        }
        cg_engine_free(entries[k].engine);
        Py_XDECREF(entries[k].spec);
        Py_XDECREF(entries[k].out.spec);
    }
    PyMem_Free(entries);
}

static int
Graphed_clear(GraphedObject *self)
{
    Py_CLEAR(self->on_miss);
    free_entries(self, 0);
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
    PyObject_GC_Del(self);
    Py_DECREF(type);
}

/* ---- replay: pieces shared by both paths ---------------------------------- */

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

/* For a graphed module: stores a NEW reference to it in *module and its
 * train/eval mode in *training; re-checks its parameters and buffers when
 * some module anywhere registered new ones (state->module_epoch moved):
 * load_state_dict(assign=True) or `module.weight = nn.Parameter(...)`
 * would leave the graphs reading the old tensors.  0, or -1 with an
 * exception set. */
static int
resolve_module(GraphedObject *self, const cg_spec *spec, PyObject **module, int *training)
{
    PyObject *flag, *ok;

    *module = cg_spec_target(spec);
    if (*module == NULL) {
        return -1;
    }
    flag = PyObject_GetAttr(*module, self->state->str_training);
    *training = flag ? PyObject_IsTrue(flag) : -1;
    Py_XDECREF(flag);
    if (*training < 0) {
        return -1;
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

/* A call's tensor leaves for one entry's spec: the callable's defaults
 * stripped, then the keywords, structure and constants checked.  On
 * success *tensors points at them (*nt of them) and *owned keeps them
 * alive (Py_XDECREF it; NULL when they are the call's own arguments).
 * 0, or -1 with an exception set (ValueError or TypeError: the call does
 * not bind as the capture did). */
static int
call_tensors(GraphedObject *self, const cg_spec *spec, PyObject *const *args,
             Py_ssize_t nargs, PyObject *kwnames, PyObject *const **tensors, Py_ssize_t *nt,
             PyObject **owned)
{
    PyObject *list = NULL;
    cg_call call;

    int status = -1;

    *owned = NULL;
    if (spec->flat && nargs == PyTuple_GET_SIZE(spec->args) &&
        (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)) {
        *tensors = args;  /* the fast path: a flat tuple of tensors as captured */
        *nt = nargs;
        return 0;
    }
    if (cg_strip_defaults(spec, args, nargs, kwnames, &call) < 0) {
        return -1;
    }
    if (spec->flat && call.kwnames != NULL) {
        PyErr_Format(PyExc_TypeError,
                     "cgraph: unexpected keyword argument %R: the graph was captured "
                     "without keywords. Capture with sample_kwargs= to pass keywords.",
                     PyTuple_GET_ITEM(call.kwnames, 0));
    } else if (spec->flat) {
        *tensors = call.args;
        *nt = call.nargs;
        *owned = call.owned;  /* ours now */
        call.owned = NULL;
        status = 0;
    } else {
        list = cg_call_tensors(self->state, spec, call.args, call.nargs, call.kwnames);
        if (list != NULL) {
            *tensors = PySequence_Fast_ITEMS(list);
            *nt = PyList_GET_SIZE(list);
            *owned = list;
            status = 0;
        }
    }
    Py_XDECREF(call.owned);
    return status;
}

/* The outputs as the callable returned them at capture.  Steals `outs`;
 * returns a NEW reference, or NULL with an exception set. */
static PyObject *
rebuild_outputs(GraphedObject *self, const graph_entry *entry, PyObject *outs)
{
    PyObject *result;

    switch (entry->out.kind) {
    case CG_OUT_SINGLE:
        result = Py_NewRef(PyTuple_GET_ITEM(outs, 0));
        break;
    case CG_OUT_TUPLE:
        return outs;
    default:
        result = PyObject_CallFunctionObjArgs(self->state->tree_unflatten, outs,
                                              entry->out.spec, NULL);
    }
    Py_DECREF(outs);
    return result;
}

/* The event to report, once per callable, when a replay copied or
 * invalidated an output of an earlier call that the caller still held (Note
 * [Outputs of earlier calls] in aten_replay.cpp): a cost or a trap the
 * caller may not know of.  NULL when there is none to report.  Runs no
 * Python. */
static const char *
kept_outputs_event(GraphedObject *self, const cg_engine *engine)
{
    cg_stats stats;

    if (self->kept_reported) {
        return NULL;
    }
    stats = cg_engine_stats(engine);
    if (stats.outputs_copied + stats.outputs_invalidated == 0) {
        return NULL;
    }
    self->kept_reported = 1;
    return stats.outputs_copied ? "outputs_copied" : "outputs_invalidated";
}

/* Replays entry k with these tensors.  Returns a NEW reference to the
 * outputs as the callable returned them, or NULL with an exception set. */
static PyObject *
replay_entry(GraphedObject *self, Py_ssize_t k, PyObject *const *tensors, Py_ssize_t nt)
{
    /* Flattening ran Python (pytree, __eq__ of constants): reset since? */
    PyObject *outs = k < self->n_entries
                         ? cg_engine_replay(self->entries[k].engine, tensors, nt)
                         : raise_reset();
    const char *event;
    PyObject *result;

    if (outs == NULL) {
        return NULL;
    }
    self->hot = k;
    event = kept_outputs_event(self, self->entries[k].engine);
    result = rebuild_outputs(self, &self->entries[k], outs);
    /* After the replay ran: a failing hook (a logging handler) must not
     * lose the call's outputs, whose step the graph has already taken. */
    if (event != NULL && result != NULL &&
        cg_report_event(self->state, event, (PyObject *)self) < 0) {
        PyErr_WriteUnraisable((PyObject *)self);
    }
    return result;
}

/* ---- replay with one graph: torch's rules ---------------------------------- */

/* Whether this call must run eagerly because the backward of the previous
 * replay is still to run (Note [Calls before their backwards] in
 * aten_backward.cpp), or that of another graph of its pool whose memory the
 * replay would overwrite (Note [Captures that share a pool] in
 * aten_pool.cpp): 1 (counted, and reported once to the event hook), 0, or
 * -1 with an exception set. */
static int
backward_pending(GraphedObject *self)
{
    if (cg_engine_may_replay(self->entries[0].engine)) {
        return 0;
    }
    if (self->eager_pending++ == 0 &&
        cg_report_event(self->state, "eager_pending", (PyObject *)self) < 0) {
        return -1;
    }
    return 1;
}

/* The call path of a callable with one graph: the module routed (in the
 * other train/eval mode it runs eagerly, as torch does), the graph
 * replayed (or the callable run eagerly), the outputs rebuilt.  A call
 * that does not match raises.  Returns a NEW reference, or NULL. */
static PyObject *
call_one(GraphedObject *self, const cg_spec *spec, PyObject *const *args, Py_ssize_t nargs,
         PyObject *kwnames)
{
    PyObject *module = NULL, *owned = NULL, *result = NULL;
    PyObject *const *tensors;
    Py_ssize_t nt;
    int training = spec->training;
    int eager = spec->module != Py_None ? resolve_module(self, spec, &module, &training) : 0;

    if (eager == 0 && training != spec->training) {
        eager = 1;
    } else if (eager == 0 && self->n_entries == 0) {  /* verify() ran Python */
        eager = -1;
        raise_reset();
    } else if (eager == 0) {
        eager = backward_pending(self);
    }
    if (eager > 0) {
        result = call_eager(spec, module, args, nargs, kwnames);
    } else if (eager == 0 &&
               call_tensors(self, spec, args, nargs, kwnames, &tensors, &nt, &owned) == 0) {
        result = replay_entry(self, 0, tensors, nt);
    }
    Py_XDECREF(owned);
    Py_XDECREF(module);
    return result;
}

/* ---- replay with several graphs -------------------------------------------- */

/* What find_entry found. */
typedef struct {
    Py_ssize_t index;        /* the entry to replay, or -1 */
    int pending;             /* some entry took the call but may not replay now */
    PyObject *const *tensors;
    Py_ssize_t nt;
    PyObject *owned;         /* keeps tensors alive; NULL if the caller's */
} lookup;

/* Whether entry k takes this call: 1 (out filled), 0, or -1 with an
 * exception set. */
static int
entry_takes(GraphedObject *self, Py_ssize_t k, int training, PyObject *const *args,
            Py_ssize_t nargs, PyObject *kwnames, lookup *out)
{
    PyObject *spec = (PyObject *)self->entries[k].spec;
    const graph_entry *e;
    int fits, bound;

    if (((cg_spec *)spec)->module != Py_None && ((cg_spec *)spec)->training != training) {
        return 0;
    }
    Py_INCREF(spec);  /* flattening runs Python, which could reset() us */
    bound = call_tensors(self, (cg_spec *)spec, args, nargs, kwnames, &out->tensors,
                         &out->nt, &out->owned);
    Py_DECREF(spec);
    if (bound < 0) {
        /* Binds unlike this capture (ValueError, TypeError: the errors
         * arguments.c raises for that): another entry's call, or a miss. */
        if (!PyErr_ExceptionMatches(PyExc_ValueError) &&
            !PyErr_ExceptionMatches(PyExc_TypeError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    if (k >= self->n_entries) {  /* reset() while flattening */
        Py_CLEAR(out->owned);
        return 0;
    }
    e = &self->entries[k];
    fits = cg_engine_accepts(e->engine, out->tensors, out->nt, 1);
    if (fits == 1 && !cg_engine_may_replay(e->engine)) {
        out->pending = 1;
        fits = 0;
    }
    if (fits != 1) {
        Py_CLEAR(out->owned);
    }
    return fits;
}

/* The entry to replay for this call, the hot one first.  0 (out->index -1
 * if none), or -1 with an exception set. */
static int
find_entry(GraphedObject *self, int training, PyObject *const *args, Py_ssize_t nargs,
           PyObject *kwnames, lookup *out)
{
    *out = (lookup){.index = -1};
    for (Py_ssize_t i = 0; i < self->n_entries; i++) {
        Py_ssize_t k = i == 0 ? self->hot : (i <= self->hot ? i - 1 : i);
        int takes = entry_takes(self, k, training, args, nargs, kwnames, out);
        if (takes != 0) {
            out->index = takes > 0 ? k : -1;
            return takes > 0 ? 0 : -1;
        }
    }
    return 0;
}

/* Asks on_miss about this call: 1 if it captured a graph for it, 0 if the
 * call should run eagerly, 2 if on_miss ran it eagerly itself (*ran: a NEW
 * reference to the result), -1 with an exception set. */
static int
ask_on_miss(GraphedObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
            int pending, PyObject **ran)
{
    PyObject *positional = PyTuple_New(nargs), *keywords = PyDict_New(), *answer = NULL;
    int captured = -1;

    for (Py_ssize_t i = 0; positional != NULL && i < nargs; i++) {
        PyTuple_SET_ITEM(positional, i, Py_NewRef(args[i]));
    }
    for (Py_ssize_t i = 0; keywords != NULL && kwnames != NULL &&
                           i < PyTuple_GET_SIZE(kwnames); i++) {
        if (PyDict_SetItem(keywords, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
            Py_CLEAR(keywords);
        }
    }
    if (positional != NULL && keywords != NULL) {
        answer = PyObject_CallFunction(self->on_miss, "OOOO", (PyObject *)self, positional,
                                       keywords, pending ? Py_True : Py_False);
    }
    if (answer != NULL && PyTuple_CheckExact(answer) && PyTuple_GET_SIZE(answer) == 1) {
        *ran = Py_NewRef(PyTuple_GET_ITEM(answer, 0));
        captured = 2;
    } else {
        captured = answer ? PyObject_IsTrue(answer) : -1;
    }
    Py_XDECREF(answer);
    Py_XDECREF(positional);
    Py_XDECREF(keywords);
    return captured;
}

/* The call path of a callable that may have several graphs (Note [Several
 * graphs per callable]).  Returns a NEW reference, or NULL. */
static PyObject *
call_any(GraphedObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *module = NULL, *result = NULL;
    /* One miss: on_miss captures a graph for the call, and the second
     * lookup finds it. */
    int training = 0, attempts = 2, captured = 1;
    lookup found = {.index = -1};

    while (captured == 1 && attempts-- > 0 && !self->is_reset) {
        const cg_spec *first = self->n_entries ? self->entries[0].spec : NULL;
        Py_CLEAR(module);
        if (first != NULL && first->module != Py_None &&
            (resolve_module(self, first, &module, &training) < 0 || self->is_reset)) {
            break;  /* verify() ran Python: reset since? */
        }
        if (find_entry(self, training, args, nargs, kwnames, &found) < 0) {
            break;
        }
        if (found.index >= 0) {
            result = replay_entry(self, found.index, found.tensors, found.nt);
            break;
        }
        captured = attempts > 0
                       ? ask_on_miss(self, args, nargs, kwnames, found.pending, &result)
                       : 0;
    }
    if (captured == 2) {
        self->eager_on_miss += 1;
    } else if (self->is_reset && result == NULL && !PyErr_Occurred()) {
        raise_reset();
    } else if (captured == 0 && self->n_entries > 0) {
        *(found.pending ? &self->eager_pending : &self->eager_past_limit) += 1;
        result = call_eager(self->entries[0].spec, module, args, nargs, kwnames);
    } else if (captured == 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cgraph: no graph was captured for this call (on_miss declined "
                        "the first call); this is a bug in cgraph, please report it.");
    }
    Py_XDECREF(found.owned);
    Py_XDECREF(module);
    return result;
}

/* Holds the first spec for the duration of the call: Python code it runs
 * (an eager forward, a verify, a capture) could reset() this callable.
 * Returns a NEW reference, or NULL with an exception set. */
static PyObject *
Graphed_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                   PyObject *kwnames)
{
    GraphedObject *self = (GraphedObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *spec, *result;

    if (self->is_reset) {
        return raise_reset();
    }
    if (self->on_miss != NULL) {
        return call_any(self, args, nargs, kwnames);
    }
    spec = Py_NewRef(self->entries[0].spec);
    result = call_one(self, (cg_spec *)spec, args, nargs, kwnames);
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
    /* Told before the graphs go, so that the log can say what is freed; a
     * hook that fails does not keep the memory. */
    if (!self->is_reset && self->n_entries > 0 &&
        cg_report_event(self->state, "reset", (PyObject *)self) < 0) {
        PyErr_WriteUnraisable((PyObject *)self);
    }
    self->is_reset = 1;
    free_entries(self, 1);  /* and the samples their specs hold */
    Py_CLEAR(self->on_miss);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Graphed_adopt_doc,
"_adopt(other)\n\n"
"Take the graphs of `other` (a Graphed just captured for a call this one\n"
"did not take) as one more entry; `other` is left empty and reset.");

/* Returns a NEW reference (None), or NULL with an exception set. */
static PyObject *
Graphed_adopt(GraphedObject *self, PyObject *arg)
{
    GraphedObject *other = (GraphedObject *)arg;

    if (!PyObject_TypeCheck(arg, self->state->Graphed_Type) || other == self ||
        other->n_entries != 1 || self->is_reset) {
        PyErr_SetString(PyExc_TypeError, "_adopt: expects another Graphed with one graph, "
                                         "into one that is not reset");
        return NULL;
    }
    graph_entry taken = other->entries[0];
    other->n_entries = 0;
    other->is_reset = 1;
    if (add_entry(self, taken.spec, taken.engine, &taken.out) < 0) {
        Py_DECREF(taken.spec);
        return NULL;
    }
    Py_DECREF(taken.spec);  /* add_entry took its own reference */
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Graphed_idle_pool_doc,
"_idle_pool(skip) -> tuple[int, int] | None\n\n"
"A pool of this callable's graphs where none has a backward pending, so a\n"
"new graph may share it (Note [Several graphs per callable]); never `skip`\n"
"(a pool shared with other callables, or None).");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
Graphed_idle_pool(GraphedObject *self, PyObject *arg)
{
    cg_pool skip = {0, 0};

    if (arg != Py_None && !PyArg_ParseTuple(arg, "KK;_idle_pool: expects a pool, a pair of "
                                            "ints, or None", &skip.first, &skip.second)) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < self->n_entries; k++) {
        cg_pool pool = self->entries[k].pool;
        int skipped = arg != Py_None && pool.first == skip.first && pool.second == skip.second;
        if (!skipped && !cg_pool_busy(pool, 0)) {
            return Py_BuildValue("(KK)", pool.first, pool.second);
        }
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Graphed_backward_pending_doc,
"_backward_pending() -> bool\n\n"
"Whether the backward of some graph's latest replay is still to run.");

/* Returns a NEW reference. */
static PyObject *
Graphed_backward_pending(GraphedObject *self, PyObject *Py_UNUSED(ignored))
{
    for (Py_ssize_t k = 0; k < self->n_entries; k++) {
        if (cg_engine_backward_pending(self->entries[k].engine)) {
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(Graphed_drop_pool_doc,
"_drop_pool(pool) -> int\n\n"
"Free this callable's graphs in `pool` (none may have a backward pending) and\n"
"return how many: Note [Warm-up in the pool] in aten_setup.cpp.");

/* Returns a NEW reference (an int), or NULL with an exception set. */
static PyObject *
Graphed_drop_pool(GraphedObject *self, PyObject *arg)
{
    cg_pool pool;
    Py_ssize_t kept = 0, n = self->n_entries;

    if (!PyArg_ParseTuple(arg, "KK;_drop_pool: expects a pool, a pair of ints", &pool.first,
                          &pool.second)) {
        return NULL;
    }
    if (cg_pool_busy(pool, 0)) {
        PyErr_SetString(PyExc_RuntimeError, "_drop_pool: a graph of that pool has a backward "
                                            "pending");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        graph_entry e = self->entries[k];
        if (e.pool.first == pool.first && e.pool.second == pool.second) {
            cg_engine_free(e.engine);
            Py_XDECREF(e.spec);
            Py_XDECREF(e.out.spec);
        } else {
            self->entries[kept++] = e;
        }
    }
    self->n_entries = kept;
    self->hot = 0;
    return PyLong_FromSsize_t(n - kept);
}

PyDoc_STRVAR(Graphed_set_on_miss_doc,
"_set_on_miss(on_miss)\n\n"
"Let this callable capture more graphs: calls its graphs do not take go to\n"
"on_miss(graphed, args, kwargs, pending) -> bool (Note [Several graphs per\n"
"callable]).");

/* Returns a NEW reference (None), or NULL with an exception set. */
static PyObject *
Graphed_set_on_miss(GraphedObject *self, PyObject *on_miss)
{
    if (!PyCallable_Check(on_miss) || self->is_reset) {
        PyErr_SetString(PyExc_TypeError, "_set_on_miss: expects a callable, on a Graphed "
                                         "that is not reset");
        return NULL;
    }
    Py_XSETREF(self->on_miss, Py_NewRef(on_miss));
    Py_RETURN_NONE;
}

static PyMethodDef Graphed_methods[] = {
    {"_set_on_miss", (PyCFunction)Graphed_set_on_miss, METH_O, Graphed_set_on_miss_doc},
    {"reset", (PyCFunction)Graphed_reset, METH_NOARGS, Graphed_reset_doc},
    {"_adopt", (PyCFunction)Graphed_adopt, METH_O, Graphed_adopt_doc},
    {"_idle_pool", (PyCFunction)Graphed_idle_pool, METH_O, Graphed_idle_pool_doc},
    {"_backward_pending", (PyCFunction)Graphed_backward_pending, METH_NOARGS,
     Graphed_backward_pending_doc},
    {"_drop_pool", (PyCFunction)Graphed_drop_pool, METH_O, Graphed_drop_pool_doc},
    {NULL, NULL, 0, NULL}
};

/* The first graph's engine, or NULL (none captured yet, or reset). */
static cg_engine *
first_engine(const GraphedObject *self)
{
    return self->n_entries ? self->entries[0].engine : NULL;
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_spec(GraphedObject *self, void *closure)
{
    if (self->n_entries == 0) {
        Py_RETURN_NONE;
    }
    return Py_NewRef(self->entries[0].spec);
}

/* Returns a NEW reference: a list of every graph's CallableSpec. */
static PyObject *
Graphed_get_specs(GraphedObject *self, void *closure)
{
    PyObject *specs = PyList_New(self->n_entries);

    for (Py_ssize_t k = 0; specs != NULL && k < self->n_entries; k++) {
        PyList_SET_ITEM(specs, k, Py_NewRef(self->entries[k].spec));
    }
    return specs;
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_pool(GraphedObject *self, void *closure)
{
    return Py_BuildValue("(KK)", self->pool.first, self->pool.second);
}

/* Returns a NEW reference: a list of the distinct pools of the graphs. */
static PyObject *
Graphed_get_pools(GraphedObject *self, void *closure)
{
    PyObject *pools = PyList_New(0);

    for (Py_ssize_t k = 0; pools != NULL && k < self->n_entries; k++) {
        cg_pool pool = self->entries[k].pool;
        PyObject *item = Py_BuildValue("(KK)", pool.first, pool.second);
        int seen = item ? PySequence_Contains(pools, item) : -1;
        if (seen < 0 || (seen == 0 && PyList_Append(pools, item) < 0)) {
            Py_CLEAR(pools);
        }
        Py_XDECREF(item);
    }
    return pools;
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_is_reset(GraphedObject *self, void *closure)
{
    return PyBool_FromLong(self->is_reset);
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_num_graphs(GraphedObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->n_entries);
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_num_inputs(GraphedObject *self, void *closure)
{
    cg_engine *engine = first_engine(self);
    return PyLong_FromSsize_t(engine ? cg_engine_num_inputs(engine) : 0);
}

/* Returns a NEW reference. */
static PyObject *
Graphed_get_num_params(GraphedObject *self, void *closure)
{
    cg_engine *engine = first_engine(self);
    return PyLong_FromSsize_t(engine ? cg_engine_num_params(engine) : 0);
}

/* The counters of every graph of the callable, summed. */
static cg_stats
summed_stats(const GraphedObject *self)
{
    cg_stats sum = {0};
    for (Py_ssize_t k = 0; k < self->n_entries; k++) {
        cg_stats one = cg_engine_stats(self->entries[k].engine);
        sum.forward += one.forward;
        sum.backward += one.backward;
        sum.grads_copied += one.grads_copied;
        sum.grads_added += one.grads_added;
        sum.grads_slow += one.grads_slow;
        sum.copied_in_graph += one.copied_in_graph;
        sum.copied_before += one.copied_before;
        sum.outputs_copied += one.outputs_copied;
        sum.outputs_invalidated += one.outputs_invalidated;
        sum.input_grads_copied += one.input_grads_copied;
        sum.param_grads_copied += one.param_grads_copied;
    }
    return sum;
}

/* Returns a NEW reference: a dict of counters, summed over the graphs. */
static PyObject *
Graphed_get_stats(GraphedObject *self, void *closure)
{
    cg_stats sum = summed_stats(self);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsn}", "forward", sum.forward,
                         "backward", sum.backward, "grads_copied", sum.grads_copied,
                         "grads_added", sum.grads_added, "grads_slow", sum.grads_slow,
                         "copied_in_graph", sum.copied_in_graph,
                         "copied_before", sum.copied_before,
                         "outputs_copied", sum.outputs_copied,
                         "outputs_invalidated", sum.outputs_invalidated,
                         "input_grads_copied", sum.input_grads_copied,
                         "param_grads_copied", sum.param_grads_copied,
                         "eager_pending", self->eager_pending,
                         "eager_past_limit", self->eager_past_limit,
                         "eager_on_miss", self->eager_on_miss,
                         "graphs", self->n_entries);
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
    PyObject *forward = graph_shape_dict(first_engine(self), CG_FORWARD);
    PyObject *backward = forward ? graph_shape_dict(first_engine(self), CG_BACKWARD) : NULL;
    PyObject *result = backward ? Py_BuildValue("{sOsO}", "forward", forward,
                                                "backward", backward) : NULL;
    Py_XDECREF(forward);
    Py_XDECREF(backward);
    return result;
}

/* "Linear", "train_step": what the graphs were captured from.  Returns a
 * NEW reference, or NULL with an exception set. */
static PyObject *
callable_name(const cg_spec *spec)
{
    PyObject *target = cg_spec_target(spec), *name;

    if (target == NULL) {
        return NULL;
    }
    if (spec->module != Py_None) {
        name = PyType_GetName(Py_TYPE(target));
    } else {
        name = PyObject_GetAttrString(target, "__qualname__");
        if (name == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();  /* a callable object: its type's name */
            name = PyType_GetName(Py_TYPE(target));
        }
    }
    Py_DECREF(target);
    return name;
}

/* "[(16, 64), (16,)]": the shapes of one graph's tensor arguments.  Returns
 * a NEW reference, or NULL with an exception set. */
static PyObject *
entry_shapes(const graph_entry *entry)
{
    Py_ssize_t n = PyTuple_GET_SIZE(entry->spec->tensors);
    PyObject *shapes = PyList_New(n), *text = NULL;

    for (Py_ssize_t i = 0; shapes != NULL && i < n; i++) {
        PyObject *shape = PyObject_GetAttrString(PyTuple_GET_ITEM(entry->spec->tensors, i),
                                                 "shape");
        PyObject *tuple = shape ? PySequence_Tuple(shape) : NULL;
        Py_XDECREF(shape);
        if (tuple == NULL) {
            Py_CLEAR(shapes);
            break;
        }
        PyList_SET_ITEM(shapes, i, tuple);
    }
    text = shapes ? PyObject_Repr(shapes) : NULL;
    Py_XDECREF(shapes);
    return text;
}

/* What a graphed callable is at a glance: the callable, each graph's
 * argument shapes, replays, eager calls and the first pool.  Returns a NEW
 * reference, or NULL with an exception set. */
static PyObject *
Graphed_repr(GraphedObject *self)
{
    PyObject *name, *shapes, *sep, *joined, *result;
    cg_stats stats = summed_stats(self);

    if (self->is_reset) {
        return PyUnicode_FromString("<cgraph.Graphed: reset>");
    }
    if (self->n_entries == 0) {
        return PyUnicode_FromString("<cgraph.Graphed: no graph yet (captures on its first "
                                    "call)>");
    }
    shapes = PyList_New(self->n_entries);
    for (Py_ssize_t k = 0; shapes != NULL && k < self->n_entries; k++) {
        PyObject *one = entry_shapes(&self->entries[k]);
        if (one == NULL) {
            Py_CLEAR(shapes);
            break;
        }
        PyList_SET_ITEM(shapes, k, one);
    }
    name = shapes ? callable_name(self->entries[0].spec) : NULL;
    sep = name ? PyUnicode_FromString(" ") : NULL;
    joined = sep ? PyUnicode_Join(sep, shapes) : NULL;
    result = joined ? PyUnicode_FromFormat(
        "<cgraph.Graphed of %U: %zd graph%s %U, %llu replays, %llu eager calls, pool (%llu, "
        "%llu)>", name, self->n_entries, self->n_entries == 1 ? "" : "s", joined,
        stats.forward, self->eager_pending + self->eager_past_limit + self->eager_on_miss,
        self->pool.first,
        self->pool.second) : NULL;
    Py_XDECREF(joined);
    Py_XDECREF(sep);
    Py_XDECREF(name);
    Py_XDECREF(shapes);
    return result;
}

static PyGetSetDef Graphed_getset[] = {
    {"spec", (getter)Graphed_get_spec, NULL,
     "The CallableSpec the first graph was captured from (None before any).", NULL},
    {"specs", (getter)Graphed_get_specs, NULL,
     "The CallableSpec of every graph, in capture order.", NULL},
    {"num_graphs", (getter)Graphed_get_num_graphs, NULL,
     "How many forward/backward graph pairs this callable has captured.", NULL},
    {"stats", (getter)Graphed_get_stats, NULL,
     "How often each replay path ran: forward and backward replays; backwards whose\n"
     "parameter grads were handed out as computed or copied (.grad was None), added\n"
     "by the add tail or took the general path; arguments and incoming grads copied\n"
     "into the static buffers by the graph itself or, for layouts a memcpy cannot\n"
     "copy (and incoming grads lying in the graph's own grad buffers), before it;\n"
     "outputs of earlier calls still held, moved to memory of their own before a\n"
     "replay (kept_outputs='copy') or made unreadable (kept_outputs='error'); grads\n"
     "handed to autograd for inputs, and parameter grads, still held and moved to\n"
     "memory of their own before a replay; calls\n"
     "run eagerly because a backward the replay would overwrite had not run yet\n"
     "(eager_pending), because no graph took them and max_graphs were captured\n"
     "(eager_past_limit), or by on_miss itself (eager_on_miss: a call inside a\n"
     "backward that no graph of a layer sharing a pool= takes); graphs captured.\n"
     "Summed over the graphs.", NULL},
    {"graphs", (getter)Graphed_get_graphs, NULL,
     "What the first forward and backward graphs are made of: node counts by type\n"
     "(kernels, memcpys, memsets, others), roots and edges; None for a pass\n"
     "without a graph.", NULL},
    {"pool", (getter)Graphed_get_pool, NULL,
     "The graphs' memory pool, usable as pool= for later captures.", NULL},
    {"is_reset", (getter)Graphed_get_is_reset, NULL, "Whether reset() ran.", NULL},
    {"pools", (getter)Graphed_get_pools, NULL,
     "The distinct memory pools of the graphs (the first is .pool).", NULL},
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
    {Py_tp_repr, Graphed_repr},
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
