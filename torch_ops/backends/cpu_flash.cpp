// CPU flash attention: _scaled_dot_product_flash_attention_for_cpu and its derivative.
#include "sdpa_backend.h"

#include <limits>

namespace attnstash {
namespace {

KeptAttention cpu_flash_forward(const SdpaCall& c) {
  // The call F.sdpa makes on CPU (no head-dim padding on this device).
  auto [output, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(
      c.query, c.key, c.value, c.dropout_p, c.is_causal, c.attn_mask, c.scale);
  KeptAttention kept;
  kept.output = output;
  kept.logsumexp = logsumexp;
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_flash_backward(const at::Tensor& grad, const SdpaCall& c,
                                                                  const KeptAttention& k) {
  // derivatives.yaml: _scaled_dot_product_flash_attention_for_cpu_backward(grad, query, key,
  //   value, output, logsumexp, dropout_p, is_causal, attn_mask, scale)
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(
      grad, c.query, c.key, c.value, k.output, k.logsumexp, c.dropout_p, c.is_causal, c.attn_mask, c.scale);
}

}  // namespace

const SdpaBackend cpu_flash_backend = {
    c10::DeviceType::CPU, at::SDPBackend::flash_attention, "flash_attention (CPU)",
    /*forward_op=*/"_scaled_dot_product_flash_attention_for_cpu", /*masked_out=*/-std::numeric_limits<double>::infinity(),
    cpu_flash_forward, cpu_flash_backward};
ATTNSTASH_KEPT_BACKEND(cpu_flash_backend);

}  // namespace attnstash
