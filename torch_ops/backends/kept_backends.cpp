// The table of backends attnstash can keep. One line per backend.
#include "sdpa_backend.h"

namespace attnstash {

namespace {
const SdpaBackend* const table[] = {
    &cpu_flash_backend,   // CPU: _scaled_dot_product_flash_attention_for_cpu
    &cudnn_backend,       // CUDA: _scaled_dot_product_cudnn_attention
    &cuda_flash_backend,  // CUDA: _scaled_dot_product_flash_attention
    &efficient_backend,   // CUDA: _scaled_dot_product_efficient_attention
};
}  // namespace

c10::ArrayRef<const SdpaBackend*> kept_backends() { return table; }

const SdpaBackend* find_kept_backend(c10::DeviceType device, int64_t id) {
  for (const SdpaBackend* b : table)
    if (b->device == device && b->id == id) return b;
  return nullptr;
}

const char* sdpa_backend_name(int64_t id) {
  switch (id) {
    case -1: return "none (no backend accepts these inputs)";
    case 0: return "math";
    case 1: return "flash_attention";
    case 2: return "efficient_attention";
    case 3: return "cudnn_attention";
    case 4: return "overrideable";
    default: return "unknown";
  }
}

}  // namespace attnstash
