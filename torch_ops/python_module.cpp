// python_module.cpp: `import attnstash._C` loads this library, which registers the
// ops (schemas.cpp and the sdpa_*.cpp kernels) by static initialisation. No pybind.
#include <Python.h>

// Read from the file by attnstash/_library.py before loading, to explain a torch mismatch.
extern "C" __attribute__((used)) const char attnstash_built_for_torch[] =
    "attnstash-built-for-torch:" ATTNSTASH_TORCH_VERSION ";";

static struct PyModuleDef attnstash_module = {PyModuleDef_HEAD_INIT, "_C", "attnstash's torch ops", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&attnstash_module);
  if (module != nullptr && PyModule_AddStringConstant(module, "torch_version", ATTNSTASH_TORCH_VERSION) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
