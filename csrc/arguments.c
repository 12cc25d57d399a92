/*
 * arguments.c -- the arguments of a call that is not a flat tuple of tensors:
 * keywords, nested containers and constants, checked against what was
 * captured, down to the tensor leaves the engine replays with.
 *
 * Python equivalent (the contract; the real thing is below):
 *
 *     def call_tensors(spec, args, kwargs):
 *         if sorted(kwargs) != list(spec.kw_names): raise TypeError(...)
 *         kwargs = {k: kwargs[k] for k in spec.kw_names}   # captured order
 *         leaves, in_spec = tree_flatten((args, kwargs))
 *         if in_spec != spec.in_spec: raise TypeError(...)
 *         for position, name, value in spec.constants:
 *             if type(leaves[position]) is not type(value) or leaves[position] != value:
 *                 raise ValueError(...)
 *         return [leaf for i, leaf in enumerate(leaves) if i not in constant positions]
 *
 *     (Calls structured as the samples were skip tree_flatten: Note
 *     [Arguments walked in C].)
 *
 *     def call_from_tensors(spec, tensors):    # the inverse, for captures
 *         leaves = tensors with each constant's value put back at its position
 *         return tree_unflatten(leaves, spec.in_spec)           # (args, kwargs)
 *
 *     def strip_defaults(spec, args, kwargs):   # first, for any call but the fast one
 *         for position, name in extra positional and keyword arguments:
 *             default = spec.defaults[that parameter]    # else TypeError
 *             if value is not default (None by identity; else type and ==):
 *                 raise ValueError(...)
 *         return args and kwargs without them
 *
 * The flat fast path (graphed.c: a flat tuple of tensors, as captured) never
 * comes here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>

#include "module.h"

/* 0 if the call passes exactly the captured keywords, else -1 with a
 * TypeError naming a missing or an unexpected one. */
static int
check_keywords(const cg_spec *spec, PyObject *kwnames)
{
    Py_ssize_t ngiven = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;

    for (Py_ssize_t i = 0; i < ngiven; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        int known = PySequence_Contains(spec->kw_names, name);
        if (known == 0) {
            PyErr_Format(PyExc_TypeError,
                         "cgraph: unexpected keyword argument %R; the graph was captured "
                         "with keywords %R (sample_kwargs). Pass the arguments as the "
                         "capture did (one captured positionally, positionally), or graph "
                         "with it in sample_kwargs.", name, spec->kw_names);
        }
        if (known <= 0) {
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec->kw_names); i++) {
        PyObject *name = PyTuple_GET_ITEM(spec->kw_names, i);
        int given = kwnames ? PySequence_Contains(kwnames, name) : 0;
        if (given == 0) {
            PyErr_Format(PyExc_TypeError,
                         "cgraph: missing keyword argument %R; the graph was captured "
                         "with keywords %R (sample_kwargs). Pass the arguments as the "
                         "capture did (one captured by keyword, by keyword).", name,
                         spec->kw_names);
        }
        if (given <= 0) {
            return -1;
        }
    }
    return 0;
}

/* A NEW reference to how an error message shows a call's value `given`
 * where the graph holds `baked` (a captured constant or a default): its
 * repr for None, a bool, a number, a str, or a value of the baked one's
 * type (a dtype, a device, an enum), else its type ("a Tensor"): a
 * tensor's repr fills the screen, and a CUDA tensor's syncs, in a message
 * that a lookup across several graphs may build and drop on every call.
 * NULL with an exception set. */
static PyObject *
shown_value(PyObject *given, PyObject *baked)
{
    int plain = given == Py_None || PyBool_Check(given) || PyLong_Check(given) ||
                PyFloat_Check(given) || PyComplex_Check(given) || PyUnicode_Check(given) ||
                (baked != Py_None && Py_IS_TYPE(given, Py_TYPE(baked)));
    return plain ? PyObject_Repr(given) : PyUnicode_FromFormat("a %s", Py_TYPE(given)->tp_name);
}

/* Whether a call's value is one the graph baked in: the same type and an
 * equal value; for a float, its sign too (-0.0 is not 0.0 where 1/c or
 * copysign reads it), and any NaN matches a NaN (== never does).  1, 0,
 * or -1 with an exception set. */
static int
same_value(PyObject *given, PyObject *captured)
{
    if (Py_TYPE(given) != Py_TYPE(captured)) {
        return 0;
    }
    if (PyFloat_Check(given)) {  /* numpy.float64 too: its type is captured's */
        double a = PyFloat_AS_DOUBLE(given), b = PyFloat_AS_DOUBLE(captured);
        return (isnan(a) && isnan(b)) || (a == b && !signbit(a) == !signbit(b));
    }
    return PyObject_RichCompareBool(given, captured, Py_EQ);
}

/* 0 if every captured constant is passed again (same_value), else -1 with
 * a ValueError naming the argument. */
static int
check_constants(const cg_spec *spec, PyObject *leaves)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec->constants); i++) {
        PyObject *entry = PyTuple_GET_ITEM(spec->constants, i);
        Py_ssize_t position =
            PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, CG_CONSTANT_POSITION));
        PyObject *captured = PyTuple_GET_ITEM(entry, CG_CONSTANT_VALUE);
        if (position < 0 || position >= PyList_GET_SIZE(leaves)) {
            PyErr_SetString(PyExc_RuntimeError, "cgraph: a call's leaves are fewer than its "
                            "spec's constants say (a bug in cgraph: please report it)");
            return -1;
        }
        PyObject *given = PyList_GET_ITEM(leaves, position);
        int same = same_value(given, captured);
        PyObject *shown = same == 0 ? shown_value(given, captured) : NULL;
        if (shown != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "cgraph: argument '%U' was captured as %R, got %U. A graph "
                         "replays the value it was captured with: pass %R, pass the "
                         "value as a tensor, or graph once per value.",
                         PyTuple_GET_ITEM(entry, CG_CONSTANT_NAME), captured, shown, captured);
            Py_DECREF(shown);
        }
        if (same <= 0) {
            return -1;
        }
    }
    return 0;
}

/* The call as the (args, kwargs) pair the samples were flattened from, its
 * keywords in the captured (sorted) order.  Returns a NEW reference. */
static PyObject *
call_tree(const cg_spec *spec, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *positional = PyTuple_New(nargs), *keywords = PyDict_New(), *tree = NULL;

    if (positional == NULL || keywords == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyTuple_SET_ITEM(positional, i, Py_NewRef(args[i]));
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec->kw_names); i++) {
        PyObject *name = PyTuple_GET_ITEM(spec->kw_names, i);
        for (Py_ssize_t k = 0; kwnames && k < PyTuple_GET_SIZE(kwnames); k++) {
            if (PyUnicode_Compare(name, PyTuple_GET_ITEM(kwnames, k)) == 0 &&
                PyDict_SetItem(keywords, name, args[nargs + k]) < 0) {
                goto done;
            }
        }
    }
    tree = PyTuple_Pack(2, positional, keywords);
done:
    Py_XDECREF(positional);
    Py_XDECREF(keywords);
    return tree;
}

/* The leaves of `leaves` that are not constants, in order.  Returns a NEW
 * reference to a list. */
static PyObject *
drop_constants(const cg_spec *spec, PyObject *leaves)
{
    PyObject *tensors = PyList_New(0);
    Py_ssize_t c = 0, nconstants = PyTuple_GET_SIZE(spec->constants);

    for (Py_ssize_t i = 0; tensors != NULL && i < PyList_GET_SIZE(leaves); i++) {
        /* Constants are listed in leaf order: skip each at its position. */
        PyObject *constant = c < nconstants ? PyTuple_GET_ITEM(spec->constants, c) : NULL;
        if (constant != NULL &&
            PyLong_AsSsize_t(PyTuple_GET_ITEM(constant, CG_CONSTANT_POSITION)) == i) {
            c++;
        } else if (PyList_Append(tensors, PyList_GET_ITEM(leaves, i)) < 0) {
            Py_CLEAR(tensors);
        }
    }
    return tensors;
}

/* ---- defaults ------------------------------------------------------------ */

/* The entry of spec->defaults for the parameter at `position` (>= 0), or
 * else for the keyword `name`: borrowed, or NULL. */
static PyObject *
find_default(const cg_spec *spec, Py_ssize_t position, PyObject *name)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec->defaults); i++) {
        PyObject *entry = PyTuple_GET_ITEM(spec->defaults, i);
        int match = position >= 0
            ? PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, CG_DEFAULT_POSITION)) == position
            : PyTuple_GET_ITEM(entry, CG_DEFAULT_BY_KEYWORD) == Py_True &&
                  PyUnicode_Compare(PyTuple_GET_ITEM(entry, CG_DEFAULT_NAME), name) == 0;
        if (match) {
            return entry;
        }
    }
    return NULL;
}

/* 0 if `given` is the default `entry` holds (None by identity; else
 * same_value), else -1 with a ValueError naming it. */
static int
check_default(PyObject *entry, PyObject *given)
{
    PyObject *value = PyTuple_GET_ITEM(entry, CG_DEFAULT_VALUE);
    int same = (value == Py_None || given == Py_None) ? given == value
                                                      : same_value(given, value);
    if (same == 0) {
        PyObject *shown = shown_value(given, value);
        if (shown != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "cgraph: argument '%U' is %U, but the graph was captured without "
                         "it, that is with its default %R. Pass the default (or leave it "
                         "out), or graph with this value in sample_args or sample_kwargs.",
                         PyTuple_GET_ITEM(entry, CG_DEFAULT_NAME), shown, value);
            Py_DECREF(shown);
        }
    }
    return same > 0 ? 0 : -1;
}

/* Whether the call passes anything the capture did not: more positional
 * arguments, or a keyword outside the captured ones.  -1 on error. */
static int
passes_more(const cg_spec *spec, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs > PyTuple_GET_SIZE(spec->args)) {
        return 1;
    }
    for (Py_ssize_t k = 0; kwnames && k < PyTuple_GET_SIZE(kwnames); k++) {
        int known = PySequence_Contains(spec->kw_names, PyTuple_GET_ITEM(kwnames, k));
        if (known <= 0) {
            return known < 0 ? -1 : 1;
        }
    }
    return 0;
}

/* Appends to `values` (and `names`) the arguments to keep: the positional
 * ones the capture passed, and keywords that are captured or no default's
 * (check_keywords reports those).  0, or -1 with an exception set. */
static int
keep_arguments(const cg_spec *spec, PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames, PyObject *values, PyObject *names)
{
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *entry = i < PyTuple_GET_SIZE(spec->args) ? NULL : find_default(spec, i, NULL);
        if (i >= PyTuple_GET_SIZE(spec->args) && entry == NULL) {
            /* The type, not a repr: a CUDA tensor's would sync, and with
             * several graphs each entry that rejects the call builds this. */
            PyErr_Format(PyExc_TypeError,
                         "cgraph: the graph was captured with %zd positional argument(s); "
                         "argument %zd (a %s) is none of the callable's parameters with a "
                         "default. Pass the arguments as the capture did (an argument "
                         "captured by keyword, by keyword), or graph with it in sample_args.",
                         PyTuple_GET_SIZE(spec->args), i, Py_TYPE(args[i])->tp_name);
            return -1;
        }
        if (entry ? check_default(entry, args[i]) : PyList_Append(values, args[i])) {
            return -1;
        }
    }
    for (Py_ssize_t k = 0; kwnames && k < PyTuple_GET_SIZE(kwnames); k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k), *value = args[nargs + k];
        int captured = PySequence_Contains(spec->kw_names, name);
        PyObject *entry = captured == 0 ? find_default(spec, -1, name) : NULL;
        int status = captured < 0 ? -1
                     : entry ? check_default(entry, value)
                             : PyList_Append(values, value) || PyList_Append(names, name);
        if (status) {
            return -1;
        }
    }
    return 0;
}

int
cg_strip_defaults(const cg_spec *spec, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames, cg_call *out)
{
    PyObject *values = NULL, *names = NULL, *passed = NULL;
    Py_ssize_t npositional = 0;
    int more = passes_more(spec, nargs, kwnames);

    *out = (cg_call){args, nargs, kwnames, NULL};
    if (more <= 0) {
        return more;
    }
    values = PyList_New(0);
    names = PyList_New(0);
    if (values && names && keep_arguments(spec, args, nargs, kwnames, values, names) == 0) {
        npositional = PyList_GET_SIZE(values) - PyList_GET_SIZE(names);
        passed = Py_BuildValue("(NN)", PyList_AsTuple(values), PyList_AsTuple(names));
    }
    Py_XDECREF(values);
    Py_XDECREF(names);
    if (passed == NULL) {
        return -1;
    }
    out->owned = passed;
    out->args = PySequence_Fast_ITEMS(PyTuple_GET_ITEM(passed, 0));
    out->nargs = npositional;
    out->kwnames = PyTuple_GET_SIZE(PyTuple_GET_ITEM(passed, 1)) ? PyTuple_GET_ITEM(passed, 1)
                                                               : NULL;
    return 0;
}

/* ---- nested arguments, keywords and constants ------------------------------ */

/* Note [Arguments walked in C]
 * Q: A Hugging Face decoder layer is called with keywords, one of them a
 *    tuple (position_embeddings=(cos, sin)).  torch's tree_flatten in
 *    Python and a TreeSpec comparison took more than half of such a
 *    layer's forward call: 84-117 us of host time, against 32-53 with the
 *    walk below (H100, transformers 5, alternating processes; a layer
 *    called with one tensor takes 25-50).  Can the call path skip them?
 * A: For the calls that are structured as the samples were, yes.  Where
 *    the samples allow it (decided once in Python, cgraph/_describe.py's
 *    _walkable: every container of the samples an exact tuple, list or
 *    dict with str keys, and the samples as rebuilt flattening to the
 *    captured in_spec, which a torch.Size, rebuilt as a tuple, does not),
 *    a call is walked beside them: beside spec->walk, a copy of their
 *    containers that no one else holds (the callable is called with
 *    spec->args and spec->kwargs at warm-up and capture, and may change
 *    them in place: a dict re-keyed, a list appended to).  Where a sample
 *    holds a tuple, list or dict, the call
 *    must hold one of the same exact type and length (a dict's keys the
 *    same str in the same order); where it holds a leaf, the call must
 *    hold a leaf no pytree registration can claim: an exact torch.Tensor,
 *    None, or an exact bool, int, float or str.  The leaves come out in
 *    tree_flatten's order (tuples and lists in order, a dict by its keys'
 *    order), and the constants are checked and dropped as after
 *    tree_flatten.  Anything else (another container or leaf type, a
 *    structure that differs, a keyword that is a str subclass) goes to
 *    tree_flatten, which decides as before, error message included.  So
 *    the walk accepts only calls that tree_flatten would flatten to the
 *    captured in_spec, with the same leaves, and it runs no Python.  (It
 *    takes for granted that no one registers torch.Tensor, None or the
 *    plain scalars as pytree nodes.)  CPU tests hold the two to the same
 *    answers (tests/test_arguments.py, through _C._call_tensors, which
 *    runs what a graphed call runs). */

/* Appends the leaves of `given` to `leaves`, walked beside `sample`.
 * 1: done; 0: not a call the walk takes (tree_flatten decides); -1: error. */
static int
walk_leaves(const cg_state *state, PyObject *given, PyObject *sample, PyObject *leaves)
{
    PyTypeObject *type = Py_TYPE(sample);
    int status = 1;

    if (type == &PyTuple_Type || type == &PyList_Type) {
        Py_ssize_t n = Py_SIZE(sample);
        if (Py_TYPE(given) != type || Py_SIZE(given) != n) {
            return 0;
        }
        if (Py_EnterRecursiveCall(" while cgraph walked a call's arguments")) {
            return -1;
        }
        PyObject **mine = PySequence_Fast_ITEMS(given), **theirs = PySequence_Fast_ITEMS(sample);
        for (Py_ssize_t i = 0; status > 0 && i < n; i++) {
            status = walk_leaves(state, mine[i], theirs[i], leaves);
        }
        Py_LeaveRecursiveCall();
        return status;
    }
    if (type == &PyDict_Type) {
        Py_ssize_t at_given = 0, at_sample = 0;
        PyObject *key, *value, *sample_key, *sample_value;
        if (Py_TYPE(given) != type || PyDict_GET_SIZE(given) != PyDict_GET_SIZE(sample)) {
            return 0;
        }
        if (Py_EnterRecursiveCall(" while cgraph walked a call's arguments")) {
            return -1;
        }
        while (status > 0 && PyDict_Next(sample, &at_sample, &sample_key, &sample_value)) {
            PyDict_Next(given, &at_given, &key, &value);  /* same size: always one more */
            /* str keys only: comparing them runs no Python that could change the dicts */
            status = !PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(sample_key) ||
                             (key != sample_key && PyUnicode_Compare(key, sample_key) != 0)
                         ? 0
                         : walk_leaves(state, value, sample_value, leaves);
        }
        Py_LeaveRecursiveCall();
        return status;
    }
    /* `sample` is a leaf here (_walkable saw to it): so must `given` be. */
    PyTypeObject *given_type = Py_TYPE(given);
    int leaf = given == Py_None || given_type == state->Tensor_Type ||
               given_type == &PyBool_Type || given_type == &PyLong_Type ||
               given_type == &PyFloat_Type || given_type == &PyUnicode_Type;
    return !leaf ? 0 : PyList_Append(leaves, given) < 0 ? -1 : 1;
}

/* The call's leaves, walked beside the samples (Note [Arguments walked in
 * C]); keywords already checked.  Returns a NEW reference to a list, or
 * NULL: with an exception set on error, without one where the walk does
 * not take the call. */
static PyObject *
walked_leaves(const cg_state *state, const cg_spec *spec, PyObject *const *args,
              Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *leaves, *walk_args, *walk_kwargs;
    int status = 1;

    if (spec->walk == Py_None) {
        return NULL;
    }
    walk_args = PyTuple_GET_ITEM(spec->walk, 0);  /* spec.c checked the types */
    walk_kwargs = PyTuple_GET_ITEM(spec->walk, 1);
    if (nargs != PyTuple_GET_SIZE(walk_args) || (leaves = PyList_New(0)) == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; status > 0 && i < nargs; i++) {
        status = walk_leaves(state, args[i], PyTuple_GET_ITEM(walk_args, i), leaves);
    }
    /* The keywords in the captured (sorted) order, as call_tree puts them. */
    Py_ssize_t ngiven = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; status > 0 && i < PyTuple_GET_SIZE(spec->kw_names); i++) {
        PyObject *name = PyTuple_GET_ITEM(spec->kw_names, i), *sample;
        Py_ssize_t k = 0;
        /* Exact str only: a str subclass's __eq__ may match what its text does not. */
        while (k < ngiven && !(PyUnicode_CheckExact(PyTuple_GET_ITEM(kwnames, k)) &&
                               PyUnicode_Compare(name, PyTuple_GET_ITEM(kwnames, k)) == 0)) {
            k++;
        }
        sample = k < ngiven ? PyDict_GetItemWithError(walk_kwargs, name) : NULL;
        status = sample ? walk_leaves(state, args[nargs + k], sample, leaves)
                        : PyErr_Occurred() ? -1 : 0;
    }
    if (status <= 0) {
        Py_CLEAR(leaves);
    }
    return leaves;
}

/* The call's leaves by torch's tree_flatten, its structure compared with
 * the captured in_spec.  Returns a NEW reference to a list, or NULL with an
 * exception set (a TypeError where the structures differ). */
static PyObject *
flattened_leaves(const cg_state *state, const cg_spec *spec, PyObject *const *args,
                 Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *tree = call_tree(spec, args, nargs, kwnames), *flat, *leaves = NULL;
    int same;

    flat = tree ? PyObject_CallOneArg(state->tree_flatten, tree) : NULL;
    Py_XDECREF(tree);
    if (flat == NULL) {
        return NULL;
    }
    same = PyObject_RichCompareBool(PyTuple_GET_ITEM(flat, 1), spec->in_spec, Py_EQ);
    if (same == 0) {
        PyErr_Format(PyExc_TypeError,
                     "cgraph: the arguments are structured as %R, but the graph was "
                     "captured with %R. Pass arguments nested as the samples were.",
                     PyTuple_GET_ITEM(flat, 1), spec->in_spec);
    }
    if (same > 0) {
        leaves = Py_NewRef(PyTuple_GET_ITEM(flat, 0));
    }
    Py_DECREF(flat);
    return leaves;
}

PyObject *
cg_call_tensors(cg_state *state, const cg_spec *spec, PyObject *const *args,
                Py_ssize_t nargs, PyObject *kwnames, unsigned long long *flattened)
{
    PyObject *leaves, *tensors = NULL;

    if (check_keywords(spec, kwnames) < 0) {
        return NULL;
    }
    leaves = walked_leaves(state, spec, args, nargs, kwnames);
    if (leaves == NULL && !PyErr_Occurred()) {
        *flattened += 1;
        leaves = flattened_leaves(state, spec, args, nargs, kwnames);
    }
    if (leaves != NULL && check_constants(spec, leaves) == 0) {
        tensors = drop_constants(spec, leaves);
    }
    Py_XDECREF(leaves);
    return tensors;
}

/* A forward capture calls with views of the samples it made itself
 * (capture.c, call_for_capture): their tensors put back in the structure
 * the samples had. */
PyObject *
cg_call_from_tensors(const cg_state *state, const cg_spec *spec, PyObject *tensors)
{
    Py_ssize_t nt = PyTuple_GET_SIZE(tensors), nc = PyTuple_GET_SIZE(spec->constants);
    Py_ssize_t t = 0, c = 0;
    PyObject *leaves = PyList_New(nt + nc), *call;

    for (Py_ssize_t k = 0; leaves != NULL && k < nt + nc; k++) {
        /* constants are listed in leaf order */
        PyObject *constant = c < nc ? PyTuple_GET_ITEM(spec->constants, c) : NULL;
        PyObject *leaf;
        Py_ssize_t position =
            constant ? PyLong_AsSsize_t(PyTuple_GET_ITEM(constant, CG_CONSTANT_POSITION)) : -1;
        if (position == -1 && PyErr_Occurred()) {
            Py_CLEAR(leaves);
            break;
        }
        if (position == k) {
            leaf = PyTuple_GET_ITEM(constant, CG_CONSTANT_VALUE);
            c++;
        } else if (t < nt) {
            leaf = PyTuple_GET_ITEM(tensors, t++);
        } else {
            Py_CLEAR(leaves);
            PyErr_SetString(PyExc_RuntimeError, "cgraph: a spec's constants and tensors "
                            "do not make its leaves");
            break;
        }
        PyList_SET_ITEM(leaves, k, Py_NewRef(leaf));
    }
    if (leaves == NULL) {
        return NULL;
    }
    call = PyObject_CallFunctionObjArgs(state->tree_unflatten, leaves, spec->in_spec, NULL);
    Py_DECREF(leaves);
    if (call != NULL && !(PyTuple_Check(call) && PyTuple_GET_SIZE(call) == 2)) {
        Py_CLEAR(call);
        PyErr_SetString(PyExc_RuntimeError, "cgraph: a spec's in_spec is not (args, kwargs)");
    }
    return call;
}
