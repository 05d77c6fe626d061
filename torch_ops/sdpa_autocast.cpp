// The AutocastCPU and AutocastCUDA dispatch keys: under torch.autocast the attention ops see their
// inputs as F.scaled_dot_product_attention does. F.sdpa is on autocast's lower-precision
// list: every floating query, key, value and mask on the autocast device (float64 aside)
// is cast to the autocast dtype before any backend is chosen. The anchor is not cast: it
// identifies the forward, and a cast would be a new tensor.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace attnstash {
namespace {

using SdpaOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                          const std::optional<at::Tensor>&, double, bool, std::optional<double>, bool);

// The ops autocast casts for, by the names their kernels below look up.
constexpr char kSdpaFwdKeep[] = "attnstash::sdpa_fwd_keep";
constexpr char kSdpaReplay[] = "attnstash::sdpa_replay";
constexpr char kSdpaCompiled[] = "attnstash::_sdpa_compiled";

// Op `name`'s autocast kernel on `device`: cast, then call the op below autocast.
template <c10::DeviceType device, const char* name>
at::Tensor call_cast(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& anchor,
                     int64_t slot, const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  at::ScalarType dtype = at::autocast::get_autocast_dtype(device);
  auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(dtype, t, device); };
  std::optional<at::Tensor> mask;
  if (attn_mask.has_value()) mask = cast(*attn_mask);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<SdpaOp>();
  return op.call(cast(query), cast(key), cast(value), anchor, slot, mask, dropout_p, is_causal, scale, enable_gqa);
}

template <c10::DeviceType device>
void register_casts(torch::Library& m) {
  m.impl("sdpa_fwd_keep", &call_cast<device, kSdpaFwdKeep>);
  m.impl("sdpa_replay", &call_cast<device, kSdpaReplay>);
  m.impl("_sdpa_compiled", &call_cast<device, kSdpaCompiled>);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnstash, AutocastCPU, m) { register_casts<c10::DeviceType::CPU>(m); }
TORCH_LIBRARY_IMPL(attnstash, AutocastCUDA, m) { register_casts<c10::DeviceType::CUDA>(m); }

}  // namespace attnstash
