/*
 * module.c -- the cgraph._C extension module.
 *
 * Python equivalent of what this module exposes:
 *
 *     class CaptureError(RuntimeError): ...   # a capture failed; says why
 *     class Graphed: ...                      # graphed.c
 *     def graph_callables(specs, device, pool, num_warmup_iters,
 *                         allow_unused_input, capture_error_mode,
 *                         guard_outputs): ...
 *                                              # capture.c
 *     def device_count() -> int: ...
 *     def new_pool() -> tuple[int, int]: ...  # torch.cuda.graph_pool_handle()
 *     def rng_get_state(device: int) -> Tensor | None: ...   # aten_rng.cpp
 *     def rng_set_state(state: Tensor, device: int) -> bool: ...
 *     def modules_changed() -> None: ...      # see cgm.module_epoch
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "module.h"

cgm_state cgm;

PyDoc_STRVAR(cgm_device_count_doc,
"device_count() -> int\n\n"
"Number of CUDA devices torch can use; 0 without CUDA.");

/* Returns a NEW reference. */
static PyObject *
cgm_device_count(PyObject *self, PyObject *unused)
{
    return PyLong_FromLong(cg_cuda_device_count());
}

PyDoc_STRVAR(cgm_new_pool_doc,
"new_pool() -> tuple[int, int]\n\n"
"A fresh graph memory pool handle, like torch.cuda.graph_pool_handle().");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_new_pool(PyObject *self, PyObject *unused)
{
    cg_pool pool;
    if (cg_new_pool(&pool) < 0) {
        return NULL;
    }
    return Py_BuildValue("(KK)", pool.first, pool.second);
}

PyDoc_STRVAR(cgm_rng_get_state_doc,
"rng_get_state(device: int) -> Tensor | None\n\n"
"cgraph's answer to torch.cuda.get_rng_state while it warms up or\n"
"captures; None when torch should answer.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_rng_get_state(PyObject *self, PyObject *args)
{
    int device;

    if (!PyArg_ParseTuple(args, "i", &device)) {
        return NULL;
    }
    return cg_rng_get_state(device);
}

PyDoc_STRVAR(cgm_rng_set_state_doc,
"rng_set_state(state: Tensor, device: int) -> bool\n\n"
"cgraph's handling of torch.cuda.set_rng_state while it warms up or\n"
"captures; False when torch should handle it.");

/* Returns a NEW reference, or NULL with an exception set. */
static PyObject *
cgm_rng_set_state(PyObject *self, PyObject *args)
{
    PyObject *state;
    int device, handled;

    if (!PyArg_ParseTuple(args, "Oi", &state, &device)) {
        return NULL;
    }
    handled = cg_rng_set_state(state, device);
    return handled < 0 ? NULL : PyBool_FromLong(handled);
}

PyDoc_STRVAR(cgm_modules_changed_doc,
"modules_changed() -> None\n\n"
"Called by torch's global module hooks whenever a parameter, buffer or\n"
"submodule is registered anywhere: graphed modules re-check theirs.");

/* Returns a NEW reference (None). */
static PyObject *
cgm_modules_changed(PyObject *self, PyObject *unused)
{
    cgm.module_epoch++;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cgm_graph_callables_doc,
"graph_callables(specs, device, pool, num_warmup_iters, allow_unused_input,\n"
"                capture_error_mode, guard_outputs) -> tuple[Graphed, ...]\n\n"
"Warm up, then capture forward graphs 1..N and backward graphs N..1 into\n"
"one memory pool.  Called by cgraph.make_graphed_callables, which builds\n"
"`specs`; not a public API.");

static PyMethodDef cgm_methods[] = {
    {"graph_callables", cg_graph_callables, METH_VARARGS, cgm_graph_callables_doc},
    {"device_count", cgm_device_count, METH_NOARGS, cgm_device_count_doc},
    {"new_pool", cgm_new_pool, METH_NOARGS, cgm_new_pool_doc},
    {"rng_get_state", cgm_rng_get_state, METH_VARARGS, cgm_rng_get_state_doc},
    {"rng_set_state", cgm_rng_set_state, METH_VARARGS, cgm_rng_set_state_doc},
    {"modules_changed", cgm_modules_changed, METH_NOARGS, cgm_modules_changed_doc},
    {NULL, NULL, 0, NULL}
};

static int
cgm_exec(PyObject *module)
{
    PyObject *pytree = NULL;

    if (PyType_Ready(&Graphed_Type) < 0) {
        return -1;
    }
    if (PyModule_AddObjectRef(module, "Graphed", (PyObject *)&Graphed_Type) < 0) {
        return -1;
    }
    cgm.CaptureError = PyErr_NewExceptionWithDoc(
        "cgraph.CaptureError",
        "A CUDA graph capture failed.  The message names the callable, the\n"
        "likely cause and the fix; __cause__ holds torch's original error.",
        PyExc_RuntimeError, NULL);
    if (cgm.CaptureError == NULL ||
        PyModule_AddObjectRef(module, "CaptureError", cgm.CaptureError) < 0) {
        return -1;
    }
    pytree = PyImport_ImportModule("torch.utils._pytree");
    if (pytree == NULL) {
        return -1;
    }
    cgm.tree_flatten = PyObject_GetAttrString(pytree, "tree_flatten");
    cgm.tree_unflatten = PyObject_GetAttrString(pytree, "tree_unflatten");
    Py_DECREF(pytree);
    cgm.module_epoch = 1;
    cgm.str_training = PyUnicode_InternFromString("training");
    if (cgm.tree_flatten == NULL || cgm.tree_unflatten == NULL ||
        cgm.str_training == NULL) {
        return -1;
    }
    return 0;
}

static struct PyModuleDef cgm_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cgraph._C",
    .m_doc = "cgraph's native core: CUDA graph capture and replay for PyTorch callables.",
    .m_size = -1,
    .m_methods = cgm_methods,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    PyObject *module = PyModule_Create(&cgm_module);
    if (module == NULL) {
        return NULL;
    }
    if (cgm_exec(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
