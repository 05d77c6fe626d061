// sdpa_stash.h: what the device kernels do: keep a first forward, take it back for a
// recompute, and run the kept backend's backward. The phase rules live here too, so
// they are stated once.
#pragma once

#include "sdpa_backend.h"
#include "stash.h"

#include <torch/library.h>

namespace attnstash {

// Where an attention call stands. Nothing is kept unless the anchor requires grad (and
// never in inference mode); then:
enum class Phase {
  plain,          // anything else: exactly F.sdpa, nothing kept
  first_forward,  // grad off, outside backward: a reentrant checkpoint's first forward; keep
  graph_forward,  // grad on, outside backward, under saved-tensor hooks (a non-reentrant
                  // checkpoint's first forward): keep, behind a node that takes it in backward
  recompute,      // grad on, inside a backward pass: the recompute of a kept forward
};
Phase phase_of(const at::Tensor& anchor);

// Exactly torch.nn.functional.scaled_dot_product_attention.
at::Tensor sdpa_plain(const SdpaCall& call);

// The mask F.sdpa hands `backend`: a boolean mask (true = attend) becomes an additive one
// in the query's dtype, 0 where true and backend.masked_out where false; others pass through.
std::optional<at::Tensor> fused_attn_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query,
                                          const SdpaBackend& backend);

// Run the forward F.sdpa would run, with its log-sum-exp, keep it for (anchor, slot) and
// return the output. Fails clearly if that forward's backend cannot be kept.
// `with_graph`: kept for a node of this forward's own graph (Phase::graph_forward).
at::Tensor keep_forward(const SdpaCall& call, const at::Tensor& anchor, int64_t slot, bool with_graph);

// Take the entry for (anchor, slot) and check that this call is the recompute of it.
// `check_backend`: also that PyTorch would still choose the kept backend for it.
std::unique_ptr<KeptEntry> take_for_replay(const SdpaCall& call, const at::Tensor& anchor, int64_t slot,
                                           bool check_backend = true);

// The output kept for (anchor, slot) with a graph, checked against this call and left
// held: a non-reentrant recompute only refills what the first forward's node saved.
at::Tensor output_for_recompute(const SdpaCall& call, const at::Tensor& anchor, int64_t slot);

// Whether the entry held for (anchor, slot) was kept behind a graph node.
bool kept_with_graph(const at::Tensor& anchor, int64_t slot);

// The kernels of sdpa_fwd_keep, sdpa_replay, _replay_take and _replay_backward below
// autograd. They are the same for every device (the backend table knows the devices);
// sdpa_cpu.cpp and sdpa_cuda.cpp register them for their dispatch key.
void register_device_kernels(torch::Library& m);

}  // namespace attnstash
