// The CPU and CUDA dispatch keys: the kernels of sdpa_fwd_keep, sdpa_replay, _replay_take and
// _replay_backward below autograd. They are the same for every device (the backend table
// knows the devices): CPU keeps CPU flash attention, CUDA keeps cuDNN, flash and
// memory-efficient attention (torch_ops/backends/). Only ATen calls: no CUDA headers, so
// this builds against CPU and CUDA torch wheels alike.
#include "keep_replay.h"

#include <torch/library.h>

namespace attnstash {
namespace {

at::Tensor sdpa_fwd_keep_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                                double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  if (phase_of(call, anchor) == Phase::reentrant_first_forward)
    return keep_forward(call, anchor, slot, /*non_reentrant=*/false).attention.output;
  return sdpa_plain(call);
}

// The attention of a taken record: the kept one, or (declined, demoted) the backend's forward run now.
KeptAttention attention_of(const PayloadPtr& e, const SdpaCall& call) {
  if (e->kept() == nullptr) return run_forward(*e->call.backend, call);
  KeptAttention kept = e->kept()->attention;
  // Still held by another forward that shares the record: hand out an alias, so that each
  // recompute's node gets a tensor of its own.
  if (e.use_count() > 1) kept.output = kept.output.detach();
  return kept;
}

// Without autograd a replay is only the take: the kept output, checked against this call.
at::Tensor sdpa_replay_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                              double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  if (is_empty(call)) return sdpa_plain(call);  // never kept, so never replayed
  return attention_of(take_for_replay(call, anchor, slot), call).output;
}

using Taken = std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>>;

// What a node's forward takes, as ops return it: output, log-sum-exp, CPU int64 [backend,
// max_q, max_k, bitmask of defined extras], extras.
Taken as_taken(KeptAttention kept, const at::Tensor& query) {
  // A Tensor[] cannot hold undefined tensors: stand in empty ones and record which.
  int64_t defined = 0;
  for (size_t i = 0; i < kept.extra.size(); ++i) {
    if (kept.extra[i].defined()) defined |= int64_t{1} << i;
    else kept.extra[i] = at::empty({0}, query.options().dtype(at::kByte));
  }
  at::Tensor info =
      at::tensor({static_cast<int64_t>(kept.backend->id), kept.max_q, kept.max_k, defined}, at::kLong);
  return {kept.output, kept.logsumexp, info, kept.extra};
}

Taken replay_take_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                         double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  return as_taken(attention_of(take_for_replay(call, anchor, slot), call), query);
}

// The attention of a compiled call, by its phase when the graph runs (compiled_phase_of).
KeptAttention compiled_attention(const SdpaCall& call, const at::Tensor& anchor, int64_t slot, Phase phase) {
  switch (phase) {
    case Phase::recompute:
      return attention_of(take_for_replay(call, anchor, slot), call);
    case Phase::non_reentrant_first_forward:
    case Phase::reentrant_first_forward:
      // Held for the anchor's life, as a reentrant first forward's: its recompute takes it.
      return keep_forward(call, anchor, slot, /*non_reentrant=*/false).attention;
    case Phase::plain:
      break;
  }
  return run_kept_backend(call, "_sdpa_compiled");
}

Taken keep_or_take_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                          double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  return as_taken(compiled_attention(call, anchor, slot, compiled_phase_of(call, anchor)), query);
}

// Without autograd (a graph traced with grad off: a reentrant checkpoint's first forward).
at::Tensor sdpa_compiled_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                                double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  Phase phase = compiled_phase_of(call, anchor);
  if (phase == Phase::plain) return sdpa_plain(call);  // no node: no log-sum-exp needed
  return compiled_attention(call, anchor, slot, phase).output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> replay_backward_kernel(
    const at::Tensor& grad, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& logsumexp,
    const at::Tensor& info, at::TensorList extra, double dropout_p, bool is_causal, std::optional<double> scale,
    bool enable_gqa) {
  TORCH_CHECK(info.device().is_cpu() && info.scalar_type() == at::kLong && info.numel() == 4,
              "attnstash::_replay_backward: info must be the CPU int64 [backend, max_q, max_k, defined extras] "
              "that _replay_take returned, got ", info.scalar_type(), info.sizes(), " on ", info.device());
  const int64_t* i = info.data_ptr<int64_t>();
  KeptAttention kept;
  kept.backend = find_kept_backend(query.device().type(), i[0]);
  TORCH_CHECK(kept.backend != nullptr, "attnstash::_replay_backward: no kept backend ", sdpa_backend_name(i[0]),
              " on ", query.device().type());
  kept.output = output;
  kept.logsumexp = logsumexp;
  kept.extra = extra.vec();
  for (size_t e = 0; e < kept.extra.size(); ++e)
    if (!(i[3] >> e & 1)) kept.extra[e] = at::Tensor();
  kept.max_q = i[1];
  kept.max_k = i[2];
  // (enable_gqa is no argument of any fused backward: K/V heads come from the shapes.)
  // The backward gets the mask as the kept forward got it (a boolean one made additive).
  return run_backward(grad, {query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa}, kept);
}

void register_device_kernels(torch::Library& m) {
  m.impl("sdpa_fwd_keep", &sdpa_fwd_keep_kernel);
  m.impl("sdpa_replay", &sdpa_replay_kernel);
  m.impl("_replay_take", &replay_take_kernel);
  m.impl("_replay_backward", &replay_backward_kernel);
  m.impl("_sdpa_compiled", &sdpa_compiled_kernel);
  m.impl("_keep_or_take", &keep_or_take_kernel);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnstash, CPU, m) { register_device_kernels(m); }
TORCH_LIBRARY_IMPL(attnstash, CUDA, m) { register_device_kernels(m); }
// Nested (strided) tensors: plain calls are F.sdpa's, and a keep says why it cannot be.
TORCH_LIBRARY_IMPL(attnstash, NestedTensorCPU, m) { register_device_kernels(m); }
TORCH_LIBRARY_IMPL(attnstash, NestedTensorCUDA, m) { register_device_kernels(m); }

}  // namespace attnstash
