// The table of backends attnstash can keep: each backend's file adds itself with
// ATTNSTASH_KEPT_BACKEND (see README.md here).
#include "sdpa_backend.h"

namespace attnstash {
namespace {

std::vector<const SdpaBackend*>& table() {
  static std::vector<const SdpaBackend*> backends;  // filled while the library loads
  return backends;
}

}  // namespace

KeptBackendRegistration::KeptBackendRegistration(const SdpaBackend& backend) { table().push_back(&backend); }

const std::vector<const SdpaBackend*>& kept_backends() { return table(); }

std::vector<std::string> kept_backend_rows() {
  std::vector<std::string> rows;
  for (const SdpaBackend* b : table())
    rows.push_back(std::string(b->device == c10::DeviceType::CPU ? "cpu" : "cuda") + ":" +
                   std::to_string(static_cast<int64_t>(b->id)) + ":" + b->name);
  return rows;
}

const SdpaBackend* find_kept_backend(c10::DeviceType device, int64_t id) {
  for (const SdpaBackend* b : table())
    if (b->device == device && static_cast<int64_t>(b->id) == id) return b;
  return nullptr;
}

const char* sdpa_backend_name(int64_t id) {
  switch (static_cast<at::SDPBackend>(id)) {
    case at::SDPBackend::error: return "none (no backend accepts these inputs)";
    case at::SDPBackend::math: return "math";
    case at::SDPBackend::flash_attention: return "flash_attention";
    case at::SDPBackend::efficient_attention: return "efficient_attention";
    case at::SDPBackend::cudnn_attention: return "cudnn_attention";
    case at::SDPBackend::overrideable: return "overrideable";
  }
  return "unknown";
}

}  // namespace attnstash
