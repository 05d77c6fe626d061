// cuDNN attention: _scaled_dot_product_cudnn_attention and its derivative.
#include "sdpa_backend.h"

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <limits>

namespace attnstash {
namespace {

// Note: always ask for the log-sum-exp. F.sdpa asks for it only when an input
// requires grad under grad mode, which never holds in a reentrant checkpoint's
// first forward; cuDNN's backward does not check, and an empty LSE would give
// it uninitialised memory to differentiate against.
KeptAttention cudnn_forward(const SdpaCall& c) {
  auto out = at::_scaled_dot_product_cudnn_attention(c.query, c.key, c.value, c.attn_mask,
                                                     /*compute_log_sumexp=*/true, c.dropout_p, c.is_causal,
                                                     /*return_debug_mask=*/false, c.scale);
  KeptAttention kept;
  kept.output = std::get<0>(out);
  kept.logsumexp = std::get<1>(out);
  TORCH_CHECK(kept.logsumexp.defined() && kept.logsumexp.sym_numel() > 0,
              "attnstash: cuDNN attention returned no log-sum-exp although it was asked for one; "
              "this torch build cannot be used to keep cuDNN attention. Please report it with `python -m attnstash.info`.");
  // cum_seq_q/cum_seq_k are only defined for nested (jagged) inputs, which are not kept.
  TORCH_CHECK(!std::get<2>(out).defined() && !std::get<3>(out).defined(),
              "attnstash: cuDNN attention returned cumulative sequence lengths for dense inputs; "
              "this torch build cannot be used to keep cuDNN attention. Please report it with `python -m attnstash.info`.");
  kept.extra = {std::get<6>(out), std::get<7>(out)};  // philox_seed, philox_offset
  // (Symbolic only on the fake tensors of a trace with dynamic shapes, whose shapes do not depend
  // on them: kept_backends.cpp, _backend_forward. A guard there would specialise the trace.)
  kept.max_q = std::get<4>(out).maybe_as_int().value_or(0);
  kept.max_k = std::get<5>(out).maybe_as_int().value_or(0);
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cudnn_backward(const at::Tensor& grad, const SdpaCall& c,
                                                              const KeptAttention& k) {
  // derivatives.yaml: _scaled_dot_product_cudnn_attention_backward(grad, query, key, value, output,
  //   logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
  //   dropout_p, is_causal, scale)
  //   (cum_seq_q and cum_seq_k are the forward's, undefined for dense inputs)
  const at::Tensor& philox_seed = k.extra[0];
  const at::Tensor& philox_offset = k.extra[1];
  return at::_scaled_dot_product_cudnn_attention_backward(
      grad, c.query, c.key, c.value, k.output, k.logsumexp, philox_seed, philox_offset,
      c.attn_mask.value_or(at::Tensor()), at::Tensor(), at::Tensor(), k.max_q, k.max_k, c.dropout_p, c.is_causal,
      c.scale);
}

}  // namespace

// Read off the torch binaries (libtorch_cpu.so, at::native::scaled_dot_product_attention),
// every release from 2.5 to 2.15: torch 2.6 to 2.11 turn a boolean mask into an additive
// one for cuDNN with -65504 where it is false (their convert_boolean_attn_mask_cudnn; -inf
// for every other backend); torch 2.5, and 2.12 to 2.15, have no such converter and use
// -inf for cuDNN too. The library is built for one torch.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6 && TORCH_VERSION_MINOR <= 11
constexpr double cudnn_masked_out = -65504.0;
#else
constexpr double cudnn_masked_out = -std::numeric_limits<double>::infinity();
#endif

const SdpaBackend cudnn_backend = {
    c10::DeviceType::CUDA, at::SDPBackend::cudnn_attention, "cudnn_attention",
    /*forward_op=*/"_scaled_dot_product_cudnn_attention", /*masked_out=*/cudnn_masked_out,
    cudnn_forward, cudnn_backward};
ATTNSTASH_KEPT_BACKEND(cudnn_backend);

}  // namespace attnstash
