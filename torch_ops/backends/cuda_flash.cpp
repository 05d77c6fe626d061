// CUDA flash attention: _scaled_dot_product_flash_attention and its derivative.
#include "sdpa_backend.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace attnstash {
namespace {

// F.sdpa pads head_dim to a multiple of 8 for this kernel and slices the output back,
// and passes the scale computed from the unpadded head_dim explicitly. The padding is
// not reproduced here: such head sizes are refused.
double flash_scale(const SdpaCall& c) {
  return c.scale.has_value() ? *c.scale
                              : 1.0 / std::sqrt(static_cast<double>(c.query.sym_size(-1).guard_int(__FILE__, __LINE__)));
}

KeptAttention cuda_flash_forward(const SdpaCall& c) {
  // (Sizes as SymInts: the fake kernels run this under torch.compile's dynamic shapes.)
  TORCH_CHECK(c.query.sym_size(-1) % 8 == 0 && c.value.sym_size(-1) % 8 == 0,
              "attnstash: flash attention with head_dim ", c.query.sym_size(-1),
              " (not a multiple of 8) is not kept: F.sdpa pads and slices it around the kernel. "
              "Use a head_dim that is a multiple of 8, another backend via torch.nn.attention.sdpa_kernel(...), "
              "or do not stash this layer.");
  auto out = at::_scaled_dot_product_flash_attention(c.query, c.key, c.value, c.dropout_p, c.is_causal,
                                                     /*return_debug_mask=*/false, flash_scale(c));
  TORCH_CHECK(!std::get<2>(out).defined() && !std::get<3>(out).defined(),
              "attnstash: flash attention returned cumulative sequence lengths for dense inputs; "
              "this torch build cannot be used to keep it. Please report it with `python -m attnstash.info`.");
  KeptAttention kept;
  kept.output = std::get<0>(out);
  kept.logsumexp = std::get<1>(out);
  // (Symbolic only on the fake tensors of a trace with dynamic shapes, whose shapes do not depend
  // on them: kept_backends.cpp, _backend_forward. A guard there would specialise the trace.)
  kept.max_q = std::get<4>(out).maybe_as_int().value_or(0);
  kept.max_k = std::get<5>(out).maybe_as_int().value_or(0);
  kept.extra = {std::get<6>(out), std::get<7>(out)};  // rng_state, unused
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_flash_backward(const at::Tensor& grad, const SdpaCall& c,
                                                                   const KeptAttention& k) {
  // derivatives.yaml: _scaled_dot_product_flash_attention_backward(grad, query, key, value, output,
  //   logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, scale)
  //   (the forward's cum_seq_q/cum_seq_k are undefined for dense inputs)
  return at::_scaled_dot_product_flash_attention_backward(grad, c.query, c.key, c.value, k.output, k.logsumexp,
                                                          at::Tensor(), at::Tensor(), k.max_q, k.max_k, c.dropout_p,
                                                          c.is_causal, k.extra[0], k.extra[1], flash_scale(c));
}

}  // namespace

// (Flash takes no mask: masked_out is never used.)
const SdpaBackend cuda_flash_backend = {
    c10::DeviceType::CUDA, at::SDPBackend::flash_attention, "flash_attention",
    /*forward_op=*/"_scaled_dot_product_flash_attention", /*masked_out=*/-std::numeric_limits<double>::infinity(),
    cuda_flash_forward, cuda_flash_backward};
ATTNSTASH_KEPT_BACKEND(cuda_flash_backend);

}  // namespace attnstash
