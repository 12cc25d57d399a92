/*
 * module.c -- the cgraph._C extension module.
 *
 * Python equivalent of what this module exposes:
 *
 *     class CaptureError(RuntimeError): ...   # a capture failed; says why (.kind)
 *     class Refusal(RuntimeError): ...        # Refusal(message, kind): cgraph's own
 *                                             # refusals, raised from Python hooks
 *     FAILURE_KINDS: tuple[str, ...]  # each kind's CaptureError.kind, by kind
 *     FAILURE_OTHER: int = 0, FAILURE_SYNC: int = 1, ...  # the kinds, as Refusal
 *                                     # takes them (cgraph.h CG_FAILURE_KINDS)
 *     class CallableSpec: ...                 # spec.c
 *     class Graphed: ...                      # graphed.c
 *     class CaptureSite(tuple): ...           # where on_miss captures: graphed.c
 *     def graph_callables(specs, pool, num_warmup_iters, allow_unused_input,
 *                         capture_error_mode, kept_outputs, warm_in_pool,
 *                         keep_activations, what=None): ...  # capture.c
 *     def device_count() -> int: ...
 *     def new_pool() -> tuple[int, int]: ...  # torch.cuda.graph_pool_handle()
 *     def static_output(tensor, pool) -> Tensor | None: ...  # aten_pool.cpp
 *     def autograd_leaves(tensors) -> list[Tensor]: ...      # aten_warmup.cpp
 *     def _call_tensors(spec, *args, **kwargs) -> tuple[list[Tensor], bool]:
 *         ...  # a call's tensor leaves, and whether tree_flatten took them: arguments.c
 *     def rng_get_state(device: int) -> Tensor | None: ...   # aten_rng.cpp
 *     def rng_set_state(state: Tensor, device: int) -> bool: ...
 *     def modules_changed() -> None: ...      # see cg_state.module_epoch
 *     def exiting() -> None: ...   # Note [Resets at exit], aten_reset.cpp
 *     def set_event_hook(hook) -> None: ...   # cgraph/_log.py
 *     def _debug(on=None, fault=None) -> bool: ...  # aten_checks.cpp
 *     def new_graphed(on_miss, max_graphs=1, *, first=None, shared_pool=None,
 *                     layer=False, eager=None, casts=False) -> Graphed: ...
 *         # graphed.c
 *     def call_with_accumulators_here(params, fn, args, kwargs) -> tuple[object, int]:
 *         ...  # fn(*args, **kwargs), the grad accumulators of params on the
 *              # current stream meanwhile: aten_accumulators.cpp
 *     def hold_pool(device, pool) -> object: ...  # a reference to the pool, given
 *         # back when the object goes: Note [A step's warm-up in its pool]
 *     def can_call_in_pool() -> bool: ...  # whether call_in_pool may be used
 *     def call_in_pool(device, pool, fn, args, kwargs) -> object: ...  # fn(*args,
 *         # **kwargs) on the capture stream, allocating from pool: same Note
 *     def lend_memory(tensors, homes) -> None: ...  # each storage pointed at its
 *                                     # home's memory: aten_lend.cpp
 *     def conditional_nodes() -> bool: ...  # aten_conditional.cpp
 *     def call_if(flag, fn, args, kwargs) -> object: ...  # fn(*args, **kwargs),
 *         # what it records replayed only where flag holds: aten_conditional.cpp
 *     def grads_are(params: tuple, grads: tuple) -> bool: ...  # each param's
 *         # grad is the grad (or None) at its place: aten_accumulators.cpp
 *     def param_marks(params: tuple) -> tuple: ...  # (memory, requires_grad)
 *     def params_are(params: tuple, marks: tuple) -> bool: ...  # as marked:
 *         # aten_accumulators.cpp
 *     def modes_are(modules: tuple, modes: tuple) -> bool: ...  # each module's
 *         # training flag is the bool at its place
 *
 * Laid out as CPython's Modules/xxlimited.c: state in the module (multi-phase
 * initialization), heap types, and PyInit__C the only exported symbol.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "module.h"

/* Returns the module's state; never fails for this module. */
static cg_state *
get_state(PyObject *module)
{
    return (cg_state *)PyModule_GetState(module);
}

PyDoc_STRVAR(cgm_device_count_doc,
"device_count() -> int\n\n"
"Number of CUDA devices torch can use; 0 without CUDA.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_device_count(PyObject *module, PyObject *unused)
{
    int count = 0;
    if (cg_cuda_device_count(&count) < 0) {
        return NULL;
    }
    return PyLong_FromLong(count);
}

PyDoc_STRVAR(cgm_new_pool_doc,
"new_pool() -> tuple[int, int]\n\n"
"A fresh graph memory pool handle, like torch.cuda.graph_pool_handle().");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_new_pool(PyObject *module, PyObject *unused)
{
    cg_pool pool;
    if (cg_new_pool(&pool) < 0) {
        return NULL;
    }
    return Py_BuildValue("(KK)", pool.first, pool.second);
}

PyDoc_STRVAR(cgm_static_output_doc,
"static_output(tensor, pool) -> Tensor | None\n\n"
"If `tensor` shows a static output of a live graph of `pool`: a view of that\n"
"output's memory, to capture reading it in place (Note [A layer reading the\n"
"one before it in place] in aten_pool.cpp).  The view does not keep the memory\n"
"allocated; the engine captured with it does (Input::owner).  Else None.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_static_output(PyObject *module, PyObject *args)
{
    PyObject *tensor;
    cg_pool pool;
    if (!PyArg_ParseTuple(args, "O(KK);static_output: expects a tensor and a pool", &tensor,
                          &pool.first, &pool.second)) {
        return NULL;
    }
    return cg_pool_static_output(pool, tensor);
}

PyDoc_STRVAR(cgm_call_tensors_doc,
"_call_tensors(spec, *args, **kwargs) -> (list[Tensor], bool)\n\n"
"The tensor leaves a call of `spec`'s callable replays with (a spec of\n"
"nested or keyword arguments), checked as a graphed call checks them, and\n"
"whether torch's tree_flatten was needed (Note [Arguments walked in C] in\n"
"csrc/arguments.c).  For tests.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_call_tensors(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    cg_state *state = get_state(module);
    unsigned long long flattened = 0;
    PyObject *tensors;
    const cg_spec *spec;
    cg_call call;

    if (nargs < 1 || !PyObject_TypeCheck(args[0], state->Spec_Type) ||
        ((const cg_spec *)args[0])->flat) {
        PyErr_SetString(PyExc_TypeError, "_call_tensors: expects the CallableSpec of "
                        "nested or keyword arguments first");
        return NULL;
    }
    spec = (const cg_spec *)args[0];
    /* What graphed.c's call_tensors runs for such a spec: defaults, then the leaves. */
    if (cg_strip_defaults(spec, args + 1, nargs - 1, kwnames, &call) < 0) {
        return NULL;
    }
    tensors = cg_call_tensors(state, spec, call.args, call.nargs, call.kwnames, &flattened);
    Py_XDECREF(call.owned);
    return tensors ? Py_BuildValue("(NO)", tensors, flattened ? Py_True : Py_False) : NULL;
}

PyDoc_STRVAR(cgm_autograd_leaves_doc,
"autograd_leaves(tensors) -> list[Tensor]\n\n"
"The leaves requiring grad that the autograd graph of `tensors` ends at.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_autograd_leaves(PyObject *module, PyObject *tensors)
{
    return cg_autograd_leaves(tensors);
}

PyDoc_STRVAR(cgm_rng_get_state_doc,
"rng_get_state(device: int) -> Tensor | None\n\n"
"cgraph's answer to torch.cuda.get_rng_state while it warms up or\n"
"captures; None when torch should answer.");

/* When one of cgraph's checks refused (`failure` names it), replaces the
 * pending exception with Refusal(message, kind), so that the capture it
 * interrupts can say why (Note [Capture failures] in capture.c). */
static void
raise_as_refusal(PyObject *module, cg_failure failure)
{
    PyObject *error, *message, *refusal;

    if (failure == CG_FAILURE_OTHER) {
        return;
    }
    error = cg_err_take();
    message = error ? PyObject_Str(error) : NULL;
    refusal = message ? PyObject_CallFunction(get_state(module)->Refusal, "Oi", message,
                                              (int)failure) : NULL;
    if (refusal != NULL) {
        PyException_SetCause(refusal, Py_XNewRef(error));
        cg_err_restore(refusal);
    }
    Py_XDECREF(message);
    Py_XDECREF(error);
}

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_rng_get_state(PyObject *module, PyObject *args)
{
    cg_failure failure = CG_FAILURE_OTHER;
    PyObject *state;
    int device;

    if (!PyArg_ParseTuple(args, "i", &device)) {
        return NULL;
    }
    state = cg_rng_get_state(device, &failure);
    if (state == NULL) {
        raise_as_refusal(module, failure);
    }
    return state;
}

PyDoc_STRVAR(cgm_rng_set_state_doc,
"rng_set_state(state: Tensor, device: int) -> bool\n\n"
"cgraph's handling of torch.cuda.set_rng_state while it warms up or\n"
"captures; False when torch should handle it.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_rng_set_state(PyObject *module, PyObject *args)
{
    cg_failure failure = CG_FAILURE_OTHER;
    PyObject *state;
    int device, handled;

    if (!PyArg_ParseTuple(args, "Oi", &state, &device)) {
        return NULL;
    }
    handled = cg_rng_set_state(state, device, &failure);
    if (handled < 0) {
        raise_as_refusal(module, failure);
        return NULL;
    }
    return PyBool_FromLong(handled);
}

PyDoc_STRVAR(cgm_modules_changed_doc,
"modules_changed() -> None\n\n"
"Called by torch's global module hooks whenever a parameter, buffer or\n"
"submodule is registered anywhere: graphed modules call their check on\n"
"their next call (Note [Which registrations re-check graphed modules]).");

/* Returns a NEW reference (None). */
static PyObject *
cgm_modules_changed(PyObject *module, PyObject *unused)
{
    get_state(module)->module_epoch++;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cgm_exiting_doc,
"exiting() -> None\n\n"
"Called by cgraph's atexit hook before it resets every graph: from then on a\n"
"reset frees graphs only (Note [Resets at exit] in csrc/aten_reset.cpp).");

/* Returns a NEW reference (None). */
static PyObject *
cgm_exiting(PyObject *module, PyObject *unused)
{
    cg_exiting();
    Py_RETURN_NONE;
}

int
cg_report_event(cg_state *state, const char *event, PyObject *graphed)
{
    PyObject *hook, *result;

    if (state->event_hook == NULL || state->event_hook == Py_None) {
        return 0;
    }
    hook = Py_NewRef(state->event_hook);  /* the hook may replace itself while it runs */
    result = PyObject_CallFunction(hook, "sO", event, graphed);
    Py_DECREF(hook);
    Py_XDECREF(result);
    return result ? 0 : -1;
}

PyDoc_STRVAR(cgm_debug_doc,
"_debug(on=None, fault=None) -> bool\n\n"
"Whether cgraph's debug checks run (Note [Checked invariants] in\n"
"aten_checks.cpp; CGRAPH_DEBUG=1 at import turns them on).  With `on`, turns\n"
"them on or off first and plants `fault` (a test's only).  Not a public API.");

/* Returns a NEW reference (a bool), or NULL with an exception set. */
static PyObject *
cgm_debug(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"on", "fault", NULL};
    PyObject *on = Py_None;
    const char *fault = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|Oz:_debug", keywords, &on, &fault)) {
        return NULL;
    }
    if (on != Py_None) {
        int truth = PyObject_IsTrue(on);
        if (truth < 0 || cg_set_debug(truth, fault) < 0) {
            return NULL;
        }
    }
    return PyBool_FromLong(cg_debug());
}

PyDoc_STRVAR(cgm_set_event_hook_doc,
"set_event_hook(hook) -> None\n\n"
"hook(event: str, graphed) is told what a graphed callable did that its caller\n"
"may want to know (cgraph/_log.py logs it); None removes it.");

/* Returns a NEW reference (None). */
static PyObject *
cgm_set_event_hook(PyObject *module, PyObject *hook)
{
    if (hook != Py_None && !PyCallable_Check(hook)) {
        PyErr_SetString(PyExc_TypeError, "set_event_hook: hook must be callable or None");
        return NULL;
    }
    Py_XSETREF(get_state(module)->event_hook, Py_NewRef(hook));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cgm_graph_callables_doc,
"graph_callables(specs, pool, num_warmup_iters, allow_unused_input,\n"
"                capture_error_mode, kept_outputs, warm_in_pool, keep_activations,\n"
"                what=None)\n"
"    -> tuple[Graphed, ...]\n\n"
"Warm up, then capture forward graphs 1..N and backward graphs N..1 into\n"
"one memory pool.  Called by cgraph._capture.graph, which builds `specs`\n"
"(CallableSpec); `what` names the callable in capture errors (\"the training\n"
"step\").  keep_activations: Note [Layers captured one by one into one pool]\n"
"in aten_pool.cpp.  Not a public API.");

PyDoc_STRVAR(cgm_new_graphed_doc,
"new_graphed(on_miss, max_graphs=1, *, first=None, shared_pool=None,\n"
"            layer=False, eager=None, casts=False) -> Graphed\n\n"
"A graphed callable that captures a graph for each call its graphs do not\n"
"take, up to max_graphs: on_miss(graphed, args, kwargs, site) captures it\n"
"where `site` (a CaptureSite) says and returns it, a Graphed with one graph.\n"
"Its first graph is that of `first` (a Graphed graph_callables made), or is\n"
"captured on its first call.  shared_pool: the pool its first graph shares\n"
"with other callables' graphs, which later graphs stay out of; with layer,\n"
"the pool= of a layer graphed one by one (cgraph/_group.py), which captures\n"
"there while it may.  eager(args, kwargs) runs a call eagerly before the\n"
"first graph.  casts: a call of another floating dtype is cast into a graph\n"
"that takes it otherwise, as torch's drop-in does (else it gets its own).\n"
"Note [Several graphs per callable] in graphed.c.  Not a public API.");

PyDoc_STRVAR(cgm_call_with_accumulators_here_doc,
"call_with_accumulators_here(params, fn, args, kwargs) -> tuple[object, int]\n\n"
"(fn(*args, **kwargs), n): while fn runs, the live grad accumulators of the\n"
"tensors `params` (n of them) run on the current stream, hooks and all, then\n"
"get their own streams back.  Note [DDP inside a graphed step] in\n"
"cgraph/_ddp.py says why.  Not a public API.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_call_with_accumulators_here(PyObject *module, PyObject *args)
{
    PyObject *params, *fn, *call_args, *call_kwargs, *result;
    cg_moved_accumulators *moved;
    Py_ssize_t count = 0;

    if (!PyArg_ParseTuple(args, "OOO!O!", &params, &fn, &PyTuple_Type, &call_args,
                          &PyDict_Type, &call_kwargs)) {
        return NULL;
    }
    moved = cg_accumulators_move(params, &count);
    if (moved == NULL) {
        return NULL;
    }
    result = PyObject_Call(fn, call_args, call_kwargs);
    cg_accumulators_restore(moved);
    if (result == NULL) {
        return NULL;
    }
    return Py_BuildValue("(Nn)", result, count);
}

/* The reference hold_pool took, for the capsule that owns it. */
typedef struct {
    int device;
    cg_pool pool;
} pool_hold;

static const char pool_hold_name[] = "cgraph._C.pool_hold";

/* The capsule's destructor: gives the reference back. */
static void
release_pool_hold(PyObject *capsule)
{
    pool_hold *hold = PyCapsule_GetPointer(capsule, pool_hold_name);
    if (hold != NULL) {
        cg_pool_release(hold->device, hold->pool);
        PyMem_Free(hold);
    }
}

PyDoc_STRVAR(cgm_hold_pool_doc,
"hold_pool(device, pool) -> object\n\n"
"Takes a reference to the graph memory pool `pool` on `device`, making it if\n"
"it is new: the pool and what is allocated from it live, though no graph\n"
"holds the pool yet, until the returned object goes.  Note [A step's warm-up\n"
"in its pool] in aten_setup.cpp says why.  Not a public API.");

/* Returns a NEW reference (a capsule), or NULL with an exception set. */
static PyObject *
cgm_hold_pool(PyObject *module, PyObject *args)
{
    pool_hold *hold = PyMem_Malloc(sizeof *hold);
    PyObject *capsule;

    if (hold == NULL) {
        return PyErr_NoMemory();
    }
    if (!PyArg_ParseTuple(args, "i(KK):hold_pool", &hold->device, &hold->pool.first,
                          &hold->pool.second) ||
        cg_pool_hold(hold->device, hold->pool) < 0) {
        PyMem_Free(hold);
        return NULL;
    }
    capsule = PyCapsule_New(hold, pool_hold_name, release_pool_hold);
    if (capsule == NULL) {
        cg_pool_release(hold->device, hold->pool);
        PyMem_Free(hold);
    }
    return capsule;
}

PyDoc_STRVAR(cgm_can_call_in_pool_doc,
"can_call_in_pool() -> bool\n\n"
"Whether call_in_pool may be used: torch's native allocator, without\n"
"expandable segments (Note [A step's warm-up in its pool] in\n"
"aten_setup.cpp says why).  Not a public API.");

/* Returns a NEW reference to a bool, or NULL with an exception set. */
static PyObject *
cgm_can_call_in_pool(PyObject *module, PyObject *unused)
{
    int can = 0;
    if (cg_can_allocate_all_from_a_pool(&can) < 0) {
        return NULL;
    }
    return PyBool_FromLong(can);
}

PyDoc_STRVAR(cgm_call_in_pool_doc,
"call_in_pool(device, pool, fn, args, kwargs) -> object\n\n"
"fn(*args, **kwargs) as a capture would run it, without capturing: after the\n"
"device's work, on the capture stream, every allocation on the device but the\n"
"caller's and the legacy stream's coming from `pool` (which must be held:\n"
"hold_pool); the caller's stream is current again after the device's work.\n"
"For a training step's warm-up: Note [A step's warm-up in its pool] in\n"
"aten_setup.cpp.  Not a public API.");

/* Returns a NEW reference (fn's result), or NULL with an exception set. */
static PyObject *
cgm_call_in_pool(PyObject *module, PyObject *args)
{
    PyObject *fn, *call_args, *call_kwargs, *result = NULL;
    cg_pool pool;
    cg_setup *setup;
    int device;

    if (!PyArg_ParseTuple(args, "i(KK)OO!O!:call_in_pool", &device, &pool.first, &pool.second,
                          &fn, &PyTuple_Type, &call_args, &PyDict_Type, &call_kwargs)) {
        return NULL;
    }
    setup = cg_setup_begin(device);
    if (setup == NULL) {
        return NULL;
    }
    if (cg_setup_allocate_all_from(setup, pool) == 0) {
        result = PyObject_Call(fn, call_args, call_kwargs);
    }
    cg_setup_end(setup);
    return result;
}

PyDoc_STRVAR(cgm_grads_are_doc,
"grads_are(params, grads) -> bool\n\n"
"Whether each tensor of the tuple `params` has as its grad the tensor at the\n"
"same place of the tuple `grads` (None: no grad).  Note [Grads around a\n"
"graphed step] in cgraph/_step_grads.py.  Not a public API.");

/* The two tuples a comparison before or after each replay of a graphed
 * step takes (grads_are, params_are, modes_are), as borrowed references in
 * *first and *second: 0, or -1 with an exception set.  METH_FASTCALL: these
 * run several times per replay, where building an argument tuple and
 * parsing a format string would cost more than the comparison of a small
 * model's parameters. */
static int
two_tuples(PyObject *const *args, Py_ssize_t nargs, const char *name, PyObject **first,
           PyObject **second)
{
    if (nargs != 2 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "cgraph: %s takes two tuples", name);
        return -1;
    }
    *first = args[0];
    *second = args[1];
    return 0;
}

/* `compare` (1 same, 0 not, -1 with an exception set) of the call's two
 * tuples, as a NEW reference to a bool, or NULL with an exception set. */
static PyObject *
compared(PyObject *const *args, Py_ssize_t nargs, const char *name,
         int (*compare)(PyObject *, PyObject *))
{
    PyObject *first, *second;
    int same;

    if (two_tuples(args, nargs, name, &first, &second) < 0) {
        return NULL;
    }
    same = compare(first, second);
    return same < 0 ? NULL : PyBool_FromLong(same);
}

/* Returns a NEW reference to a bool, or NULL with an exception set. */
static PyObject *
cgm_grads_are(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return compared(args, nargs, "grads_are", cg_grads_are);
}

PyDoc_STRVAR(cgm_param_marks_doc,
"param_marks(params) -> tuple\n\n"
"Per tensor of the tuple `params`: (the address of the memory its kernels\n"
"read, a DTensor's local shard's; whether it requires grad).  Note [What a\n"
"graphed step checks before a replay] in cgraph/_step_checks.py.  Not a public\n"
"API.");

/* Returns a NEW reference to a tuple, or NULL with an exception set. */
static PyObject *
cgm_param_marks(PyObject *module, PyObject *params)
{
    if (!PyTuple_Check(params)) {
        PyErr_SetString(PyExc_TypeError, "cgraph: param_marks takes a tuple of tensors");
        return NULL;
    }
    return cg_param_marks(params);
}

PyDoc_STRVAR(cgm_params_are_doc,
"params_are(params, marks) -> bool\n\n"
"Whether each tensor of the tuple `params` still has the mark param_marks\n"
"gave it.  Not a public API.");

/* Returns a NEW reference to a bool, or NULL with an exception set. */
static PyObject *
cgm_params_are(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return compared(args, nargs, "params_are", cg_params_are);
}

PyDoc_STRVAR(cgm_modes_are_doc,
"modes_are(modules, modes) -> bool\n\n"
"Whether each module of the tuple `modules` has as its `training` flag the\n"
"bool at the same place of the tuple `modes`.  Note [What a graphed step\n"
"checks before a replay] in cgraph/_step_checks.py.  Not a public API.");

/* nn.Module keeps the flag in the instance dict (Module.__init__ sets it
 * there; no class of torch's defines it): read there, a dict lookup by an
 * interned name, rather than through the attribute protocol, which first
 * walks the class's MRO (about 39 ns against 16 on the CI machine, for
 * every module a graph compares on every call). */
PyObject *
cg_training_of(const cg_state *state, PyObject *module)
{
    PyObject *dict = PyObject_GenericGetDict(module, NULL);
    PyObject *flag = dict != NULL ? PyDict_GetItemWithError(dict, state->str_training) : NULL;

    Py_XDECREF(dict);  /* the module keeps it */
    if (flag != NULL) {
        return Py_NewRef(flag);
    }
    PyErr_Clear();  /* no instance dict, or no flag in it: ask the object */
    return PyObject_GetAttr(module, state->str_training);
}

int
cg_modes_are(const cg_state *state, PyObject *modules, PyObject *modes)
{
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(modules); k++) {
        PyObject *flag = cg_training_of(state, PyTuple_GET_ITEM(modules, k));
        int same;

        if (flag == NULL) {
            return -1;
        }
        same = flag == PyTuple_GET_ITEM(modes, k);
        Py_DECREF(flag);
        if (!same) {
            return 0;
        }
    }
    return 1;
}

/* Returns a NEW reference to a bool, or NULL with an exception set. */
static PyObject *
cgm_modes_are(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *modules, *modes;
    int same;

    if (two_tuples(args, nargs, "modes_are", &modules, &modes) < 0) {
        return NULL;
    }
    if (PyTuple_GET_SIZE(modes) != PyTuple_GET_SIZE(modules)) {
        PyErr_Format(PyExc_ValueError, "cgraph: modes_are: %zd modules but %zd modes",
                     PyTuple_GET_SIZE(modules), PyTuple_GET_SIZE(modes));
        return NULL;
    }
    same = cg_modes_are(get_state(module), modules, modes);
    return same < 0 ? NULL : PyBool_FromLong(same);
}

PyDoc_STRVAR(cgm_lend_memory_doc,
"lend_memory(tensors, homes) -> None\n\n"
"Points the storage of each tensor at the memory of its home (same\n"
"position, as many bytes), which the storage keeps alive until it is\n"
"resized or lent again.  Note [FSDP2's unsharded parameters in per-layer\n"
"graphs] in cgraph/_fsdp.py says why.  Not a public API.");

/* Returns a NEW reference (None), or NULL with an exception set. */
static PyObject *
cgm_lend_memory(PyObject *module, PyObject *args)
{
    PyObject *tensors, *homes;

    if (!PyArg_ParseTuple(args, "OO:lend_memory", &tensors, &homes)) {
        return NULL;
    }
    if (cg_lend_memory(tensors, homes) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cgm_conditional_nodes_doc,
"conditional_nodes() -> bool\n\n"
"Whether captures can hold conditional nodes (cgraph built with CUDA 12.4 or\n"
"later, and a driver as new), which call_if needs.  Not a public API.");

/* Returns a NEW reference to a bool; never fails. */
static PyObject *
cgm_conditional_nodes(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(cg_conditional_nodes());
}

PyDoc_STRVAR(cgm_call_if_doc,
"call_if(flag, fn, args, kwargs) -> object\n\n"
"fn(*args, **kwargs), called while cgraph captures on the current stream:\n"
"what it records runs at a replay only where `flag` (one bool CUDA tensor)\n"
"is true then.  Note [Conditional regions] in csrc/aten_conditional.cpp\n"
"says how; Note [GradScaler with any optimizer] in cgraph/_step.py why.\n"
"Not a public API.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_call_if(PyObject *module, PyObject *args)
{
    PyObject *flag, *fn, *call_args, *call_kwargs, *result;
    cg_if_region *region;

    if (!PyArg_ParseTuple(args, "OOO!O!:call_if", &flag, &fn, &PyTuple_Type, &call_args,
                          &PyDict_Type, &call_kwargs)) {
        return NULL;
    }
    region = cg_if_begin(flag);
    if (region == NULL) {
        return NULL;
    }
    result = PyObject_Call(fn, call_args, call_kwargs);
    if (cg_if_end(region, result != NULL) < 0) {
        Py_CLEAR(result);
    }
    return result;
}

static PyMethodDef cgm_methods[] = {
    {"new_graphed", (PyCFunction)(void (*)(void))cg_new_graphed, METH_VARARGS | METH_KEYWORDS,
     cgm_new_graphed_doc},
    {"graph_callables", cg_graph_callables, METH_VARARGS, cgm_graph_callables_doc},
    {"device_count", cgm_device_count, METH_NOARGS, cgm_device_count_doc},
    {"new_pool", cgm_new_pool, METH_NOARGS, cgm_new_pool_doc},
    {"static_output", cgm_static_output, METH_VARARGS, cgm_static_output_doc},
    {"autograd_leaves", cgm_autograd_leaves, METH_O, cgm_autograd_leaves_doc},
    {"_call_tensors", (PyCFunction)(void (*)(void))cgm_call_tensors,
     METH_FASTCALL | METH_KEYWORDS, cgm_call_tensors_doc},
    {"rng_get_state", cgm_rng_get_state, METH_VARARGS, cgm_rng_get_state_doc},
    {"rng_set_state", cgm_rng_set_state, METH_VARARGS, cgm_rng_set_state_doc},
    {"modules_changed", cgm_modules_changed, METH_NOARGS, cgm_modules_changed_doc},
    {"exiting", cgm_exiting, METH_NOARGS, cgm_exiting_doc},
    {"set_event_hook", cgm_set_event_hook, METH_O, cgm_set_event_hook_doc},
    {"_debug", (PyCFunction)(void (*)(void))cgm_debug, METH_VARARGS | METH_KEYWORDS,
     cgm_debug_doc},
    {"call_with_accumulators_here", cgm_call_with_accumulators_here, METH_VARARGS,
     cgm_call_with_accumulators_here_doc},
    {"hold_pool", cgm_hold_pool, METH_VARARGS, cgm_hold_pool_doc},
    {"can_call_in_pool", cgm_can_call_in_pool, METH_NOARGS, cgm_can_call_in_pool_doc},
    {"call_in_pool", cgm_call_in_pool, METH_VARARGS, cgm_call_in_pool_doc},
    {"lend_memory", cgm_lend_memory, METH_VARARGS, cgm_lend_memory_doc},
    {"conditional_nodes", cgm_conditional_nodes, METH_NOARGS, cgm_conditional_nodes_doc},
    {"call_if", cgm_call_if, METH_VARARGS, cgm_call_if_doc},
    {"grads_are", (PyCFunction)(void (*)(void))cgm_grads_are, METH_FASTCALL,
     cgm_grads_are_doc},
    {"param_marks", cgm_param_marks, METH_O, cgm_param_marks_doc},
    {"params_are", (PyCFunction)(void (*)(void))cgm_params_are, METH_FASTCALL,
     cgm_params_are_doc},
    {"modes_are", (PyCFunction)(void (*)(void))cgm_modes_are, METH_FASTCALL,
     cgm_modes_are_doc},
    {NULL, NULL, 0, NULL}
};

/* Adds a heap type made from `spec` to the module; stores a NEW reference
 * in *out.  0 or -1. */
static int
add_type(PyObject *module, PyType_Spec *spec, PyTypeObject **out)
{
    *out = (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, NULL);
    if (*out == NULL) {
        return -1;
    }
    return PyModule_AddType(module, *out);
}

/* Adds a new exception class `cgraph.<name>`; stores a NEW reference.  0 or -1. */
static int
add_exception(PyObject *module, const char *name, const char *doc, PyObject **out)
{
    *out = PyErr_NewExceptionWithDoc(name, doc, PyExc_RuntimeError, NULL);
    if (*out == NULL) {
        return -1;
    }
    return PyModule_AddObjectRef(module, strrchr(name, '.') + 1, *out);
}

/* The torch objects the C half calls.  0 or -1. */
static int
import_torch_helpers(cg_state *state)
{
    PyObject *pytree = PyImport_ImportModule("torch.utils._pytree");

    if (pytree == NULL) {
        return -1;
    }
    state->tree_flatten = PyObject_GetAttrString(pytree, "tree_flatten");
    state->tree_unflatten = PyObject_GetAttrString(pytree, "tree_unflatten");
    Py_DECREF(pytree);
    if (state->tree_flatten == NULL || state->tree_unflatten == NULL) {
        return -1;
    }
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) {
        return -1;
    }
    state->Tensor_Type = (PyTypeObject *)PyObject_GetAttrString(torch, "Tensor");
    if (state->Tensor_Type != NULL) {
        state->OutOfMemoryError = PyObject_GetAttrString(torch, "OutOfMemoryError");
        if (state->OutOfMemoryError == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            state->OutOfMemoryError = Py_NewRef(Py_None);
        }
    }
    Py_DECREF(torch);
    if (state->Tensor_Type != NULL && !PyType_Check(state->Tensor_Type)) {
        Py_CLEAR(state->Tensor_Type);
        PyErr_SetString(PyExc_ImportError, "cgraph: torch.Tensor is not a type");
    }
    return state->Tensor_Type && state->OutOfMemoryError ? 0 : -1;
}

static int
cgm_exec(PyObject *module)
{
    cg_state *state = get_state(module);

    state->module_epoch = 1;
    if (add_type(module, &cg_spec_type_spec, &state->Spec_Type) < 0 ||
        add_type(module, &cg_graphed_type_spec, &state->Graphed_Type) < 0) {
        return -1;
    }
    state->CaptureSite_Type = cg_capture_site_type();
    if (state->CaptureSite_Type == NULL ||
        PyModule_AddType(module, state->CaptureSite_Type) < 0) {
        return -1;
    }
    if (add_exception(module, "cgraph.CaptureError",
                      "A CUDA graph capture failed.  The message names the callable, the\n"
                      "likely cause and the fix; .kind names the cause ('sync',\n"
                      "'legacy_stream', ...); __cause__ holds torch's original error.",
                      &state->CaptureError) < 0 ||
        add_exception(module, "cgraph._C.Refusal",
                      "Refusal(message, kind): one of cgraph's own checks refused what\n"
                      "a callable did during capture (internal; becomes CaptureError).",
                      &state->Refusal) < 0) {
        return -1;
    }
    if (cg_add_failure_kinds(module) < 0) {
        return -1;
    }
    state->str_training = PyUnicode_InternFromString("training");
    state->str_error_code = PyUnicode_InternFromString("error_code");
    if (state->str_training == NULL || state->str_error_code == NULL) {
        return -1;
    }
    return import_torch_helpers(state);
}

static int
cgm_traverse(PyObject *module, visitproc visit, void *arg)
{
    cg_state *state = get_state(module);
    Py_VISIT(state->CaptureError);
    Py_VISIT(state->Refusal);
    Py_VISIT(state->Spec_Type);
    Py_VISIT(state->Graphed_Type);
    Py_VISIT(state->CaptureSite_Type);
    Py_VISIT(state->tree_flatten);
    Py_VISIT(state->tree_unflatten);
    Py_VISIT(state->Tensor_Type);
    Py_VISIT(state->OutOfMemoryError);
    Py_VISIT(state->event_hook);
    return 0;
}

static int
cgm_clear(PyObject *module)
{
    cg_state *state = get_state(module);
    Py_CLEAR(state->CaptureError);
    Py_CLEAR(state->Refusal);
    Py_CLEAR(state->Spec_Type);
    Py_CLEAR(state->Graphed_Type);
    Py_CLEAR(state->CaptureSite_Type);
    Py_CLEAR(state->tree_flatten);
    Py_CLEAR(state->tree_unflatten);
    Py_CLEAR(state->Tensor_Type);
    Py_CLEAR(state->OutOfMemoryError);
    Py_CLEAR(state->str_training);
    Py_CLEAR(state->str_error_code);
    Py_CLEAR(state->event_hook);
    return 0;
}

static void
cgm_free(void *module)
{
    cgm_clear((PyObject *)module);
}

static PyModuleDef_Slot cgm_slots[] = {
    {Py_mod_exec, cgm_exec},
    {0, NULL}
};

static struct PyModuleDef cgm_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cgraph._C",
    .m_doc = "cgraph's native core: CUDA graph capture and replay for PyTorch callables.",
    .m_size = sizeof(cg_state),
    .m_methods = cgm_methods,
    .m_slots = cgm_slots,
    .m_traverse = cgm_traverse,
    .m_clear = cgm_clear,
    .m_free = cgm_free,
};

/* The only exported symbol (hidden visibility elsewhere; csrc/exports.map). */
PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&cgm_module);
}
