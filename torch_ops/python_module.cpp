// python_module.cpp: `import attnstash._C` loads this library, which registers the
// ops (schemas.cpp and the sdpa_*.cpp kernels) by static initialisation. No pybind.
#include <Python.h>

#include "keep_replay.h"

// Read from the file by attnstash/_library.py before loading, to explain a torch mismatch.
extern "C" __attribute__((used)) const char attnstash_built_for_torch[] =
    "attnstash-built-for-torch:" ATTNSTASH_TORCH_VERSION ";";

// The autograd state the phase rules read (keep_replay.h), for the installer's frames: plain
// CPython functions, the cheapest call Python has, made once or twice a stashed forward.
static PyObject* inside_backward(PyObject*, PyObject*) { return PyBool_FromLong(attnstash::inside_backward()); }

static PyObject* saved_tensor_hooks_pushed(PyObject*, PyObject*) {
  return PyBool_FromLong(attnstash::saved_tensor_hooks_pushed());
}

static PyMethodDef attnstash_methods[] = {
    {"inside_backward", inside_backward, METH_NOARGS, "Whether a backward pass runs on this thread."},
    {"saved_tensor_hooks_pushed", saved_tensor_hooks_pushed, METH_NOARGS,
     "Whether saved-tensor hooks are pushed on this thread (a non-reentrant checkpoint's, offloading's)."},
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
