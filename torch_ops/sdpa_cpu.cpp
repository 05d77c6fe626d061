// The CPU dispatch key. Kept here: CPU flash attention (backends/cpu_flash.cpp).
#include "sdpa_stash.h"

TORCH_LIBRARY_IMPL(attnstash, CPU, m) { attnstash::register_device_kernels(m); }
