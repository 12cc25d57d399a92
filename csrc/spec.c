/*
 * spec.c -- the CallableSpec type: one record per graphed callable, built
 * by keyword in Python and read as a C struct everywhere after.
 *
 * Python equivalent (the contract; the real thing is below):
 *
 *     @dataclass(frozen=True, kw_only=True)
 *     class CallableSpec:
 *         index: int; function: Callable | None; module: weakref.ref | None
 *         eager: Callable | None; eager_takes_module: bool; training: bool
 *         modes: Modes  # (modules: tuple, modes: tuple[bool, ...])
 *         args: tuple; kwargs: dict; kw_names: tuple[str, ...]
 *         tensors: tuple[Tensor, ...]; names: tuple[str, ...]
 *         params: tuple[Tensor, ...]; buffers: tuple[Tensor, ...]
 *         flat: bool; in_spec: TreeSpec | None; walk: tuple[tuple, dict] | None
 *         constants: tuple[Constant, ...]; defaults: tuple[Default, ...]
 *         verify: Callable | None
 *         rng_warmup: tuple[tuple[int, ...], int] | None; device: int
 *
 * Each field is documented once, on cg_spec in module.h; the member table
 * below drives both the constructor and the attributes Python reads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stddef.h>

#include "module.h"

#define SPEC_OBJECT(field, doc) \
    {#field, T_OBJECT_EX, offsetof(cg_spec, field), READONLY, doc}
#define SPEC_BOOL(field, doc) {#field, T_BOOL, offsetof(cg_spec, field), READONLY, doc}

static PyMemberDef spec_members[] = {
    {"index", T_PYSSIZET, offsetof(cg_spec, index), READONLY, "position among the callables"},
    SPEC_OBJECT(function, "what to call, for a function; else None"),
    SPEC_OBJECT(module, "weakref to the nn.Module; else None"),
    SPEC_OBJECT(eager, "the module's forward for eager calls; else None"),
    SPEC_BOOL(eager_takes_module, "eager is unbound: the module is passed first"),
    SPEC_BOOL(training, "module.training at capture"),
    SPEC_OBJECT(modes, "(modules, modes): the submodules reading `training` and their "
                "flags at capture"),
    SPEC_OBJECT(args, "the sample args"),
    SPEC_OBJECT(kwargs, "the sample kwargs, sorted by name"),
    SPEC_OBJECT(kw_names, "the kwargs' names, sorted"),
    SPEC_OBJECT(tensors, "the tensor leaves: the static inputs"),
    SPEC_OBJECT(names, "a name per tensor leaf, for error messages"),
    SPEC_OBJECT(params, "the module's parameters"),
    SPEC_OBJECT(buffers, "the module's buffers"),
    SPEC_BOOL(flat, "args are all tensors and there are no kwargs"),
    SPEC_OBJECT(in_spec, "TreeSpec of (args, kwargs); None if flat"),
    SPEC_OBJECT(walk, "None, or the (args, kwargs) calls are walked beside in C"),
    SPEC_OBJECT(constants, "(position, name, value) per constant leaf, in leaf order"),
    SPEC_OBJECT(defaults, "(name, position, value, by_keyword) per parameter left out"),
    SPEC_OBJECT(verify, "verify(module) raises if parameters were replaced"),
    SPEC_OBJECT(rng_warmup, "(entry offsets, increment) of an eager warm-up run outside "
                "cgraph, or None"),
    {"device", T_INT, offsetof(cg_spec, device), READONLY, "the CUDA device"},
    {NULL, 0, 0, 0, NULL},
};

/* The fields whose type the C code relies on (it indexes them unchecked). */
static const struct {
    const char *name;
    Py_ssize_t offset;
    PyTypeObject *type;
} typed_fields[] = {
    {"args", offsetof(cg_spec, args), &PyTuple_Type},
    {"kwargs", offsetof(cg_spec, kwargs), &PyDict_Type},
    {"kw_names", offsetof(cg_spec, kw_names), &PyTuple_Type},
    {"tensors", offsetof(cg_spec, tensors), &PyTuple_Type},
    {"names", offsetof(cg_spec, names), &PyTuple_Type},
    {"params", offsetof(cg_spec, params), &PyTuple_Type},
    {"buffers", offsetof(cg_spec, buffers), &PyTuple_Type},
    {"constants", offsetof(cg_spec, constants), &PyTuple_Type},
    {"defaults", offsetof(cg_spec, defaults), &PyTuple_Type},
};

static PyObject **
object_field(cg_spec *spec, Py_ssize_t offset)
{
    return (PyObject **)((char *)spec + offset);
}

/* Stores the keyword `value` into the member it names.  0 or -1. */
static int
set_member(cg_spec *spec, const PyMemberDef *member, PyObject *value)
{
    char *at = (char *)spec + member->offset;
    int truth;

    switch (member->type) {
    case T_OBJECT_EX:
        *(PyObject **)at = Py_NewRef(value);
        return 0;
    case T_BOOL:
        truth = PyObject_IsTrue(value);
        *at = (char)(truth > 0);
        return truth < 0 ? -1 : 0;
    case T_INT:
        *(int *)at = (int)PyLong_AsLong(value);
        return PyErr_Occurred() ? -1 : 0;
    default: /* T_PYSSIZET */
        *(Py_ssize_t *)at = PyLong_AsSsize_t(value);
        return PyErr_Occurred() ? -1 : 0;
    }
}

/* 0 if `modes` is a pair of tuples of one length (a Modes), else -1 with a
 * TypeError. */
static int
check_modes(PyObject *modes)
{
    if (!PyTuple_Check(modes) || PyTuple_GET_SIZE(modes) != 2 ||
        !PyTuple_Check(PyTuple_GET_ITEM(modes, CG_MODES_MODULES)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(modes, CG_MODES_FLAGS)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(modes, CG_MODES_MODULES)) !=
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(modes, CG_MODES_FLAGS))) {
        PyErr_SetString(PyExc_TypeError, "CallableSpec.modes must be (modules: tuple, "
                        "modes: tuple), as many of each");
        return -1;
    }
    return 0;
}

/* 0 if the fields the C code indexes have their types and every constant is
 * a (position, name, value) tuple, else -1 with a TypeError. */
static int
check_types(cg_spec *spec)
{
    for (size_t i = 0; i < sizeof(typed_fields) / sizeof(typed_fields[0]); i++) {
        PyObject *value = *object_field(spec, typed_fields[i].offset);
        if (!PyObject_TypeCheck(value, typed_fields[i].type)) {
            PyErr_Format(PyExc_TypeError, "CallableSpec.%s must be a %s, got %s",
                         typed_fields[i].name, typed_fields[i].type->tp_name,
                         Py_TYPE(value)->tp_name);
            return -1;
        }
    }
    if (spec->rng_warmup != Py_None && cg_spec_rng_warmup(spec, NULL, NULL, NULL) < 0) {
        return -1;
    }
    if (check_modes(spec->modes) < 0) {
        return -1;
    }
    if (spec->walk != Py_None &&
        !(PyTuple_CheckExact(spec->walk) && PyTuple_GET_SIZE(spec->walk) == 2 &&
          PyTuple_CheckExact(PyTuple_GET_ITEM(spec->walk, 0)) &&
          PyDict_CheckExact(PyTuple_GET_ITEM(spec->walk, 1)))) {
        PyErr_SetString(PyExc_TypeError, "CallableSpec.walk must be None or (args: tuple, "
                        "kwargs: dict)");
        return -1;
    }
    /* In increasing leaf order: drop_constants and cg_call_from_tensors walk
     * them beside the leaves (arguments.c). */
    for (Py_ssize_t i = 0, last = -1; i < PyTuple_GET_SIZE(spec->constants); i++) {
        PyObject *entry = PyTuple_GET_ITEM(spec->constants, i);
        Py_ssize_t position = -1;
        if (PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 3 &&
            PyLong_Check(PyTuple_GET_ITEM(entry, CG_CONSTANT_POSITION)) &&
            PyUnicode_Check(PyTuple_GET_ITEM(entry, CG_CONSTANT_NAME))) {
            position = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, CG_CONSTANT_POSITION));
        }
        if (position <= last) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "CallableSpec.constants must hold "
                                "(position, name: str, value) tuples, positions increasing");
            }
            return -1;
        }
        last = position;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec->defaults); i++) {
        PyObject *entry = PyTuple_GET_ITEM(spec->defaults, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(entry, CG_DEFAULT_NAME)) ||
            !PyLong_Check(PyTuple_GET_ITEM(entry, CG_DEFAULT_POSITION)) ||
            !PyBool_Check(PyTuple_GET_ITEM(entry, CG_DEFAULT_BY_KEYWORD))) {
            PyErr_SetString(PyExc_TypeError, "CallableSpec.defaults must hold "
                            "(name, position, value, by_keyword) tuples");
            return -1;
        }
    }
    return 0;
}

/* CallableSpec(**fields): every field by keyword, none missing or unknown.
 * Returns a NEW reference, or NULL with an exception set. */
static PyObject *
Spec_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t given = kwargs ? PyDict_GET_SIZE(kwargs) : 0, used = 0;
    cg_spec *spec;

    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "CallableSpec takes keyword arguments only");
        return NULL;
    }
    spec = (cg_spec *)type->tp_alloc(type, 0);
    if (spec == NULL) {
        return NULL;
    }
    for (const PyMemberDef *m = spec_members; m->name != NULL; m++) {
        PyObject *value = kwargs ? PyDict_GetItemString(kwargs, m->name) : NULL;
        if (value == NULL) {
            PyErr_Format(PyExc_TypeError, "CallableSpec: missing field '%s'", m->name);
            goto fail;
        }
        used++;
        if (set_member(spec, m, value) < 0) {
            goto fail;
        }
    }
    if (used != given) {
        PyErr_SetString(PyExc_TypeError, "CallableSpec: unknown field given");
        goto fail;
    }
    if (check_types(spec) < 0) {
        goto fail;
    }
    return (PyObject *)spec;
fail:
    Py_DECREF(spec);
    return NULL;
}

static int
Spec_traverse(cg_spec *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    for (const PyMemberDef *m = spec_members; m->name != NULL; m++) {
        if (m->type == T_OBJECT_EX) {
            Py_VISIT(*object_field(self, m->offset));
        }
    }
    return 0;
}

static int
Spec_clear(cg_spec *self)
{
    for (const PyMemberDef *m = spec_members; m->name != NULL; m++) {
        if (m->type == T_OBJECT_EX) {
            Py_CLEAR(*object_field(self, m->offset));
        }
    }
    return 0;
}

static void
Spec_dealloc(cg_spec *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Spec_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

PyObject *
cg_spec_target(const cg_spec *spec)
{
    PyObject *module = NULL;
    int alive;

    if (spec->module == Py_None) {
        return Py_NewRef(spec->function);
    }
    alive = cg_weakref_get(spec->module, &module);
    if (alive == 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cgraph: the module this graph was captured from no longer "
                        "exists; graph the new module instead.");
    }
    return module;
}

PyObject *
cg_spec_forward(const cg_spec *spec)
{
    PyObject *module = cg_spec_target(spec), *forward;

    if (module == NULL || spec->module == Py_None || !spec->eager_takes_module) {
        if (module != NULL && spec->module != Py_None) {
            Py_SETREF(module, Py_NewRef(spec->eager));
        }
        return module;
    }
    forward = PyMethod_New(spec->eager, module);
    Py_DECREF(module);
    return forward;
}

int
cg_spec_modes_hold(const cg_state *state, const cg_spec *spec)
{
    PyObject *modules = PyTuple_GET_ITEM(spec->modes, CG_MODES_MODULES);

    if (PyTuple_GET_SIZE(modules) == 0) {
        return 1;
    }
    return cg_modes_are(state, modules, PyTuple_GET_ITEM(spec->modes, CG_MODES_FLAGS));
}

static int
rng_warmup_type_error(void)
{
    PyErr_SetString(PyExc_TypeError, "CallableSpec.rng_warmup must be None or a tuple "
                    "(entry offsets: tuple of int >= 0, increment: int >= 0)");
    return -1;
}

int
cg_spec_rng_warmup(const cg_spec *spec, unsigned long long **offsets, Py_ssize_t *count,
                   unsigned long long *increment)
{
    PyObject *entries, *moved;
    unsigned long long *out = NULL;
    Py_ssize_t n;

    if (!PyTuple_Check(spec->rng_warmup) || PyTuple_GET_SIZE(spec->rng_warmup) != 2) {
        return rng_warmup_type_error();
    }
    entries = PyTuple_GET_ITEM(spec->rng_warmup, 0);
    moved = PyTuple_GET_ITEM(spec->rng_warmup, 1);
    if (!PyTuple_Check(entries) || !PyLong_Check(moved)) {
        return rng_warmup_type_error();
    }
    n = PyTuple_GET_SIZE(entries);
    if (offsets != NULL && (out = PyMem_Malloc(sizeof(*out) * (size_t)(n ? n : 1))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyTuple_GET_ITEM(entries, i);
        unsigned long long value =
            PyLong_Check(entry) ? PyLong_AsUnsignedLongLong(entry) : (unsigned long long)-1;
        if (value == (unsigned long long)-1) {
            PyErr_Clear();
            PyMem_Free(out);
            return rng_warmup_type_error();
        }
        if (out != NULL) {
            out[i] = value;
        }
    }
    unsigned long long moved_by = PyLong_AsUnsignedLongLong(moved);
    if (moved_by == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyMem_Free(out);
        return rng_warmup_type_error();
    }
    if (offsets == NULL) {
        return 0;
    }
    *increment = moved_by;
    *offsets = out;
    *count = n;
    return 0;
}

PyDoc_STRVAR(Spec_doc,
"CallableSpec(**fields)\n\n"
"One callable as cgraph.make_graphed_callables describes it to the native\n"
"core: what to call, its sample arguments and their static tensors, its\n"
"parameters, and how later calls are checked.  Built by cgraph._api; the\n"
"Graphed made from it keeps it (Graphed.spec).");

static PyType_Slot spec_slots[] = {
    {Py_tp_new, Spec_new},
    {Py_tp_dealloc, Spec_dealloc},
    {Py_tp_traverse, Spec_traverse},
    {Py_tp_clear, Spec_clear},
    {Py_tp_members, spec_members},
    {Py_tp_doc, (void *)Spec_doc},
    {0, NULL},
};

PyType_Spec cg_spec_type_spec = {
    .name = "cgraph._C.CallableSpec",
    .basicsize = sizeof(cg_spec),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = spec_slots,
};
