// The CUDA dispatch key. Kept here: cuDNN, flash and memory-efficient attention
// (backends/cudnn.cpp, cuda_flash.cpp, efficient.cpp). Only ATen
// calls: no CUDA headers, so this builds against CPU and CUDA torch wheels alike.
#include "sdpa_stash.h"

TORCH_LIBRARY_IMPL(attnstash, CUDA, m) { attnstash::register_device_kernels(m); }
