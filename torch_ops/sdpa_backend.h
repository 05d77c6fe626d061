// sdpa_backend.h: what one fused SDPA backend must provide to be kept and replayed.
//
// A backend is a forward that runs exactly the call F.scaled_dot_product_attention
// makes for it (always computing the log-sum-exp), and a backward that is exactly
// the call PyTorch's derivative for that forward makes (tools/autograd/derivatives.yaml).
// Adding a backend: torch_ops/backends/README.md.
#pragma once

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>  // at::SDPBackend, as at::_fused_sdp_choice returns it

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace attnstash {

// The arguments of one SDPA call, as F.scaled_dot_product_attention takes them. (Held by
// value: a call outlives the expressions that build it.)
struct SdpaCall {
  at::Tensor query;  // [batch, heads, seq_q, head_dim]
  at::Tensor key;    // [batch, kv_heads, seq_k, head_dim]
  at::Tensor value;  // [batch, kv_heads, seq_k, head_dim_v]
  std::optional<at::Tensor> attn_mask;
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  bool enable_gqa;
};

struct SdpaBackend;

// What a first forward keeps: the output, its log-sum-exp, and whatever else the
// backend's backward is given by PyTorch's derivative.
struct KeptAttention {
  const SdpaBackend* backend = nullptr;
  at::Tensor output;
  at::Tensor logsumexp;
  std::vector<at::Tensor> extra;  // backend-specific tensors the backward takes (philox seed/offset, ...)
  int64_t max_q = 0;
  int64_t max_k = 0;
};

struct SdpaBackend {
  c10::DeviceType device;
  at::SDPBackend id;  // torch.nn.attention.SDPBackend: what at::_fused_sdp_choice returns for it
  const char* name;  // as PyTorch names it
  // The aten op `forward` calls, as torch.ops.aten names it (what selective activation
  // checkpointing saves; attnstash/backends.py reads it from kept_backend_rows).
  const char* forward_op;
  // The additive value F.sdpa puts where a boolean mask is false before it calls this
  // backend (it puts 0 where the mask is true), in the query's dtype.
  double masked_out;
  KeptAttention (*forward)(const SdpaCall& call);
  // Gradients for query, key and value; `grad` is defined.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*backward)(const at::Tensor& grad, const SdpaCall& call,
                                                             const KeptAttention& kept);
};

// The name PyTorch gives an SDPBackend value, as at::_fused_sdp_choice returns it (for
// error messages).
const char* sdpa_backend_name(int64_t id);

// Every backend attnstash can keep: those registered with ATTNSTASH_KEPT_BACKEND
// (backends/kept_backends.cpp holds the table).
const std::vector<const SdpaBackend*>& kept_backends();

// kept_backends() as "device:SDPBackend value:name:forward_op" strings (cpu or cuda): what
// attnstash/backends.py knows of them (it calls forward and backward through the ops
// _backend_forward and _backend_backward, kept_backends.cpp).
std::vector<std::string> kept_backend_rows();

// The kept backend with this SDPBackend value (as at::_fused_sdp_choice returns it) on
// this device, or nullptr.
const SdpaBackend* find_kept_backend(c10::DeviceType device, int64_t id);

// Adds a backend to the table at load time; ATTNSTASH_KEPT_BACKEND(name) in its file.
struct KeptBackendRegistration {
  explicit KeptBackendRegistration(const SdpaBackend& backend);
};
#define ATTNSTASH_KEPT_BACKEND(backend) static const KeptBackendRegistration backend##_registration(backend)

}  // namespace attnstash
