// CUDA memory-efficient attention: _scaled_dot_product_efficient_attention and its derivative.
#include "sdpa_backend.h"

#include <limits>

namespace attnstash {
namespace {

// F.sdpa hands this kernel its mask as a bias of shape [batch, heads, seq_q, seq_k], and
// first re-lays it out unless every stride but the last is a multiple of 8 and the last is
// 1: it pads the last dimension by 8 - seq_k % 8 and slices it back (read off the torch
// 2.11 and 2.13 binaries, at::native::scaled_dot_product_attention). The values are the
// mask's; only the layout changes, and it is the same here.
std::optional<at::Tensor> efficient_bias(const SdpaCall& c) {
  if (!c.attn_mask.has_value()) return std::nullopt;
  // (Sizes and strides as SymInts: the fake kernels run this under torch.compile's dynamic shapes.)
  at::Tensor bias = *c.attn_mask;
  constexpr int64_t alignment = 8;
  bool aligned = bias.sym_stride(-1) == 1;
  for (int64_t d = 0; d < bias.dim() - 1; ++d) aligned = aligned && bias.sym_stride(d) % alignment == 0;
  if (!aligned) {
    c10::SymInt last = bias.sym_size(-1);
    bias = at::pad_symint(bias, {0, alignment - last % alignment}).slice_symint(-1, 0, last);
  }
  return bias.expand_symint({c.query.sym_size(0), c.query.sym_size(1), c.query.sym_size(2), c.key.sym_size(2)});
}

KeptAttention efficient_forward(const SdpaCall& c) {
  auto out = at::_scaled_dot_product_efficient_attention(c.query, c.key, c.value, efficient_bias(c),
                                                         /*compute_log_sumexp=*/true, c.dropout_p, c.is_causal,
                                                         c.scale);
  KeptAttention kept;
  kept.output = std::get<0>(out);
  kept.logsumexp = std::get<1>(out);
  kept.extra = {std::get<2>(out), std::get<3>(out)};  // philox_seed, philox_offset
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> efficient_backward(const at::Tensor& grad, const SdpaCall& c,
                                                                  const KeptAttention& k) {
  // derivatives.yaml: _scaled_dot_product_efficient_attention_backward(grad, query, key, value,
  //   attn_bias, output, log_sumexp, philox_seed, philox_offset, dropout_p, grad_input_mask,
  //   is_causal, scale); grad_input_mask is which of query, key, value, attn_bias need a
  //   gradient (the kept path refuses masks that require grad).
  auto grads = at::_scaled_dot_product_efficient_attention_backward(
      grad, c.query, c.key, c.value, efficient_bias(c).value_or(at::Tensor()), k.output, k.logsumexp, k.extra[0],
      k.extra[1], c.dropout_p, {true, true, true, false}, c.is_causal, c.scale);
  return {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads)};
}

}  // namespace

const SdpaBackend efficient_backend = {
    c10::DeviceType::CUDA, at::SDPBackend::efficient_attention, "efficient_attention",
    /*forward_op=*/"_scaled_dot_product_efficient_attention", /*masked_out=*/-std::numeric_limits<double>::infinity(),
    efficient_forward, efficient_backward};
ATTNSTASH_KEPT_BACKEND(efficient_backend);

}  // namespace attnstash
