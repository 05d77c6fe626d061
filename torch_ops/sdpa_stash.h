// sdpa_stash.h: what the device kernels do: keep a first forward, take it back for a
// recompute, and run the kept backend's backward. The phase rules live here too, so
// they are stated once.
#pragma once

#include "sdpa_backend.h"
#include "stash.h"

#include <torch/library.h>

namespace attnstash {

// A first forward inside a reentrant checkpoint: grad mode off, not inside a backward
// pass (nor inference mode), and an anchor that requires grad. Only then is anything kept.
bool is_first_forward(const at::Tensor& anchor);

// A reentrant recompute: grad mode on, inside a backward pass, anchor requires grad.
bool is_recompute(const at::Tensor& anchor);

// Exactly torch.nn.functional.scaled_dot_product_attention.
at::Tensor sdpa_plain(const SdpaCall& call);

// The mask F.sdpa hands the fused ops: a boolean mask (true = attend) becomes an additive
// one in the query's dtype, 0 where true and -inf where false; others pass through.
std::optional<at::Tensor> fused_attn_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query);

// Run the forward F.sdpa would run, with its log-sum-exp, keep it for (anchor, slot) and
// return the output. Fails clearly if that forward's backend cannot be kept.
at::Tensor keep_forward(const SdpaCall& call, const at::Tensor& anchor, int64_t slot);

// Take the entry for (anchor, slot) and check that this call is the recompute of it.
std::unique_ptr<KeptEntry> take_for_replay(const SdpaCall& call, const at::Tensor& anchor, int64_t slot);

// The kernels of sdpa_fwd_keep, sdpa_replay, _replay_take and _replay_backward below
// autograd. They are the same for every device (the backend table knows the devices);
// sdpa_cpu.cpp and sdpa_cuda.cpp register them for their dispatch key.
void register_device_kernels(torch::Library& m);

}  // namespace attnstash
