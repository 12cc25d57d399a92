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
 *         max_graphs: int             # on_miss captures up to this many graphs
 *         shared: Pool | None         # the pool other callables' graphs use too
 *         layer: bool                 # graphed one by one into `shared`
 *         casts: bool                 # another floating dtype cast into an
 *                                     # entry, as torch's drop-in does
 *         def __call__(self, *args, **kwargs):
 *             if self.on_miss is None:                 # one graph
 *                 e = self.entries[0]
 *                 if modes_differ(e.spec, module):    # its own, or a submodule's
 *                     return e.spec.eager(module, *args, **kwargs)  # as torch does
 *                 if not e.engine.may_replay():        # eager, counted
 *                     return e.spec.eager(...)
 *                 return replay(e, args, kwargs)       # raises on a mismatch
 *             for e in [hot entry, *the others]:       # several graphs
 *                 if e takes these arguments and e.engine.may_replay():
 *                     return replay(e, args, kwargs)
 *             pending = some e takes them, but may not replay now
 *             if self.layer and autograd_runs_a_backward():
 *                 return eager(args, kwargs)           # counted: eager_on_miss
 *             if self.refusal:                         # warm-up state in `shared`
 *                 raise self.refusal
 *             if len(self.entries) >= self.max_graphs: # counted: eager_pending
 *                 event("past_max_graphs"), once       # or eager_past_limit
 *                 return eager(args, kwargs)
 *             site = self.site(pending)
 *             try:
 *                 g = self.on_miss(self, args, kwargs, site)  # a Graphed, one graph
 *                 if g is None:                    # a call no graph can take
 *                     return eager(args, kwargs)   # counted: eager_on_miss
 *             except CaptureError as e if e.kind == "warmup_state":
 *                 if site.pool == self.shared:
 *                     self.refusal = e; raise
 *                 drop the entries in site.pool; event("pool_dropped")
 *                 g = self.on_miss(self, args, kwargs,
 *                                  CaptureSite(new_pool(), False, False, pending))
 *             self.entries.append(g.entries.pop())
 *             return self(*args, **kwargs)             # once; then eager, counted
 *
 *         def site(self, pending) -> CaptureSite:      # where on_miss captures
 *             if self.layer and open_to_layers(self.shared, pending or
 *                                              any entry's backward pending):
 *                 return CaptureSite(self.shared, warm_in_pool=True,
 *                                    keep_activations=True, pending=pending)
 *             for e in self.entries:
 *                 if e.pool != self.shared and no graph of e.pool is pending:
 *                     return CaptureSite(e.pool, True, False, pending)
 *             return CaptureSite(new_pool(), False, False, pending)
 *
 *         def reset(self): ...   # free graphs, static tensors, pools and specs
 *         pool: tuple[int, int]  # the first graph's, usable as pool= elsewhere
 *
 * Note [Several graphs per callable]
 * Q: How does one callable get several graphs, and when may each replay?
 * A: A call that no entry takes (another shape or dtype, constant,
 *    autocast, grad mode or train/eval; a call outside inference_mode of
 *    an entry whose static tensors are inference tensors; an input that
 *    requires grad unlike the sample, a parameter unfrozen since; with
 *    `casts`, the drop-in's, another floating dtype is cast into an entry
 *    instead) is decided here, from native state only.
 *    What needs Python, capturing, is on_miss's (cgraph/_regraph.py): it
 *    captures one more pair for the call where a CaptureSite says and
 *    returns it, and this file takes it as a new entry; nothing comes back
 *    into C meanwhile.  New entries share a pool when they can: a captured
 *    forward's activations are free blocks of its pool once the backward
 *    capture ran (autograd dropped them; the engine replays into them), so
 *    a later capture in that pool may reuse them.  That is what keeps the
 *    memory of several graphs near that of the largest, and it is safe
 *    while no pending backward needs what a replay writes (Note [Captures
 *    that share a pool] in aten_pool.cpp): for graphs one callable
 *    captured on their own, while no entry of the pool is
 *    pending; a pool shared with other callables gets no later graph but a
 *    layer's (below).  A call that matches only entries that may not replay
 *    (a second forward before the first one's backward) gets an instance in
 *    a fresh pool (Transformer Engine keeps one graph per micro-batch the
 *    same way), and backwards then run in any order.  Layers graphed one by
 *    one with one pool= capture in it while cg_pool_open_to_layers lets them
 *    (Note [One pool for separately graphed callables] in cgraph/_group.py),
 *    and their calls inside autograd's backward (a checkpoint's recompute)
 *    run eagerly: no capture runs there.  Past max_graphs, calls run eagerly
 *    and are counted.  A warm-up that left state in a pool (Note [Warm-up in
 *    the pool] in aten_setup.cpp) drops this callable's graphs there
 *    (captured again when needed) and the call is captured without warm-up
 *    in a pool; in the shared pool, it refuses this and every later capture.
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

/* The counters a Graphed keeps itself, beside its engines' (CG_STATS_COUNTERS
 * in cgraph.h): calls that ran eagerly.  X(field, doc), as there: the
 * fields below, their zeroing, Graphed.stats and its docstring come from it. */
#define GRAPHED_COUNTERS(X)                                                            \
    X(eager_pending, "calls run eagerly because a backward that the replay would "     \
                     "overwrite had not run yet")                                      \
    X(eager_past_limit, "calls run eagerly because no graph took them and max_graphs " \
                        "were captured")                                               \
    X(eager_on_miss, "calls run eagerly because they came inside a backward (a "       \
                     "checkpoint's recompute) and no graph of a layer sharing a pool= "\
                     "took them, or carried a transformers Cache (generate())")        \
    X(args_flattened, "times a call's arguments went through torch's tree_flatten, "   \
                      "slower than the native walk (once per graph that looked at "   \
                      "the call): structured unlike the samples, with dict keys other "\
                      "than str, or holding a named tuple, an OrderedDict, a tensor "   \
                      "subclass or another leaf than a tensor, None, bool, int, float "\
                      "or str (Note [Arguments walked in C])")

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    cg_state *state;     /* the module's state; the type keeps the module alive */
    graph_entry *entries;  /* owned; entries[0] is the first capture */
    Py_ssize_t n_entries;
    Py_ssize_t hot;      /* the entry the latest replay used: tried first */
    /* Several graphs: Note [Several graphs per callable].  on_miss NULL: one
     * graph, torch's rules, and the fields up to is_reset are unused. */
    PyObject *on_miss;   /* on_miss(self, args, kwargs, site) -> Graphed */
    PyObject *eager;     /* NULL, or eager(args, kwargs): a call run eagerly
                            before the first graph */
    PyObject *refusal;   /* NULL, or the CaptureError every later capture
                            raises again: a warm-up left state in `shared` */
    Py_ssize_t max_graphs;  /* on_miss captures up to this many graphs */
    cg_pool shared;      /* with has_shared: the pool other callables' graphs
                            use too; later graphs stay out of it, but a
                            layer's (cgraph/_group.py) */
    char has_shared;
    char layer;          /* graphed one by one into `shared` (cgraph/_group.py) */
    char casts;          /* another floating dtype is cast into a graph that
                            takes the call otherwise, as torch's drop-in does;
                            else it gets a graph of its own (eager's dtype) */
    char limit_reported; /* the event hook heard of calls past max_graphs */
    char is_reset;
    cg_pool pool;        /* the first entry's pool, kept after reset() */
    unsigned long long verified_epoch;  /* state->module_epoch at the last check */
    GRAPHED_COUNTERS(CG_COUNTER_FIELD)  /* eager_pending, eager_past_limit, ... */
    char held_output_reported;  /* the event hook was told a replay kept an earlier output */
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
    self->eager = NULL;
    self->refusal = NULL;
    self->max_graphs = 1;
    self->shared = (cg_pool){0, 0};
    self->has_shared = 0;
    self->layer = 0;
    self->casts = 0;
    self->limit_reported = 0;
    self->is_reset = 0;
    self->pool = (cg_pool){0, 0};
    self->verified_epoch = 0;
#define ZERO_COUNTER(field, doc) self->field = 0;
    GRAPHED_COUNTERS(ZERO_COUNTER)
#undef ZERO_COUNTER
    self->held_output_reported = 0;
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

/* Moves the one graph of `arg`, a Graphed graph_callables just captured for
 * this callable, into `self` as its latest entry; `arg` is left empty and
 * reset.  `what` names `arg` in the error.  0, or -1 with an exception set. */
static int
take_graph(GraphedObject *self, PyObject *arg, const char *what)
{
    GraphedObject *other = (GraphedObject *)arg;
    graph_entry taken;
    int status;

    if (!PyObject_TypeCheck(arg, self->state->Graphed_Type) || other == self ||
        other->n_entries != 1) {
        PyErr_Format(PyExc_TypeError,
                     "cgraph: %s is %R, not a Graphed with the one graph just captured "
                     "(cgraph/_capture.py graph()); this is a bug in cgraph, please report "
                     "it.", what, arg);
        return -1;
    }
    taken = other->entries[0];
    other->n_entries = 0;
    other->is_reset = 1;
    status = add_entry(self, taken.spec, taken.engine, &taken.out);
    Py_DECREF(taken.spec);  /* add_entry took its own reference */
    return status;
}

/* _C.new_graphed (module.h).  Returns a NEW reference, or NULL with an
 * exception set. */
PyObject *
cg_new_graphed(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"on_miss", "max_graphs", "first", "shared_pool", "layer",
                               "eager", "casts", NULL};
    PyObject *on_miss, *first = Py_None, *shared = Py_None, *eager = Py_None;
    Py_ssize_t max_graphs = 1;
    int layer = 0, casts = 0;
    GraphedObject *self;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n$OOpOp:new_graphed", keywords,
                                     &on_miss, &max_graphs, &first, &shared, &layer, &eager,
                                     &casts)) {
        return NULL;
    }
    if (!PyCallable_Check(on_miss) || max_graphs < 1 ||
        (eager != Py_None && !PyCallable_Check(eager)) || (layer && shared == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "new_graphed: expects a callable on_miss, "
                                         "max_graphs >= 1, eager callable or None, and a "
                                         "layer's shared_pool");
        return NULL;
    }
    self = graphed_alloc((cg_state *)PyModule_GetState(module), on_miss);
    if (self == NULL) {
        return NULL;
    }
    self->max_graphs = max_graphs;
    self->layer = (char)layer;
    self->casts = (char)casts;
    self->eager = eager == Py_None ? NULL : Py_NewRef(eager);
    self->has_shared = shared != Py_None;
    if (self->has_shared && !PyTuple_Check(shared)) {  /* PyArg_ParseTuple takes tuples */
        PyErr_SetString(PyExc_TypeError, "new_graphed: shared_pool must be a pair of ints");
        Py_DECREF(self);
        return NULL;
    }
    if ((self->has_shared &&
         !PyArg_ParseTuple(shared, "KK;new_graphed: shared_pool must be a pair of ints",
                           &self->shared.first, &self->shared.second)) ||
        (first != Py_None && take_graph(self, first, "first") < 0)) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
Graphed_traverse(GraphedObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->on_miss);
    Py_VISIT(self->eager);
    Py_VISIT(self->refusal);
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
    self->is_reset = 1;  /* a call after the collector cleared it raises, as after reset() */
    Py_CLEAR(self->on_miss);
    Py_CLEAR(self->eager);
    Py_CLEAR(self->refusal);
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
 * train/eval mode in *training; calls its check (spec->verify) when some
 * module anywhere registered a parameter, buffer or submodule since the
 * last one passed (state->module_epoch moved): load_state_dict(assign=True)
 * or `module.weight = nn.Parameter(...)` would leave the graphs reading the
 * old tensors.  The check decides how much to look at: Note [Which
 * registrations re-check graphed modules] in cgraph/_describe.py.  0, or
 * -1 with an exception set. */
static int
resolve_module(GraphedObject *self, const cg_spec *spec, PyObject **module, int *training)
{
    PyObject *flag, *ok;

    *module = cg_spec_target(spec);
    if (*module == NULL) {
        return -1;
    }
    flag = cg_training_of(self->state, *module);
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

/* Whether a module found in mode `training` (resolve_module) now runs
 * otherwise than `spec` was captured: its own mode, or one of its
 * submodules' that read theirs (Note [Submodules' modes in per-module
 * graphs] in cgraph/_modes.py).  1, 0, or -1 with an exception set. */
static int
modes_differ(const GraphedObject *self, const cg_spec *spec, int training)
{
    int hold;

    if (spec->training != training) {
        return 1;
    }
    hold = cg_spec_modes_hold(self->state, spec);
    return hold < 0 ? -1 : !hold;
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
                     "without keywords. Pass the arguments as the capture did "
                     "(positionally), or capture with sample_kwargs= to pass keywords.",
                     PyTuple_GET_ITEM(call.kwnames, 0));
    } else if (spec->flat) {
        *tensors = call.args;
        *nt = call.nargs;
        *owned = call.owned;  /* ours now */
        call.owned = NULL;
        status = 0;
    } else {
        list = cg_call_tensors(self->state, spec, call.args, call.nargs, call.kwnames,
                               &self->args_flattened);
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
held_output_event(GraphedObject *self, const cg_engine *engine)
{
    cg_stats stats;

    if (self->held_output_reported) {
        return NULL;
    }
    stats = cg_engine_stats(engine);
    if (stats.outputs_copied + stats.outputs_invalidated == 0) {
        return NULL;
    }
    self->held_output_reported = 1;
    return stats.outputs_copied ? "outputs_copied" : "outputs_invalidated";
}

/* Whether entry k is still the one captured for `spec`: Python that ran
 * since it was looked up (flattening, constants' __eq__, modes) may have
 * reset() this callable or dropped a pool, which compacts the entries. */
static int
entry_is(const GraphedObject *self, Py_ssize_t k, const cg_spec *spec)
{
    return k < self->n_entries && self->entries[k].spec == spec;
}

/* Replays entry k with these tensors (`accepted`: cg_engine_accepts just
 * took them, so the replay does not check them again).  Returns a NEW
 * reference to the outputs as the callable returned them, or NULL with an
 * exception set. */
static PyObject *
replay_entry(GraphedObject *self, Py_ssize_t k, PyObject *const *tensors, Py_ssize_t nt,
             int accepted)
{
    /* Flattening ran Python (pytree, __eq__ of constants): reset since? */
    cg_spec *spec = k < self->n_entries ? (cg_spec *)Py_NewRef(self->entries[k].spec) : NULL;
    PyObject *outs = spec != NULL
                         ? cg_engine_replay(self->entries[k].engine, tensors, nt, accepted)
                         : raise_reset();
    const char *event;
    PyObject *result;

    /* Python the replay ran (a finalizer) may have reset() us or dropped a
     * pool, which reorders the entries. */
    if (outs != NULL && !entry_is(self, k, spec)) {
        Py_CLEAR(outs);
        raise_reset();
    }
    Py_XDECREF(spec);
    if (outs == NULL) {
        return NULL;
    }
    self->hot = k;
    event = held_output_event(self, self->entries[k].engine);
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
eager_for_pending_backward(GraphedObject *self)
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
 * other train/eval mode, its own or a submodule's, it runs eagerly, as
 * torch does in the other mode of its own), the graph
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

    if (eager == 0 && spec->module != Py_None) {
        eager = modes_differ(self, spec, training);  /* the other mode: eagerly */
    }
    if (eager == 0 && self->n_entries == 0) {  /* verify() ran Python */
        eager = -1;
        raise_reset();
    } else if (eager == 0) {
        eager = eager_for_pending_backward(self);
    }
    if (eager > 0) {
        result = call_eager(spec, module, args, nargs, kwnames);
    } else if (eager == 0 &&
               call_tensors(self, spec, args, nargs, kwnames, &tensors, &nt, &owned) == 0) {
        result = replay_entry(self, 0, tensors, nt, 0);
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
 * exception set.  The module's own mode first, the submodules' last, for
 * the entry whose shapes fit: their reads grow with the model, the shape
 * test does not (Note [Submodules' modes in per-module graphs]). */
static int
entry_takes(GraphedObject *self, Py_ssize_t k, int training, PyObject *const *args,
            Py_ssize_t nargs, PyObject *kwnames, lookup *out)
{
    /* Flattening and reading modes run Python, which could reset() us. */
    cg_spec *spec = (cg_spec *)Py_NewRef(self->entries[k].spec);
    int module = spec->module != Py_None;
    int fits = 0;

    if (module && spec->training != training) {
        Py_DECREF(spec);
        return 0;  /* the other mode's graphs */
    }
    if (call_tensors(self, spec, args, nargs, kwnames, &out->tensors, &out->nt,
                     &out->owned) < 0) {
        Py_DECREF(spec);
        /* Binds unlike this capture (ValueError, TypeError: the errors
         * arguments.c raises for that): another entry's call, or a miss. */
        if (!PyErr_ExceptionMatches(PyExc_ValueError) &&
            !PyErr_ExceptionMatches(PyExc_TypeError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    if (entry_is(self, k, spec)) {  /* else reset() or a pool dropped while flattening */
        fits = cg_engine_accepts(self->entries[k].engine, out->tensors, out->nt, 1,
                                 !self->casts);
    }
    if (fits == 1 && module) {
        fits = cg_spec_modes_hold(self->state, spec);
    }
    if (fits == 1 && !entry_is(self, k, spec)) {  /* ... while reading modes */
        fits = 0;
    }
    Py_DECREF(spec);
    if (fits == 1 && !cg_engine_may_replay(self->entries[k].engine)) {
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

/* ---- a call no graph takes ----------------------------------------------- */

/* Where and how on_miss captures a call no graph takes: chosen here, handed
 * to it as a _C.CaptureSite (Note [Several graphs per callable]). */
typedef struct {
    cg_pool pool;          /* where the graph goes */
    int warm_in_pool;      /* warm up in `pool`: Note [Warm-up in the pool] */
    int keep_activations;  /* Note [Layers captured one by one into one pool] */
    int pending;           /* a graph takes the call but its backward is pending */
    int asks_again;        /* after a warm-up left state in `pool`: recover_from_warm_up */
} capture_site;

static PyStructSequence_Field capture_site_fields[] = {
    {"pool", "Where the graph goes: the pool= of a layer graphed one by one, a pool "
             "of this callable's graphs where none has a backward pending, or a fresh "
             "one."},
    {"warm_in_pool", "Whether warm-up runs in `pool` (Note [Warm-up in the pool] in "
                     "csrc/aten_setup.cpp)."},
    {"keep_activations", "Whether the captures keep their activations allocated until "
                         "their backward has run (Note [Layers captured one by one into "
                         "one pool] in csrc/aten_pool.cpp)."},
    {"pending", "Whether a graph takes the call but its backward is still to run (a "
                "second micro-batch): why the call misses."},
    {"asks_again", "Whether, after on_miss raised a CaptureError of kind 'warmup_state' "
                   "(a warm-up left state in `pool`), the core drops its graphs in `pool` "
                   "and asks on_miss again for this same call, in a fresh pool (a pool "
                   "of the callable's own; not the pool= shared with other layers, where "
                   "that error is raised).  Unless, by then, a graph of that pool awaits "
                   "its backward (on_miss does not run one) or the drop runs out of "
                   "memory: the error is then raised."},
    {NULL, NULL},
};

static PyStructSequence_Desc capture_site_desc = {
    "cgraph._C.CaptureSite",
    "Where on_miss captures a call no graph of its callable takes, chosen by the\n"
    "native core (Note [Several graphs per callable] in csrc/graphed.c).",
    capture_site_fields,
    5,
};

/* Returns a NEW reference to the type, or NULL with an exception set. */
PyTypeObject *
cg_capture_site_type(void)
{
    return PyStructSequence_NewType(&capture_site_desc);
}

/* A NEW reference to `site` as on_miss takes it, or NULL with an exception
 * set. */
static PyObject *
site_record(const GraphedObject *self, const capture_site *site)
{
    PyObject *record = PyStructSequence_New(self->state->CaptureSite_Type);
    PyObject *pool = record ? Py_BuildValue("(KK)", site->pool.first, site->pool.second)
                            : NULL;

    if (pool == NULL) {
        Py_XDECREF(record);
        return NULL;
    }
    PyStructSequence_SetItem(record, 0, pool);
    PyStructSequence_SetItem(record, 1, PyBool_FromLong(site->warm_in_pool));
    PyStructSequence_SetItem(record, 2, PyBool_FromLong(site->keep_activations));
    PyStructSequence_SetItem(record, 3, PyBool_FromLong(site->pending));
    PyStructSequence_SetItem(record, 4, PyBool_FromLong(site->asks_again));
    return record;
}

static int
same_pool(cg_pool a, cg_pool b)
{
    return a.first == b.first && a.second == b.second;
}

/* Whether the backward of some graph's latest replay is still to run. */
static int
any_backward_pending(const GraphedObject *self)
{
    for (Py_ssize_t k = 0; k < self->n_entries; k++) {
        if (cg_engine_backward_pending(self->entries[k].engine)) {
            return 1;
        }
    }
    return 0;
}

/* A pool of this callable's graphs that a new graph may share: none of its
 * graphs has a backward pending, and other callables' graphs do not use it.
 * 1 and *out set, or 0. */
static int
idle_pool(const GraphedObject *self, cg_pool *out)
{
    for (Py_ssize_t k = 0; k < self->n_entries; k++) {
        cg_pool pool = self->entries[k].pool;
        if (!(self->has_shared && same_pool(pool, self->shared)) && !cg_pool_busy(pool, 0)) {
            *out = pool;
            return 1;
        }
    }
    return 0;
}

/* Where on_miss captures this call: a layer's pool=, keeping the
 * activations, while the pool lets it (cg_pool_open_to_layers: not in a
 * second pass, which this call starts if a graph of the layer is pending);
 * else a pool of its own idle graphs, warming up there; else a fresh pool.
 * 0, or -1 with an exception set. */
static int
choose_site(GraphedObject *self, int pending, capture_site *site)
{
    *site = (capture_site){.pending = pending};
    if (self->layer &&
        cg_pool_open_to_layers(self->shared, pending || any_backward_pending(self))) {
        site->pool = self->shared;
        site->warm_in_pool = site->keep_activations = 1;
        return 0;
    }
    if (idle_pool(self, &site->pool)) {
        site->warm_in_pool = site->asks_again = 1;
        return 0;
    }
    return cg_new_pool(&site->pool);
}

/* Frees this callable's graphs in `pool`, where none has a backward pending:
 * Note [Warm-up in the pool] in aten_setup.cpp.  0, or -1 with an exception
 * set (nothing freed). */
static int
drop_pool(GraphedObject *self, cg_pool pool)
{
    /* Taken out before any is freed: freeing a spec may run Python. */
    graph_entry *dropped = PyMem_Malloc((size_t)self->n_entries * sizeof(graph_entry));
    Py_ssize_t remaining = 0, n_dropped = 0;

    if (dropped == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < self->n_entries; k++) {
        graph_entry e = self->entries[k];
        if (same_pool(e.pool, pool)) {
            dropped[n_dropped++] = e;
        } else {
            self->entries[remaining++] = e;
        }
    }
    self->n_entries = remaining;
    self->hot = 0;
    for (Py_ssize_t k = 0; k < n_dropped; k++) {
        cg_engine_free(dropped[k].engine);
        Py_XDECREF(dropped[k].spec);
        Py_XDECREF(dropped[k].out.spec);
    }
    PyMem_Free(dropped);
    return 0;
}

/* A NEW reference to a new exception of `exc`'s type, args and .kind,
 * without its traceback and cause, or NULL with an exception set.  The
 * refusal a callable keeps to raise again: the error as raised holds the
 * frames it went through (a model's forward and its activations) in its
 * traceback, and the warm-up's in its cause's, for as long as it is kept;
 * its message already names the cause. */
static PyObject *
bare_copy(PyObject *exc)
{
    PyObject *args = PyObject_GetAttrString(exc, "args");
    PyObject *copy = args ? PyObject_CallObject((PyObject *)Py_TYPE(exc), args) : NULL;
    PyObject *kind = copy ? PyObject_GetAttrString(exc, "kind") : NULL;

    Py_XDECREF(args);
    if (kind == NULL || PyObject_SetAttrString(copy, "kind", kind) < 0) {
        Py_CLEAR(copy);
    }
    Py_XDECREF(kind);
    return copy;
}

/* After on_miss raised for `site`.  If a warm-up left state in the site's
 * pool where earlier graphs write (a CaptureError of CG_FAILURE_WARMUP_STATE:
 * Note [Warm-up in the pool] in aten_setup.cpp): in the pool shared with
 * other callables the state stays, and the error comes back at every later
 * capture (self->refusal); in a pool of this callable's own (site->asks_again,
 * which on_miss reads to know whether this call comes back to it: the FSDP
 * put-back in cgraph/_regraph.py), its graphs there go (captured again when
 * needed) and *site becomes a fresh pool without warm-up.  1 if on_miss may
 * be asked again, else 0 with an exception set. */
static int
recover_from_warm_up(GraphedObject *self, capture_site *site)
{
    PyObject *exc;
    int state_left;

    if (!site->warm_in_pool || !PyErr_ExceptionMatches(self->state->CaptureError)) {
        return 0;
    }
    exc = cg_err_take();
    state_left = cg_capture_error_is(self->state, exc, CG_FAILURE_WARMUP_STATE);
    if (state_left && !site->asks_again) {  /* the pool= shared with other layers */
        PyObject *kept = bare_copy(exc);
        PyErr_Clear();  /* no copy (no memory): the error itself, as raised */
        Py_XSETREF(self->refusal, kept ? kept : Py_NewRef(exc));
    } else if (state_left && !cg_pool_busy(site->pool, 0) && drop_pool(self, site->pool) == 0) {
        Py_DECREF(exc);
        *site = (capture_site){.pending = site->pending};
        return cg_report_event(self->state, "pool_dropped", (PyObject *)self) == 0 &&
               cg_new_pool(&site->pool) == 0;
    }
    cg_err_restore(exc);
    return 0;
}

/* The call's arguments as a Python call passes them: NEW references to a
 * tuple in *positional and a dict in *keywords.  0, or -1 with an exception
 * set (both NULL). */
static int
python_call(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **positional,
            PyObject **keywords)
{
    *positional = PyTuple_New(nargs);
    *keywords = PyDict_New();
    for (Py_ssize_t i = 0; *positional != NULL && i < nargs; i++) {
        PyTuple_SET_ITEM(*positional, i, Py_NewRef(args[i]));
    }
    for (Py_ssize_t i = 0; *keywords != NULL && kwnames != NULL &&
                           i < PyTuple_GET_SIZE(kwnames); i++) {
        if (PyDict_SetItem(*keywords, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
            Py_CLEAR(*keywords);
        }
    }
    if (*positional == NULL || *keywords == NULL) {
        Py_CLEAR(*positional);
        Py_CLEAR(*keywords);
        return -1;
    }
    return 0;
}

/* on_miss's graph for this call at `site`: a NEW reference to the Graphed
 * it captured, or NULL with an exception set. */
static PyObject *
ask_on_miss(GraphedObject *self, PyObject *positional, PyObject *keywords,
            const capture_site *site)
{
    PyObject *on_miss = Py_XNewRef(self->on_miss);  /* reset() drops ours */
    PyObject *record = on_miss ? site_record(self, site) : raise_reset();
    PyObject *captured = record ? PyObject_CallFunctionObjArgs(on_miss, (PyObject *)self,
                                                               positional, keywords, record,
                                                               NULL)
                                : NULL;

    Py_XDECREF(record);
    Py_XDECREF(on_miss);
    return captured;
}

/* Has on_miss capture a graph for this call and takes it as the latest
 * entry (none if reset() ran meanwhile).  0; 1 where on_miss answered None,
 * a call no graph can take that runs eagerly (one carrying a transformers
 * Cache, as generate() passes: cgraph/_regraph.py); or -1 with an exception
 * set. */
static int
capture_for(GraphedObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
            int pending)
{
    PyObject *positional = NULL, *keywords = NULL, *captured = NULL;
    capture_site site;
    int status = -1;

    if (python_call(args, nargs, kwnames, &positional, &keywords) == 0 &&
        choose_site(self, pending, &site) == 0) {
        captured = ask_on_miss(self, positional, keywords, &site);
        if (captured == NULL && recover_from_warm_up(self, &site)) {
            captured = ask_on_miss(self, positional, keywords, &site);
        }
    }
    if (captured == Py_None) {
        status = 1;
    } else if (captured != NULL) {
        status = self->is_reset ? 0 : take_graph(self, captured, "on_miss's result");
    }
    Py_XDECREF(captured);
    Py_XDECREF(positional);
    Py_XDECREF(keywords);
    return status;
}

/* What a call no graph takes comes to. */
typedef enum {
    MISS_ERROR = -1,        /* an exception is set */
    MISS_CAPTURED,          /* a graph for it is the latest entry: look again */
    MISS_EAGER_ON_MISS,     /* runs eagerly, counted in eager_on_miss */
    MISS_EAGER              /* runs eagerly, counted in eager_pending or _past_limit */
} miss_outcome;

/* Calls no graph takes run eagerly once max_graphs are captured; the event
 * hook hears of it once (cgraph/_log.py logs a warning).  0, or -1 with the
 * hook's exception set. */
static int
report_limit(GraphedObject *self, int pending)
{
    if (self->limit_reported) {
        return 0;
    }
    self->limit_reported = 1;
    return cg_report_event(self->state, pending ? "past_max_graphs_pending" : "past_max_graphs",
                           (PyObject *)self);
}

/* Decides a call no graph takes, in the order of Note [Several graphs per
 * callable]: a layer's call inside autograd's backward runs eagerly (no
 * capture runs there); a capture refused for good raises again; past
 * max_graphs the call runs eagerly; else on_miss captures a graph for it,
 * or answers that it runs eagerly. */
static miss_outcome
handle_miss(GraphedObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
            int pending)
{
    if (self->is_reset) {  /* flattening the arguments ran Python */
        raise_reset();
        return MISS_ERROR;
    }
    if (self->layer && cg_in_backward()) {
        return MISS_EAGER_ON_MISS;
    }
    if (self->refusal != NULL) {
        PyObject *fresh = bare_copy(self->refusal);
        if (fresh != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(fresh), fresh);
            Py_DECREF(fresh);
        }
        return MISS_ERROR;
    }
    if (self->n_entries >= self->max_graphs) {
        return report_limit(self, pending) < 0 ? MISS_ERROR : MISS_EAGER;
    }
    switch (capture_for(self, args, nargs, kwnames, pending)) {
    case 0:
        return MISS_CAPTURED;
    case 1:
        return MISS_EAGER_ON_MISS;
    default:
        return MISS_ERROR;
    }
}

/* Runs the call eagerly, as its first graph's spec says (call_eager), or,
 * before the first graph, through `eager`.  Returns a NEW reference, or
 * NULL with an exception set. */
static PyObject *
run_eagerly(GraphedObject *self, PyObject *module, PyObject *const *args, Py_ssize_t nargs,
            PyObject *kwnames)
{
    PyObject *spec, *positional, *keywords, *result = NULL;

    if (self->n_entries > 0) {
        spec = Py_NewRef(self->entries[0].spec);  /* the eager call may reset() us */
        result = call_eager((cg_spec *)spec, module, args, nargs, kwnames);
        Py_DECREF(spec);
        return result;
    }
    if (self->eager == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cgraph: a call was to run eagerly before the callable had a graph, "
                        "with no way to; this is a bug in cgraph, please report it.");
        return NULL;
    }
    if (python_call(args, nargs, kwnames, &positional, &keywords) == 0) {
        result = PyObject_CallFunctionObjArgs(self->eager, positional, keywords, NULL);
        Py_DECREF(positional);
        Py_DECREF(keywords);
    }
    return result;
}

/* The call path of a callable that may have several graphs (Note [Several
 * graphs per callable]).  Returns a NEW reference, or NULL. */
static PyObject *
call_any(GraphedObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *module = NULL, *result = NULL;
    /* One miss: on_miss captures a graph for the call, and the second
     * lookup finds it (if not, the call runs eagerly, counted). */
    int training = 0, attempts = 2;
    miss_outcome outcome = MISS_CAPTURED;
    lookup found = {.index = -1};

    while (outcome == MISS_CAPTURED && attempts-- > 0 && !self->is_reset) {
        /* Pinned: resolve_module runs Python, which may reset() and free
         * the entries (as Graphed_vectorcall pins call_one's). */
        cg_spec *first = self->n_entries ? (cg_spec *)Py_NewRef(self->entries[0].spec) : NULL;
        int stop = 0;

        Py_CLEAR(module);
        if (first != NULL && first->module != Py_None) {
            stop = resolve_module(self, first, &module, &training) < 0 || self->is_reset;
        }
        Py_XDECREF(first);
        if (stop) {
            break;  /* verify() ran Python: reset since? */
        }
        if (find_entry(self, training, args, nargs, kwnames, &found) < 0) {
            break;
        }
        if (found.index >= 0) {
            result = replay_entry(self, found.index, found.tensors, found.nt, 1);
            break;
        }
        outcome = attempts > 0 ? handle_miss(self, args, nargs, kwnames, found.pending)
                               : MISS_EAGER;
    }
    if (self->is_reset && result == NULL && !PyErr_Occurred()) {
        raise_reset();
    } else if (outcome == MISS_EAGER_ON_MISS || outcome == MISS_EAGER) {
        if (outcome == MISS_EAGER) {
            *(found.pending ? &self->eager_pending : &self->eager_past_limit) += 1;
        }
        result = run_eagerly(self, module, args, nargs, kwnames);
        if (outcome == MISS_EAGER_ON_MISS && result != NULL) {
            self->eager_on_miss += 1;  /* counted once it returned */
        }
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
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) == 0) {
        kwnames = NULL;  /* the protocol allows an empty tuple for no keywords */
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
    /* Told before the graphs go, so that the log can say what is freed (and
     * the module graphed gets its own forward back, graphs or none yet); a
     * hook that fails does not keep the memory. */
    if (!self->is_reset && cg_report_event(self->state, "reset", (PyObject *)self) < 0) {
        PyErr_WriteUnraisable((PyObject *)self);
    }
    self->is_reset = 1;
    free_entries(self, 1);  /* and the samples their specs hold */
    Py_CLEAR(self->on_miss);
    Py_CLEAR(self->eager);
    Py_CLEAR(self->refusal);
    Py_RETURN_NONE;
}

static PyMethodDef Graphed_methods[] = {
    {"reset", (PyCFunction)Graphed_reset, METH_NOARGS, Graphed_reset_doc},
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

/* Returns a NEW reference: a list of every graph's CallableSpec, or NULL
 * with an exception set.  Appended, self->entries read again at each: an
 * allocation may run a collection, whose finalizers may reset() this
 * callable (a list sized first would then keep empty slots). */
static PyObject *
Graphed_get_specs(GraphedObject *self, void *closure)
{
    PyObject *specs = PyList_New(0);

    for (Py_ssize_t k = 0; specs != NULL && k < self->n_entries; k++) {
        if (PyList_Append(specs, (PyObject *)self->entries[k].spec) < 0) {
            Py_CLEAR(specs);
        }
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
#define ADD_COUNTER(field, doc) sum.field += one.field;
        CG_STATS_COUNTERS(ADD_COUNTER)
#undef ADD_COUNTER
    }
    return sum;
}

/* Sets dict[name] = value.  0, or -1 with an exception set. */
static int
put_counter(PyObject *dict, const char *name, unsigned long long value)
{
    PyObject *number = PyLong_FromUnsignedLongLong(value);
    int status = number ? PyDict_SetItemString(dict, name, number) : -1;

    Py_XDECREF(number);
    return status;
}

/* Returns a NEW reference: a dict of counters, summed over the graphs, in
 * the order of the docstring (Graphed_stats_doc); NULL with an exception. */
static PyObject *
Graphed_get_stats(GraphedObject *self, void *closure)
{
    cg_stats sum = summed_stats(self);
    PyObject *dict = PyDict_New();

#define PUT_ENGINE_COUNTER(field, doc) put_counter(dict, #field, sum.field) < 0 ||
#define PUT_OWN_COUNTER(field, doc) put_counter(dict, #field, self->field) < 0 ||
    if (dict != NULL &&
        (CG_STATS_COUNTERS(PUT_ENGINE_COUNTER) GRAPHED_COUNTERS(PUT_OWN_COUNTER)
         put_counter(dict, "graphs", (unsigned long long)self->n_entries) < 0)) {
        Py_CLEAR(dict);
    }
#undef PUT_ENGINE_COUNTER
#undef PUT_OWN_COUNTER
    return dict;
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

/* "Linear", "train_step": what the graphs were captured from ("a module
 * no longer alive" once it died: a repr does not raise).  Returns a NEW
 * reference, or NULL with an exception set. */
static PyObject *
callable_name(const cg_spec *spec)
{
    PyObject *target = cg_spec_target(spec), *name;

    if (target == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) {
            return NULL;
        }
        PyErr_Clear();
        return PyUnicode_FromString("a module no longer alive");
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

/* "[(16, 64), (16,)]": the shapes of the tensor arguments of the graph
 * captured from `spec` (borrowed; the tuple of its samples held here: a
 * finalizer run by an allocation may reset the callable and free its
 * entries).  Returns a NEW reference, or NULL with an exception set. */
static PyObject *
entry_shapes(const cg_spec *spec)
{
    PyObject *samples = Py_NewRef(spec->tensors);
    Py_ssize_t n = PyTuple_GET_SIZE(samples);
    PyObject *shapes = PyList_New(n), *text = NULL;

    for (Py_ssize_t i = 0; shapes != NULL && i < n; i++) {
        PyObject *shape = PyObject_GetAttrString(PyTuple_GET_ITEM(samples, i), "shape");
        PyObject *tuple = shape ? PySequence_Tuple(shape) : NULL;
        Py_XDECREF(shape);
        if (tuple == NULL) {
            Py_CLEAR(shapes);
            break;
        }
        PyList_SET_ITEM(shapes, i, tuple);
    }
    Py_DECREF(samples);
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
    PyObject *first, *name, *shapes, *sep, *joined, *result;
    cg_stats stats = summed_stats(self);

    if (self->is_reset) {
        return PyUnicode_FromString("<cgraph.Graphed: reset>");
    }
    if (self->n_entries == 0) {
        return PyUnicode_FromString("<cgraph.Graphed: no graph yet (captures on its first "
                                    "call)>");
    }
    /* Held, and self->entries read again at each step: as Graphed_get_specs. */
    first = Py_NewRef((PyObject *)self->entries[0].spec);
    shapes = PyList_New(0);
    for (Py_ssize_t k = 0; shapes != NULL && k < self->n_entries; k++) {
        PyObject *one = entry_shapes(self->entries[k].spec);
        if (one == NULL || PyList_Append(shapes, one) < 0) {
            Py_CLEAR(shapes);
        }
        Py_XDECREF(one);
    }
    name = shapes ? callable_name((const cg_spec *)first) : NULL;
    Py_DECREF(first);
    sep = name ? PyUnicode_FromString(" ") : NULL;
    joined = sep ? PyUnicode_Join(sep, shapes) : NULL;
    result = joined ? PyUnicode_FromFormat(
        "<cgraph.Graphed of %U: %zd graph%s %U, %llu replays, %llu eager calls, pool (%llu, "
        "%llu)>", name, PyList_GET_SIZE(shapes), PyList_GET_SIZE(shapes) == 1 ? "" : "s", joined,
        stats.forward, self->eager_pending + self->eager_past_limit + self->eager_on_miss,
        self->pool.first,
        self->pool.second) : NULL;
    Py_XDECREF(joined);
    Py_XDECREF(sep);
    Py_XDECREF(name);
    Py_XDECREF(shapes);
    return result;
}

/* Graphed.stats' docstring: a line per counter, from the counters' own docs,
 * so that a new counter is documented where it is declared. */
#define COUNTER_DOC(field, doc) "\n  " #field ": " doc "."
PyDoc_STRVAR(Graphed_stats_doc,
"How often each path ran, summed over the graphs; a dict of counters:"
CG_STATS_COUNTERS(COUNTER_DOC)
GRAPHED_COUNTERS(COUNTER_DOC)
"\n  graphs: forward/backward graph pairs captured (num_graphs).");
#undef COUNTER_DOC

static PyGetSetDef Graphed_getset[] = {
    {"spec", (getter)Graphed_get_spec, NULL,
     "The CallableSpec the first graph was captured from (None before any).", NULL},
    {"specs", (getter)Graphed_get_specs, NULL,
     "The CallableSpec of every graph, in capture order.", NULL},
    {"num_graphs", (getter)Graphed_get_num_graphs, NULL,
     "How many forward/backward graph pairs this callable has captured.", NULL},
    {"stats", (getter)Graphed_get_stats, NULL,
     Graphed_stats_doc, NULL},
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
