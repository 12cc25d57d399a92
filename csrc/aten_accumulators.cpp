// aten_accumulators.cpp -- a whole training step's parameters: their grad
// accumulators moved onto the current stream for the length of its capture,
// then given their own streams back (Note [DDP inside a graphed step] in
// cgraph/_ddp.py); their grads compared with the ones its graph uses, around
// each replay (Note [Grads around a graphed step] in cgraph/_step_grads.py);
// their memory and requires_grad compared with the capture's (Note [What a
// graphed step checks before a replay] in cgraph/_step_checks.py).
#include "aten_engine.hpp"

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/input_metadata.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <utility>
#include <vector>

namespace cgraph {

namespace {

using torch::autograd::InputMetadata;

// Recent torch releases give InputMetadata a grad dtype (Tensor.grad_dtype);
// remade metadata keeps the accumulator's.  Releases without one have
// nothing to keep.
template <class Metadata>
auto keep_grad_dtype(Metadata& remade, const Metadata& was, int)
    -> decltype(remade.set_grad_dtype(was.grad_dtype()), void()) {
  remade.set_grad_dtype(was.grad_dtype());
}

template <class Metadata>
void keep_grad_dtype(Metadata&, const Metadata&, long) {}

// Remakes accumulator `node`'s one input metadata from its parameter, as its
// constructor made it, with the parameter's device's current stream
// (InputMetadata is not assignable: its options are const).
void remake_metadata(torch::autograd::Node& node, const at::Tensor& param,
                     const InputMetadata& was) {
  node.clear_input_metadata();
  node.add_input_metadata(param);
  keep_grad_dtype(node.mutable_input_metadata(0), was, 0);
}

}  // namespace

// An AccumulateGrad node runs on the stream its one input's metadata names:
// the stream that was current when the node was made (InputMetadata's
// constructor reads it; Node::stream() returns it; the engine guards onto it
// and makes it wait for the grad's producer).  Remaking that metadata while
// another stream is current moves the node, its hooks untouched, onto that
// stream.
cg_moved_accumulators* move_accumulators(const std::vector<at::Tensor>& params) {
  auto out = std::make_unique<cg_moved_accumulators>();
  try {
    for (const at::Tensor& p : params) {
      NodePtr node = torch::autograd::impl::try_get_grad_accumulator(p);
      if (!node || node->num_inputs() != 1) {
        continue;
      }
      // Recorded first, so that a failure below gives back what moved.
      out->moved.push_back({node, p, node->input_metadata(0)});
      remake_metadata(*node, p, out->moved.back().was);
    }
  } catch (...) {
    restore_accumulators(out.release());
    throw;
  }
  return out.release();
}

void restore_accumulators(cg_moved_accumulators* moved) noexcept {
  if (moved == nullptr) {
    return;
  }
  try {
    for (const cg_moved_accumulators::Moved& m : moved->moved) {
      c10::StreamGuard guard(m.was.stream());
      remake_metadata(*m.node, m.param, m.was);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("cgraph: could not give grad accumulators their streams back: ", e.what());
  }
  delete moved;
}

// A parameter's grad lives in its TensorImpl's autograd meta, and a
// tensor's Python object is the one its TensorImpl keeps: comparing
// TensorImpls is comparing `p.grad is g`, without making or looking up a
// Python object per parameter (what torch's grad getter does, about 70 ns
// each).
bool grads_are(PyObject* params, PyObject* grads) {
  const Py_ssize_t n = PyTuple_GET_SIZE(params);
  TORCH_CHECK(PyTuple_GET_SIZE(grads) == n, "cgraph: grads_are: ", n, " parameters but ",
              PyTuple_GET_SIZE(grads), " grads");
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* param = PyTuple_GET_ITEM(params, k);
    PyObject* want = PyTuple_GET_ITEM(grads, k);
    TORCH_CHECK_TYPE(THPVariable_Check(param), "cgraph: grads_are: parameter ", k,
                     " is not a tensor");
    const at::Tensor& grad = THPVariable_Unpack(param).grad();
    if (want == Py_None) {
      if (grad.defined()) {
        return false;
      }
      continue;
    }
    TORCH_CHECK_TYPE(THPVariable_Check(want), "cgraph: grads_are: grad ", k,
                     " is neither a tensor nor None");
    if (!grad.defined() ||
        grad.unsafeGetTensorImpl() != THPVariable_Unpack(want).unsafeGetTensorImpl()) {
      return false;
    }
  }
  return true;
}

namespace {

// The memory a parameter's kernels read: its own, or, for a tensor subclass
// that holds another tensor (a DTensor's local shard), that one's; null for
// another subclass, whose memory is not compared.
const void* memory_of(PyObject* param, const at::Tensor& t) {
  if (!t.key_set().has(c10::DispatchKey::Python)) {
    return t.const_data_ptr();
  }
  // Interned once and kept for the process, as CPython keeps its own
  // identifiers: a string made per parameter per replay costs more than the
  // lookup.
  static PyObject* const name = PyUnicode_InternFromString("_local_tensor");
  TORCH_CHECK(name != nullptr, "cgraph: out of memory");
  PyObject* local = PyObject_GetAttr(param, name);
  if (local == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const void* data =
      THPVariable_Check(local) ? THPVariable_Unpack(local).const_data_ptr() : nullptr;
  Py_DECREF(local);
  return data;
}

const at::Tensor& param_at(PyObject* params, Py_ssize_t k, const char* who) {
  PyObject* param = PyTuple_GET_ITEM(params, k);
  TORCH_CHECK_TYPE(THPVariable_Check(param), "cgraph: ", who, ": parameter ", k,
                   " is not a tensor");
  return THPVariable_Unpack(param);
}

}  // namespace

PyObject* param_marks(PyObject* params) {
  const Py_ssize_t n = PyTuple_GET_SIZE(params);
  THPObjectPtr marks(PyTuple_New(n));
  if (!marks) {
    throw python_error();
  }
  for (Py_ssize_t k = 0; k < n; ++k) {
    const at::Tensor& t = param_at(params, k, "param_marks");
    PyObject* mark = Py_BuildValue("(NO)", PyLong_FromVoidPtr(const_cast<void*>(
                                                memory_of(PyTuple_GET_ITEM(params, k), t))),
                                   t.requires_grad() ? Py_True : Py_False);
    if (mark == nullptr) {
      throw python_error();
    }
    PyTuple_SET_ITEM(marks.get(), k, mark);
  }
  return marks.release();
}

// A pointer and a flag compared per parameter (a DTensor's attribute read
// too): about as much as grads_are, once before each replay.
bool params_are(PyObject* params, PyObject* marks) {
  const Py_ssize_t n = PyTuple_GET_SIZE(params);
  TORCH_CHECK(PyTuple_GET_SIZE(marks) == n, "cgraph: params_are: ", n, " parameters but ",
              PyTuple_GET_SIZE(marks), " marks");
  for (Py_ssize_t k = 0; k < n; ++k) {
    const at::Tensor& t = param_at(params, k, "params_are");
    PyObject* mark = PyTuple_GET_ITEM(marks, k);
    TORCH_CHECK_TYPE(PyTuple_Check(mark) && PyTuple_GET_SIZE(mark) == 2,
                     "cgraph: params_are: mark ", k, " is not one of param_marks'");
    if (t.requires_grad() != (PyTuple_GET_ITEM(mark, 1) == Py_True)) {
      return false;
    }
    const void* data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(mark, 0));
    if (data == nullptr && PyErr_Occurred()) {
      throw python_error();
    }
    if (memory_of(PyTuple_GET_ITEM(params, k), t) != data) {
      if (PyErr_Occurred()) {
        throw python_error();
      }
      return false;
    }
  }
  return true;
}

}  // namespace cgraph
