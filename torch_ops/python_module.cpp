// python_module.cpp: `import attnstash._C` loads this library, which registers the
// ops (schemas.cpp and the sdpa_*.cpp kernels) by static initialisation. No pybind: its
// functions are plain CPython ones, the cheapest call Python has, for the installer's hot path.
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "keep_replay.h"
#include "records.h"

// Read from the file by attnstash/_library.py before loading, to explain a torch mismatch.
extern "C" __attribute__((used)) const char attnstash_built_for_torch[] =
    "attnstash-built-for-torch:" ATTNSTASH_TORCH_VERSION ";";

// The autograd state the phase rules read (keep_replay.h), for the installer's frames.
static PyObject* inside_backward(PyObject*, PyObject*) { return PyBool_FromLong(attnstash::inside_backward()); }

static PyObject* saved_tensor_hooks_pushed(PyObject*, PyObject*) {
  return PyBool_FromLong(attnstash::saved_tensor_hooks_pushed());
}

// ---- keep: attnstash::sdpa_fwd_keep called positionally, as the installer's frames call it ----
// The same dispatcher call as the op's Python binding (torch.ops.attnstash.sdpa_fwd_keep), made
// without turning the arguments into a boxed stack and back. Only for what needs no Python
// semantics: exact tensors (torch.Tensor or Parameter, no subclass), Python's own int, float,
// bool and None, and no TorchFunctionMode active. Any other call goes to `boxed_keep`, the
// binding itself (ops.py hands it over: set_bindings), so that every call behaves as the binding's would:
// __torch_function__, conversions and the binding's own errors included.
static PyObject* boxed_keep = nullptr;

static bool plain_tensor(PyObject* o) { return THPVariable_CheckExact(o); }

static PyObject* keep(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const bool direct = nargs == 10 && !at::impl::torch_function_mode_enabled() && plain_tensor(args[0]) &&
                      plain_tensor(args[1]) && plain_tensor(args[2]) && plain_tensor(args[3]) &&
                      PyLong_CheckExact(args[4]) && (args[5] == Py_None || plain_tensor(args[5])) &&
                      PyFloat_CheckExact(args[6]) && PyBool_Check(args[7]) &&
                      (args[8] == Py_None || PyFloat_CheckExact(args[8])) && PyBool_Check(args[9]);
  int overflow = 0;
  const long long slot = direct ? PyLong_AsLongLongAndOverflow(args[4], &overflow) : 0;
  if (!direct || overflow != 0) {
    if (boxed_keep == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, "attnstash: _C.keep called before attnstash.ops handed it the op's binding");
      return nullptr;
    }
    return PyObject_Vectorcall(boxed_keep, args, nargs, nullptr);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnstash::sdpa_fwd_keep", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                            const std::optional<at::Tensor>&, double, bool, std::optional<double>, bool)>();
  const std::optional<at::Tensor> mask =
      args[5] == Py_None ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(args[5]));
  const std::optional<double> scale =
      args[8] == Py_None ? std::nullopt : std::optional<double>(PyFloat_AS_DOUBLE(args[8]));
  at::Tensor out;
  {
    // As the binding does: the GIL released while the op runs (other threads' Python runs).
    PyThreadState* released = PyEval_SaveThread();
    try {
      out = op.call(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), THPVariable_Unpack(args[2]),
                    THPVariable_Unpack(args[3]), slot, mask, PyFloat_AS_DOUBLE(args[6]), args[7] == Py_True, scale,
                    args[9] == Py_True);
    } catch (...) {
      PyEval_RestoreThread(released);
      throw;
    }
    PyEval_RestoreThread(released);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// ---- new_token: attnstash::_new_token's kernel (records.h), called directly ---------------------
// The op has no tensor argument and a catch-all kernel that dispatches nothing, so its binding's
// call is this one unless a mode can see it: a TorchFunctionMode, or anything that adds a key to
// this thread's dispatch (a TorchDispatchMode's Python key, functionalization). Then the call goes
// to `boxed_new_token`, the binding itself.
static PyObject* boxed_new_token = nullptr;

static bool unseen_by_modes() {
  return !at::impl::torch_function_mode_enabled() &&
         (c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty();
}

static PyObject* new_token(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  if (!unseen_by_modes()) {
    if (boxed_new_token == nullptr) {
      PyErr_SetString(PyExc_RuntimeError,
                      "attnstash: _C.new_token called before attnstash.ops handed it the op's binding");
      return nullptr;
    }
    return PyObject_CallNoArgs(boxed_new_token);
  }
  return THPVariable_Wrap(attnstash::records::new_token());
  END_HANDLE_TH_ERRORS
}

static bool callable_binding(PyObject* binding, const char* op) {
  if (PyCallable_Check(binding)) return true;
  PyErr_Format(PyExc_TypeError, "attnstash: _C._set_bindings expects the binding of attnstash::%s, got %R", op,
               binding);
  return false;
}

// ops.py hands over the two ops' bindings (each an OpOverload's `_op`), for the calls keep and
// new_token do not make themselves; both are checked before either is set.
static PyObject* set_bindings(PyObject*, PyObject* args) {
  PyObject *keep_binding = nullptr, *new_token_binding = nullptr;
  if (!PyArg_ParseTuple(args, "OO:_set_bindings", &keep_binding, &new_token_binding)) return nullptr;
  if (!callable_binding(keep_binding, "sdpa_fwd_keep") || !callable_binding(new_token_binding, "_new_token"))
    return nullptr;
  Py_INCREF(keep_binding);
  Py_XSETREF(boxed_keep, keep_binding);
  Py_INCREF(new_token_binding);
  Py_XSETREF(boxed_new_token, new_token_binding);
  Py_RETURN_NONE;
}

static PyMethodDef attnstash_methods[] = {
    {"inside_backward", inside_backward, METH_NOARGS, "Whether a backward pass runs on this thread."},
    {"saved_tensor_hooks_pushed", saved_tensor_hooks_pushed, METH_NOARGS,
     "Whether saved-tensor hooks are pushed on this thread (a non-reentrant checkpoint's, offloading's)."},
    {"keep", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(keep)), METH_FASTCALL,
     "attnstash::sdpa_fwd_keep(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, "
     "enable_gqa), all ten positional: the op's binding's call, made directly where no Python semantics apply."},
    {"new_token", new_token, METH_NOARGS,
     "attnstash::_new_token(): the op's kernel called directly, or its binding where a mode would see the call."},
    {"_set_bindings", set_bindings, METH_VARARGS,
     "Hand keep and new_token the bindings of sdpa_fwd_keep and _new_token, for the calls they do not make."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef attnstash_module = {PyModuleDef_HEAD_INIT, "_C", "attnstash's torch ops", -1,
                                              attnstash_methods};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&attnstash_module);
  if (module != nullptr && PyModule_AddStringConstant(module, "torch_version", ATTNSTASH_TORCH_VERSION) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
