// The table of backends attnstash can keep: each backend's file adds itself with
// ATTNSTASH_KEPT_BACKEND (see README.md here). Python reads it (attnstash/backends.py) and
// calls each backend's forward and backward through the two ops registered at the end.
#include "keep_replay.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

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
                   std::to_string(static_cast<int64_t>(b->id)) + ":" + b->name + ":" + b->forward_op);
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

namespace {

const SdpaBackend& backend_named(c10::string_view device, int64_t id, const char* op) {
  const SdpaBackend* b = find_kept_backend(c10::Device(std::string(device)).type(), id);
  TORCH_CHECK(b != nullptr, "attnstash::", op, ": no kept backend ", sdpa_backend_name(id), " on ", device,
              " (stash_kept_backends() lists them)");
  return *b;
}

// The backend's forward as the kept path runs it (the mask made as F.sdpa makes it), with
// no check of the call: for the shapes of what it returns (fake kernels, the planner's kept
// bytes, on meta or fake tensors) and for the refusals of its own (a TORCH_CHECK in forward).
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> backend_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, std::optional<double> scale, c10::string_view device, int64_t backend) {
  KeptAttention kept = run_forward(backend_named(device, backend, "_backend_forward"),
                                   {query, key, value, attn_mask, 0.0, is_causal, scale, false});
  return {kept.output, kept.logsumexp, kept.extra};
}

// The backend's backward, for its shapes (fake kernels): max_q and max_k, which no shape
// depends on, are 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backend_backward(
    const at::Tensor& grad, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& logsumexp,
    at::TensorList extra, bool is_causal, std::optional<double> scale, c10::string_view device, int64_t backend) {
  KeptAttention kept{&backend_named(device, backend, "_backend_backward"), output, logsumexp, extra.vec(), 0, 0};
  return run_backward(grad, {query, key, value, attn_mask, 0.0, is_causal, scale, false}, kept);
}

}  // namespace

// Composite: on meta and fake tensors they run the backend's aten calls, whose own meta
// kernels give every shape, dtype and stride.
TORCH_LIBRARY_IMPL(attnstash, CompositeImplicitAutograd, m) {
  m.impl("_backend_forward", &backend_forward);
  m.impl("_backend_backward", &backend_backward);
}

}  // namespace attnstash
