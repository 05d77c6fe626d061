// python_module.cpp: `import attnstash._C` loads this library, which registers the
// ops (schemas.cpp, the sdpa_*.cpp kernels and frames.cpp's kernel of aten's) by static
// initialisation. No pybind: its functions are plain CPython ones, the cheapest call Python has,
// for the installer's hot path.
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "frames.h"
#include "keep_replay.h"
#include "records.h"

// Read from the file by attnstash/_library.py before loading, to explain a torch mismatch.
extern "C" __attribute__((used)) const char attnstash_built_for_torch[] =
    "attnstash-built-for-torch:" ATTNSTASH_TORCH_VERSION ";";

// frame_phase(outer_grad) -> int: the phase of a stashed layer's forward as it starts
// (keep_replay.h, FramePhase), for the installer to open its frame by.
static PyObject* frame_phase(PyObject*, PyObject* outer_grad) {
  const long outer = PyLong_AsLong(outer_grad);
  if (outer == -1 && PyErr_Occurred()) return nullptr;
  if (outer < -1 || outer > 1) {
    PyErr_Format(PyExc_ValueError, "attnstash: _C.frame_phase takes outer_grad as 1, 0 or -1 (unseen), got %ld",
                 outer);
    return nullptr;
  }
  return PyLong_FromLong(static_cast<long>(attnstash::frame_phase(static_cast<int>(outer))));
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

// ---- frames: opened and closed by the installer around each forward of a stashed layer -----------
// (frames.h states what a frame does.)
// frame_open(anchor, slot_base, limit, phase, collect, random, random_input) -> keep: `limit` -1
// for none, `phase` a FramePhase value (keep_replay.h), `random` a frames::RandomCheck value,
// `random_input` the layer input whose device's generator state starts a note or refuse check
// (else None).
static bool open_frame(PyObject* const* args, const char* name, bool* keep) {
  if (!THPVariable_Check(args[0])) {
    PyErr_Format(PyExc_TypeError, "attnstash: _C.%s: the anchor is not a tensor", name);
    return false;
  }
  attnstash::frames::Frame frame;
  frame.anchor = THPVariable_Unpack(args[0]);
  frame.slot_base = PyLong_AsLongLong(args[1]);
  frame.limit = PyLong_AsLongLong(args[2]);
  const long long phase = PyLong_AsLongLong(args[3]);
  const long long random = PyLong_AsLongLong(args[5]);
  if (PyErr_Occurred()) return false;
  if (phase < 0 || phase > static_cast<long long>(attnstash::FramePhase::outside_checkpoint) || random < 0 ||
      random > static_cast<long long>(attnstash::frames::RandomCheck::check)) {
    PyErr_Format(PyExc_ValueError, "attnstash: _C.%s: phase %lld or random check %lld is not one of "
                 "attnstash.ops.FramePhase's or RandomCheck's values", name, phase, random);
    return false;
  }
  frame.collect = PyObject_IsTrue(args[4]) == 1;
  frame.random = static_cast<attnstash::frames::RandomCheck>(random);
  at::Tensor random_input;
  if (THPVariable_Check(args[6])) random_input = THPVariable_Unpack(args[6]);
  *keep = attnstash::frames::open(std::move(frame), static_cast<attnstash::FramePhase>(phase), random_input);
  return true;
}

static PyObject* frame_open(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "attnstash: _C.frame_open takes (anchor tensor, slot_base, limit, phase, collect, random, "
                    "random_input)");
    return nullptr;
  }
  bool keep = false;
  if (!open_frame(args, "frame_open", &keep)) return nullptr;
  return PyBool_FromLong(keep);
  END_HANDLE_TH_ERRORS
}

// The ids a closed frame listed (a frame opened with `collect`), or None.
static PyObject* listed_ids(const attnstash::frames::Frame& frame) {
  if (!frame.collect) Py_RETURN_NONE;
  PyObject* ids = PyList_New(static_cast<Py_ssize_t>(frame.ids.size()));
  if (ids == nullptr) return nullptr;
  for (size_t i = 0; i < frame.ids.size(); ++i)
    PyList_SET_ITEM(ids, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(frame.ids[i]));
  return ids;
}

// (Failure value, message, dropout_p) of the call a closed frame refused, or None.
static PyObject* failure_of(attnstash::frames::Failure failure, const std::string& message, double dropout_p) {
  if (failure == attnstash::frames::Failure::none) Py_RETURN_NONE;
  return Py_BuildValue("(Lsd)", static_cast<long long>(failure), message.c_str(), dropout_p);
}

// frame_close(interrupted) -> (calls, ids or None, noted, failure): `interrupted`: the forward
// raised (what the frame owns is released); `ids` the records its calls kept (a frame opened with
// `collect`), `failure` None or (frames::Failure value, message, dropout_p).
static PyObject* frame_close(PyObject*, PyObject* interrupted) {
  HANDLE_TH_ERRORS
  attnstash::frames::Frame frame = attnstash::frames::close(PyObject_IsTrue(interrupted) == 1);
  return Py_BuildValue("(LNON)", static_cast<long long>(frame.calls), listed_ids(frame),
                       frame.noted ? Py_True : Py_False, failure_of(frame.failure, frame.message, frame.dropout_p));
  END_HANDLE_TH_ERRORS
}

// What frame_run's frame said when its forward raised, until frame_interrupted takes it: this
// thread's, reset as each frame_run starts.
static thread_local bool interrupted_noted = false;
static thread_local attnstash::frames::Failure interrupted_failure = attnstash::frames::Failure::none;
static thread_local std::string interrupted_message;
static thread_local double interrupted_dropout_p = 0.0;

// frame_run(fn, args, kwargs, anchor, slot_base, limit, phase, collect, random, random_input)
// -> (fn's output, calls, keep, ids or None, noted): fn(*args, **kwargs) (`kwargs` a dict or
// None) in a frame opened as frame_open opens it, closed as it returns, as frame_close(False)
// closes it: one call in place of three on the installer's hot path. Where fn raises, the frame
// closes as interrupted (what it owns is released) and fn's error propagates; frame_interrupted()
// then says what frame_close(True) would have.
static PyObject* frame_run(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  interrupted_noted = false;
  interrupted_failure = attnstash::frames::Failure::none;
  if (nargs != 10 || !PyTuple_Check(args[1]) || (args[2] != Py_None && !PyDict_Check(args[2]))) {
    PyErr_SetString(PyExc_TypeError,
                    "attnstash: _C.frame_run takes (fn, args tuple, kwargs dict or None, anchor tensor, slot_base, "
                    "limit, phase, collect, random, random_input)");
    return nullptr;
  }
  bool keep = false;
  if (!open_frame(args + 3, "frame_run", &keep)) return nullptr;
  PyObject* out = PyObject_Call(args[0], args[1], args[2] == Py_None ? nullptr : args[2]);
  if (out == nullptr) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    attnstash::frames::Frame frame;
    try {
      frame = attnstash::frames::close(true);
    } catch (...) {
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(traceback);
      throw;
    }
    interrupted_noted = frame.noted;
    interrupted_failure = frame.failure;
    interrupted_message = std::move(frame.message);
    interrupted_dropout_p = frame.dropout_p;
    PyErr_Restore(type, value, traceback);
    return nullptr;
  }
  attnstash::frames::Frame frame;
  try {
    frame = attnstash::frames::close(false);
  } catch (...) {
    Py_DECREF(out);
    throw;
  }
  return Py_BuildValue("(NLONO)", out, static_cast<long long>(frame.calls), keep ? Py_True : Py_False,
                       listed_ids(frame), frame.noted ? Py_True : Py_False);
  END_HANDLE_TH_ERRORS
}

// frame_interrupted() -> (noted, failure or None): what the frame of this thread's last frame_run
// whose forward raised said as it closed (frame_close's `noted` and `failure`).
static PyObject* frame_interrupted(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  return Py_BuildValue("(ON)", interrupted_noted ? Py_True : Py_False,
                       failure_of(interrupted_failure, interrupted_message, interrupted_dropout_p));
  END_HANDLE_TH_ERRORS
}

static PyObject* frame_depth(PyObject*, PyObject*) {
  return PyLong_FromSize_t(attnstash::frames::depth());
}

// frame_is_open(slot_base) -> bool: frames.h, is_open.
static PyObject* frame_is_open(PyObject*, PyObject* slot_base) {
  const long long base = PyLong_AsLongLong(slot_base);
  if (base == -1 && PyErr_Occurred()) return nullptr;
  return PyBool_FromLong(attnstash::frames::is_open(base));
}

// ---- compiled frames: the installer's hook (frames.h, CompiledAttention) ------------------------
// attnstash/install/compiled.py hands over `compiled_attention_fn(query, key, value, attn_mask,
// dropout_p, is_causal, scale, enable_gqa) -> Tensor or None`, and counts its frames.
static PyObject* compiled_attention_fn = nullptr;

static std::optional<at::Tensor> compiled_attention(const at::Tensor& query, const at::Tensor& key,
                                                    const at::Tensor& value,
                                                    const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                    bool is_causal, std::optional<double> scale, bool enable_gqa) {
  pybind11::gil_scoped_acquire gil;
  if (compiled_attention_fn == nullptr) return std::nullopt;
  PyObject* args[] = {THPVariable_Wrap(query),
                      THPVariable_Wrap(key),
                      THPVariable_Wrap(value),
                      attn_mask.has_value() ? THPVariable_Wrap(*attn_mask) : Py_NewRef(Py_None),
                      PyFloat_FromDouble(dropout_p),
                      PyBool_FromLong(is_causal),
                      scale.has_value() ? PyFloat_FromDouble(*scale) : Py_NewRef(Py_None),
                      PyBool_FromLong(enable_gqa)};
  PyObject* result = nullptr;
  if (std::all_of(std::begin(args), std::end(args), [](PyObject* o) { return o != nullptr; }))
    result = PyObject_Vectorcall(compiled_attention_fn, args, 8, nullptr);
  for (PyObject* o : args) Py_XDECREF(o);
  if (result == nullptr) {
    python_error error;
    error.persist();
    throw error;
  }
  std::optional<at::Tensor> out;
  if (THPVariable_Check(result)) out = THPVariable_Unpack(result);
  const bool none = result == Py_None;
  Py_DECREF(result);
  TORCH_CHECK(out.has_value() || none,
              "attnstash: the installer's compiled_attention returned neither a tensor nor None");
  return out;
}

static PyObject* set_compiled_attention(PyObject*, PyObject* fn) {
  if (!PyCallable_Check(fn)) {
    PyErr_Format(PyExc_TypeError, "attnstash: _C._set_compiled_attention expects a callable, got %R", fn);
    return nullptr;
  }
  Py_INCREF(fn);
  Py_XSETREF(compiled_attention_fn, fn);
  attnstash::frames::set_compiled_attention(&compiled_attention);
  Py_RETURN_NONE;
}

static PyObject* set_compiled_frames(PyObject*, PyObject* count) {
  const long long n = PyLong_AsLongLong(count);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  attnstash::frames::set_compiled_frames(n);
  Py_RETURN_NONE;
}

// ops.py hands over _new_token's binding (its OpOverload's `_op`), for the calls new_token does not
// make itself.
static PyObject* set_token_binding(PyObject*, PyObject* binding) {
  if (!PyCallable_Check(binding)) {
    PyErr_Format(PyExc_TypeError, "attnstash: _C._set_token_binding expects the binding of attnstash::_new_token, "
                 "got %R", binding);
    return nullptr;
  }
  Py_INCREF(binding);
  Py_XSETREF(boxed_new_token, binding);
  Py_RETURN_NONE;
}

// new_slot_base() -> int: records.h, new_slot_base.
static PyObject* new_slot_base(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  return PyLong_FromLongLong(attnstash::records::new_slot_base());
  END_HANDLE_TH_ERRORS
}

// record_id(anchor, slot) -> int: records.h, record_id (the stash_record_id op's kernel), called
// directly: module_call.py asks it of every pending first forward as its layer runs, where the op's
// binding costs more than the query. Modes do not see it, as they do not see frame_open's anchor.
static PyObject* record_id(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || !THPVariable_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "attnstash: _C.record_id takes (anchor tensor, slot)");
    return nullptr;
  }
  const long long slot = PyLong_AsLongLong(args[1]);
  if (slot == -1 && PyErr_Occurred()) return nullptr;
  return PyLong_FromLongLong(attnstash::records::record_id(THPVariable_Unpack(args[0]), slot));
  END_HANDLE_TH_ERRORS
}

// saved_tensor_hooks_depth() -> int: how many saved-tensor hook pairs this thread has pushed
// (keep_replay.h), for attnstash/install/offload.py to tell, without popping the top pair, that
// none lies below a non-reentrant checkpoint's own.
static PyObject* saved_tensor_hooks_depth(PyObject*, PyObject*) {
  return PyLong_FromSize_t(attnstash::saved_tensor_hooks_depth());
}

// recomputed() -> int: frames.h, recomputed.
static PyObject* recomputed(PyObject*, PyObject*) {
  return PyLong_FromLongLong(attnstash::frames::recomputed());
}

static PyMethodDef attnstash_methods[] = {
    {"frame_phase", frame_phase, METH_O,
     "The phase of a stashed layer's forward as it starts (torch_ops/keep_replay.h, FramePhase), given whether a "
     "backward can reach its checkpoint from outside (1, 0, or -1 where unseen)."},
    {"new_token", new_token, METH_NOARGS,
     "attnstash::_new_token(): the op's kernel called directly, or its binding where a mode would see the call."},
    {"frame_open", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(frame_open)), METH_FASTCALL,
     "Open a frame on this thread (torch_ops/frames.h): (anchor, slot_base, limit, phase, collect, random, "
     "random_input) -> whether it keeps."},
    {"frame_close", frame_close, METH_O,
     "Close this thread's innermost frame (interrupted: its forward raised): (calls, ids or None, noted, failure "
     "or None)."},
    {"frame_run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(frame_run)), METH_FASTCALL,
     "fn(*args, **kwargs) in a frame (torch_ops/frames.h): (fn, args, kwargs, anchor, slot_base, limit, phase, "
     "collect, random, random_input) -> (out, calls, keep, ids or None, noted)."},
    {"frame_interrupted", frame_interrupted, METH_NOARGS,
     "What the frame of this thread's last frame_run whose forward raised said as it closed: (noted, failure or "
     "None)."},
    {"new_slot_base", new_slot_base, METH_NOARGS,
     "The first slot of a new range of slots_per_range (csrc/stash_registry.h, stash_new_slot_range)."},
    {"frame_depth", frame_depth, METH_NOARGS, "How many frames are open on this thread."},
    {"frame_is_open", frame_is_open, METH_O,
     "Whether a frame whose layer's first slot is slot_base is open on this thread (frames.h, is_open)."},
    {"record_id", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record_id)), METH_FASTCALL,
     "The id of the record held for (anchor, slot), 0 if none: the stash_record_id op's kernel (records.h)."},
    {"saved_tensor_hooks_depth", saved_tensor_hooks_depth, METH_NOARGS,
     "How many saved-tensor hook pairs this thread has pushed (torch_ops/keep_replay.h)."},
    {"recomputed", recomputed, METH_NOARGS,
     "How many attention calls torch's own kernel ran in a backward with grad on (frames.h)."},
    {"_set_compiled_attention", set_compiled_attention, METH_O,
     "Hand the frames the installer's hook for compiled frames (torch_ops/frames.h, CompiledAttention)."},
    {"set_compiled_frames", set_compiled_frames, METH_O, "How many compiled frames this thread has open."},
    {"_set_token_binding", set_token_binding, METH_O,
     "Hand new_token the binding of _new_token, for the calls it does not make itself."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef attnstash_module = {PyModuleDef_HEAD_INIT, "_C", "attnstash's torch ops", -1,
                                              attnstash_methods};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&attnstash_module);
  if (module != nullptr && (PyModule_AddStringConstant(module, "torch_version", ATTNSTASH_TORCH_VERSION) < 0 ||
                            PyModule_AddIntConstant(module, "slots_per_range", STASH_SLOTS_PER_RANGE) < 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
