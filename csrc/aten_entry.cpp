// aten_entry.cpp -- every extern "C" function of cgraph.h, in its order: thin
// wrappers over the Engine methods of the lifecycle files.
//
// Each sits inside HANDLE_TH_ERRORS, which turns C++ and c10 exceptions into
// Python exceptions: none crosses into C.  Those that set up a capture also
// note why one failed (Note [Capture failures] in capture.c).
#include "aten_engine.hpp"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

using cgraph::Engine;

namespace {

cudaStreamCaptureMode to_cuda_mode(cg_capture_mode mode) {
  switch (mode) {
    case CG_CAPTURE_THREAD_LOCAL:
      return cudaStreamCaptureModeThreadLocal;
    case CG_CAPTURE_RELAXED:
      return cudaStreamCaptureModeRelaxed;
    default:
      return cudaStreamCaptureModeGlobal;
  }
}

at::cuda::MempoolId_t to_mempool(cg_pool pool) {
  return {pool.first, pool.second};
}

// Runs `step`; if it throws a refusal of cgraph's or a CUDA error, notes the
// failure's kind in *failure before the exception goes on.
template <class Step>
void noting_failure(cg_failure* failure, Step&& step) {
  try {
    step();
  } catch (const cgraph::Refusal& refusal) {
    *failure = refusal.kind;
    throw;
  } catch (const c10::AcceleratorError& error) {
    *failure = cg_failure_of_cuda_error(error.get_error_code());
    throw;
  }
}

}  // namespace

extern "C" {

// ---- set-up ------------------------------------------------------------------

int cg_cuda_device_count(int* count) {
  HANDLE_TH_ERRORS
  *count = static_cast<int>(c10::cuda::device_count());
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_new_pool(cg_pool* out) {
  HANDLE_TH_ERRORS
  const auto id = at::cuda::graph_pool_handle();
  out->first = id.first;
  out->second = id.second;
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

cg_setup* cg_setup_begin(int device_index) {
  HANDLE_TH_ERRORS
  return cgraph::open_setup(static_cast<c10::DeviceIndex>(device_index));
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

int cg_setup_warm_up_in(cg_setup* setup, cg_pool pool) {
  HANDLE_TH_ERRORS
  cgraph::warm_up_in(*setup, to_mempool(pool));
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_setup_end_warm_up(cg_setup* setup) {
  HANDLE_TH_ERRORS
  return cgraph::end_warm_up(*setup) ? 1 : 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_setup_move_out_of_pool(cg_setup* setup, PyObject* objects) {
  HANDLE_TH_ERRORS
  return cgraph::moved_what_warm_up_left(*setup, objects) ? 1 : 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_setup_release_warmup_memory(cg_setup* setup) {
  HANDLE_TH_ERRORS
  cgraph::release_warmup_memory(*setup);
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

void cg_setup_end(cg_setup* setup) {
  cgraph::close_setup(setup);
}

int cg_can_allocate_all_from_a_pool(int* out) {
  HANDLE_TH_ERRORS
  *out = cgraph::can_allocate_all_from_a_pool() ? 1 : 0;
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_setup_allocate_all_from(cg_setup* setup, cg_pool pool) {
  HANDLE_TH_ERRORS
  cgraph::allocate_all_from(*setup, to_mempool(pool));
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_pool_hold(int device, cg_pool pool) {
  HANDLE_TH_ERRORS
  cgraph::hold_pool(static_cast<c10::DeviceIndex>(device), to_mempool(pool));
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

void cg_pool_release(int device, cg_pool pool) {
  cgraph::release_held_pool(static_cast<c10::DeviceIndex>(device), to_mempool(pool));
}

cg_engine* cg_engine_new(const cg_engine_config* config) {
  HANDLE_TH_ERRORS
  return new cg_engine{std::make_shared<Engine>(*config)};
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

void cg_engine_free(cg_engine* engine) {
  delete engine;  // the last reference resets the engine; reset never throws
}

int cg_engine_finish_setup(cg_engine* engine) {
  HANDLE_TH_ERRORS
  engine->ptr->finish_setup();
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

// ---- warm-up -----------------------------------------------------------------

int cg_engine_warmup_begin(cg_engine* engine) {
  HANDLE_TH_ERRORS
  engine->ptr->rng.warmup_begin();
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_warmup_end(cg_engine* engine, int completed) {
  if (!completed) {
    // Outside HANDLE_TH_ERRORS: its warning handler would raise a warning
    // as Python's while the caller's exception, the one reported, is set.
    engine->ptr->rng.capture_end();  // noexcept; leaves the RNG hooks
    return 0;
  }
  HANDLE_TH_ERRORS
  engine->ptr->rng.warmup_end();
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_warmup_backward(cg_engine* engine, PyObject* outputs) {
  HANDLE_TH_ERRORS
  engine->ptr->warmup_backward(cgraph::unpack_tensors(outputs, "output"));
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

PyObject* cg_autograd_leaves(PyObject* tensors) {
  HANDLE_TH_ERRORS
  const auto leaves = cgraph::autograd_leaves(cgraph::unpack_tensors(tensors, "tensor"));
  THPObjectPtr list(PyList_New(static_cast<Py_ssize_t>(leaves.size())));
  if (!list) {
    throw python_error();
  }
  for (size_t k = 0; k < leaves.size(); ++k) {
    PyObject* leaf = THPVariable_Wrap(leaves[k]);
    if (!leaf) {
      throw python_error();
    }
    PyList_SET_ITEM(list.get(), static_cast<Py_ssize_t>(k), leaf);
  }
  return list.release();
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

// ---- capture -----------------------------------------------------------------

int cg_engine_capture_begin(cg_engine* engine, cg_pass pass, cg_pool pool,
                            cg_capture_mode mode, cg_failure* failure) {
  HANDLE_TH_ERRORS
  noting_failure(failure, [&] { engine->ptr->capture_begin(pass, to_mempool(pool),
                                                           to_cuda_mode(mode)); });
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_capture_end(cg_engine* engine, cg_pass pass, cg_failure* failure) {
  HANDLE_TH_ERRORS
  noting_failure(failure, [&] { engine->ptr->capture_end(pass); });
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

void cg_engine_capture_abort(cg_engine* engine, cg_pass pass) {
  // Keep the callable's exception: abandoning may call into torch, which
  // could set (and must not clobber) Python's error indicator.
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  engine->ptr->abandon_capture(pass);
  PyErr_Restore(type, value, traceback);
}

// A NEW reference (cgraph.h says to what), or nullptr with an exception set.
PyObject* cg_engine_capture_inputs(cg_engine* engine) {
  HANDLE_TH_ERRORS
  std::vector<at::Tensor> inputs = engine->ptr->capture_inputs();
  if (inputs.empty()) {
    Py_RETURN_NONE;
  }
  THPObjectPtr tuple(PyTuple_New(static_cast<Py_ssize_t>(inputs.size())));
  if (!tuple) {
    throw python_error();
  }
  for (size_t k = 0; k < inputs.size(); ++k) {
    PyObject* input = THPVariable_Wrap(std::move(inputs[k]));
    if (!input) {
      throw python_error();
    }
    PyTuple_SET_ITEM(tuple.get(), static_cast<Py_ssize_t>(k), input);
  }
  return tuple.release();
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

int cg_engine_set_outputs(cg_engine* engine, PyObject* outputs) {
  HANDLE_TH_ERRORS
  engine->ptr->set_outputs(cgraph::unpack_tensors(outputs, "output"));
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_capture_backward(cg_engine* engine, cg_pool pool, cg_capture_mode mode,
                               cg_failure* failure) {
  HANDLE_TH_ERRORS
  noting_failure(failure, [&] { engine->ptr->capture_backward(to_mempool(pool),
                                                              to_cuda_mode(mode)); });
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

cg_failure cg_failure_of_cuda_error(int code) {
  switch (code) {
    case cudaErrorStreamCaptureUnsupported:
      return CG_FAILURE_SYNC;
    case cudaErrorStreamCaptureInvalidated:
      return CG_FAILURE_INVALIDATED;
    case cudaErrorStreamCaptureUnjoined:
      return CG_FAILURE_UNJOINED;
    case cudaErrorStreamCaptureWrongThread:
      return CG_FAILURE_WRONG_THREAD;
    case cudaErrorStreamCaptureImplicit:
      return CG_FAILURE_LEGACY_STREAM;
    default:
      return CG_FAILURE_OTHER;
  }
}

// ---- a whole training step ---------------------------------------------------

cg_moved_accumulators* cg_accumulators_move(PyObject* params, Py_ssize_t* count) {
  HANDLE_TH_ERRORS
  cg_moved_accumulators* moved =
      cgraph::move_accumulators(cgraph::unpack_tensors(params, "parameter"));
  *count = static_cast<Py_ssize_t>(moved->moved.size());
  return moved;
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

void cg_accumulators_restore(cg_moved_accumulators* moved) {
  cgraph::restore_accumulators(moved);
}

int cg_grads_are(PyObject* params, PyObject* grads) {
  HANDLE_TH_ERRORS
  return cgraph::grads_are(params, grads) ? 1 : 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

PyObject* cg_param_marks(PyObject* params) {
  HANDLE_TH_ERRORS
  return cgraph::param_marks(params);
  END_HANDLE_TH_ERRORS
}

int cg_params_are(PyObject* params, PyObject* marks) {
  HANDLE_TH_ERRORS
  return cgraph::params_are(params, marks) ? 1 : 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

// ---- conditional regions -----------------------------------------------------

int cg_conditional_nodes(void) {
  try {
    return cgraph::conditional_nodes_supported() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

cg_if_region* cg_if_begin(PyObject* flag) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(THPVariable_Check(flag), "call_if: the flag must be a tensor (a bool on "
                   "the GPU), not ", Py_TYPE(flag)->tp_name);
  cgraph::Graph* graph = cgraph::Graph::capturing_here();
  TORCH_CHECK(graph != nullptr, "cgraph: a conditional region needs a capture by cgraph on the "
              "current stream; none is under way.");
  graph->begin_if(THPVariable_Unpack(flag));
  return new cg_if_region{graph};
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

int cg_if_end(cg_if_region* region, int completed) {
  std::unique_ptr<cg_if_region> owned(region);
  if (!completed) {
    try {
      owned->graph->end_if(false);
    } catch (...) {  // never raises: the caller's exception is the one reported
    }
    return 0;
  }
  HANDLE_TH_ERRORS
  owned->graph->end_if(true);
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

// ---- replay ------------------------------------------------------------------

PyObject* cg_engine_replay(cg_engine* engine, PyObject* const* args, Py_ssize_t nargs,
                           int accepted) {
  HANDLE_TH_ERRORS
  // A copy: Python code run inside the replay (a finalizer of a collection
  // that allocating an output starts) may reset() the callable and free
  // the handle; the engine then lives until the replay returns.
  const std::shared_ptr<cgraph::Engine> held = engine->ptr;
  return cgraph::replay(held, args, static_cast<size_t>(nargs), accepted != 0);
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

int cg_engine_accepts(const cg_engine* engine, PyObject* const* args, Py_ssize_t nargs,
                      int exact_grad, int exact_dtype) {
  HANDLE_TH_ERRORS
  return cgraph::accepts(*engine->ptr, args, static_cast<size_t>(nargs), exact_grad != 0,
                         exact_dtype != 0) ? 1 : 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_engine_may_replay(const cg_engine* engine) {
  return engine->ptr->may_replay_forward() ? 1 : 0;
}

int cg_engine_backward_pending(const cg_engine* engine) {
  return engine->ptr->backward_pending() ? 1 : 0;
}

int cg_pool_busy(cg_pool pool, int unkept_only) {
  return cgraph::pool_busy(to_mempool(pool), unkept_only != 0) ? 1 : 0;
}

// cg_pool_open_to_layers is in aten_pool.cpp, beside the ledger's state it keeps.

int cg_in_backward(void) {
  return torch::autograd::get_current_graph_task_id() != -1 ? 1 : 0;
}

int cg_pool_release_kept(cg_pool pool, cg_engine* const* capturing, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  try {
    std::vector<cgraph::Engine*> engines;
    for (Py_ssize_t i = 0; i < n; ++i) {
      engines.push_back(capturing[i]->ptr.get());
    }
    cgraph::release_kept_activations(to_mempool(pool), engines);
  } catch (const cgraph::InvariantError&) {
    throw;  // a bug: raised
  } catch (const std::exception& e) {  // nothing released: still exact
    TORCH_WARN("cgraph: could not release a pool's memory for a capture: ", e.what());
  }
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

int cg_pool_move_held(cg_pool pool) {
  HANDLE_TH_ERRORS
  cgraph::move_held_out_of_freed(to_mempool(pool));
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

PyObject* cg_pool_static_output(cg_pool pool, PyObject* tensor) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(THPVariable_Check(tensor), "static_output: expects a tensor");
  std::optional<at::Tensor> found =
      cgraph::static_output_in(to_mempool(pool), THPVariable_Unpack(tensor));
  if (!found) {
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(std::move(*found));
  END_HANDLE_TH_ERRORS
}

// ---- fixed homes ----------------------------------------------------------------

int cg_lend_memory(PyObject* tensors, PyObject* homes) {
  HANDLE_TH_ERRORS
  const auto ts = cgraph::unpack_tensors(tensors, "tensor");
  const auto hs = cgraph::unpack_tensors(homes, "home");
  TORCH_CHECK(ts.size() == hs.size(), "cgraph: lend_memory: ", ts.size(), " tensors but ",
              hs.size(), " homes");
  for (size_t k = 0; k < ts.size(); ++k) {
    cgraph::lend_memory(ts[k], hs[k]);
  }
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

// ---- random numbers ------------------------------------------------------------

PyObject* cg_rng_get_state(int device, cg_failure* failure) {
  HANDLE_TH_ERRORS
  std::optional<at::Tensor> state;
  noting_failure(failure, [&] { state = cgraph::rng_get_state(device); });
  if (!state) {
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(*state);
  END_HANDLE_TH_ERRORS_RET(nullptr)
}

int cg_rng_set_state(PyObject* state, int device, cg_failure* failure) {
  HANDLE_TH_ERRORS
  if (!THPVariable_Check(state)) {
    return 0;
  }
  bool handled = false;
  noting_failure(failure, [&] {
    handled = cgraph::rng_set_state(THPVariable_Unpack(state), device);
  });
  return handled ? 1 : 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

// ---- reset -------------------------------------------------------------------

void cg_engine_reset(cg_engine* engine) {
  engine->ptr->reset();
}

void cg_exiting(void) {
  cgraph::note_exiting();
}

// ---- introspection ---------------------------------------------------------------

cg_pool cg_engine_pool(const cg_engine* engine) {
  const auto& pool = engine->ptr->pool;
  return cg_pool{pool.first, pool.second};
}

Py_ssize_t cg_engine_num_inputs(const cg_engine* engine) {
  return static_cast<Py_ssize_t>(engine->ptr->inputs.size());
}

Py_ssize_t cg_engine_num_params(const cg_engine* engine) {
  return static_cast<Py_ssize_t>(engine->ptr->params.size());
}

cg_stats cg_engine_stats(const cg_engine* engine) {
  return engine->ptr->stats;
}

int cg_engine_graph_shape(const cg_engine* engine, cg_pass pass, cg_graph_shape* out) {
  HANDLE_TH_ERRORS
  const Engine& e = *engine->ptr;
  if (!e.alive() || (pass == CG_BACKWARD && !e.backward.exists())) {
    return 0;
  }
  return (pass == CG_FORWARD ? *e.fwd : *e.bwd).shape(out) ? 1 : 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

// ---- checked invariants (aten_checks.cpp) ----------------------------------

int cg_set_debug(int on, const char* fault) {
  if (!cgraph::set_debug(on != 0, fault)) {
    PyErr_Format(PyExc_ValueError, "cgraph: no fault named '%s'; the one a test may plant "
                 "is 'skip_later_moves'.", fault);
    return -1;
  }
  return 0;
}

int cg_debug(void) {
  return cgraph::debug_checks() ? 1 : 0;
}

}  // extern "C"
