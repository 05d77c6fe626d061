// keep_replay.h: keeping a first forward and taking it back for its recompute, for any
// device. The phase rules live here too, so that they are stated once.
#pragma once

#include "sdpa_backend.h"
#include "records.h"

#include <optional>
#include <string>

namespace attnstash {

// Where an attention call stands. An empty query, key or value (any size 0) is always
// plain, and nothing is kept in inference mode. Otherwise:
enum class Phase {
  plain,                        // anything else: exactly F.sdpa, nothing kept
  reentrant_first_forward,      // grad off, outside backward, the anchor requires grad, and
                                // no saved-tensor hooks, or a 0-dim anchor (a token held for
                                // one checkpoint call, which hooks that offload cannot copy:
                                // schemas.cpp): a reentrant checkpoint's first forward. Keep.
  non_reentrant_first_forward,  // grad on, outside backward, under saved-tensor hooks, and
                                // query, key or value requires grad: a non-reentrant
                                // checkpoint's first forward. Keep, behind a node whose
                                // backward takes it.
  recompute,                    // grad on, inside a backward pass, and query, key or value
                                // requires grad: the recompute of a kept forward.
};
Phase phase_of(const SdpaCall& call, const at::Tensor& anchor);

// The facts the rules above read from this thread's autograd state: whether a backward pass
// runs, and whether saved-tensor hooks are pushed (a non-reentrant checkpoint's, offloading's),
// and how many pairs (the installer's offload.py: whether any lies below a checkpoint's own).
bool inside_backward();
bool saved_tensor_hooks_pushed();
size_t saved_tensor_hooks_depth();

// The phase of one forward of a stashed layer (a frame: frames.h), the rule above read as the
// forward starts, before any attention call, from the same state. The frame opens by it
// (frames.h: whether its calls keep, what it owns), the installer checks and refuses by it
// (attnstash/install/core.py, run_frame), and each call is then still decided by phase_of.
// `outer_grad`: whether a backward can reach the layer's checkpoint, as seen from the call outside
// it (1 yes, 0 no, -1 where it cannot be seen): grad mode on there and one of the checkpoint's
// tensor inputs requiring grad, without which a reentrant checkpoint gives its output no node
// (attnstash/install/core.py, _outer_grad).
enum class FramePhase {
  recompute = 0,                // inside a backward pass, grad on: its calls replay.
  recompute_without_grad = 1,   // inside a backward pass, grad off: nothing to replay.
  reentrant_first = 2,          // outside backward, grad off, no saved-tensor hooks, and a
                                // backward can reach it (outer_grad not 0): keeps.
  reentrant_first_hooked = 3,   // the same under saved-tensor hooks (offloading around a
                                // reentrant checkpoint): its calls keep on a token anchor
                                // only (phase_of).
  non_reentrant_first = 4,      // outside backward, grad on, under saved-tensor hooks: keeps.
  unreachable = 5,              // grad off and outer_grad 0, or inference mode: no backward
                                // can reach it, nothing kept.
  outside_checkpoint = 6,       // outside backward, grad on, no saved-tensor hooks: no
                                // checkpoint runs it, so no recompute follows.
};
FramePhase frame_phase(int outer_grad);

// The phase of a call in a graph torch.compile traced inside an activation checkpoint that
// runs eagerly (attnstash::_sdpa_compiled), decided when the graph runs. Grad mode says
// nothing there (a compiled graph's forward runs with grad off), so: empty or in inference
// mode, plain; inside backward, recompute; under saved-tensor hooks, non_reentrant_first_forward;
// with an anchor that requires grad, reentrant_first_forward; anything else plain.
Phase compiled_phase_of(const SdpaCall& call, const at::Tensor& anchor);

// Whether query, key or value has a size 0: such a call is plain in every phase (and so
// is its replay), as F.sdpa returns for it.
bool is_empty(const SdpaCall& call);

// Exactly torch.nn.functional.scaled_dot_product_attention.
at::Tensor sdpa_plain(const SdpaCall& call);

// The mask F.sdpa hands `backend`: a boolean mask (true = attend) becomes an additive one
// in the query's dtype, 0 where true and backend.masked_out where false; others pass through.
std::optional<at::Tensor> fused_attn_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query,
                                          const SdpaBackend& backend);

// The backend's forward for this call, as F.sdpa would run it (the mask made as F.sdpa
// makes it), with its log-sum-exp.
KeptAttention run_forward(const SdpaBackend& backend, const SdpaCall& call);

// The gradients for query, key and value from kept.backend's backward for this call (the
// caller's mask, made as run_forward made it for the forward).
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const at::Tensor& grad, const SdpaCall& call,
                                                            const KeptAttention& kept);

// run_forward with the kept backend F.sdpa would choose, keeping nothing: a call whose node
// needs the log-sum-exp for its backward (_sdpa_compiled outside any checkpoint). Refused
// as keep_forward refuses (`op` names the op in the message).
KeptAttention run_kept_backend(const SdpaCall& call, const char* op);

// What a first forward kept.
struct KeptForward {
  KeptAttention attention;  // what the backend's forward computed (also when declined)
  stash_key key;
  uint64_t id = 0;          // the record held for it
  bool declined = false;    // the budget had no room: the recompute runs the forward itself
};

// Whether a non-reentrant node saves its attention's output, log-sum-exp and extras (as
// F.sdpa's own node does): for a record Declined when stored. Otherwise it saves query, key,
// value and mask only (Kept: the output is in the stash; Demoted: the recompute leaves it in
// the record).
bool node_saves_output(const Payload& record);

// Run the forward F.sdpa would run, with its log-sum-exp, and keep it for (anchor, slot),
// or a declined record if the budget has no room. Fails clearly (PyTorch's own error for
// inputs F.sdpa refuses) if the call cannot be kept. A forward that repeats one held for
// the same anchor and slot, bitwise, shares its record; one that differs is refused.
// `non_reentrant`: kept behind a node of this forward's own graph.
KeptForward keep_forward(const SdpaCall& call, const at::Tensor& anchor, int64_t slot, bool non_reentrant);

// Whether a recompute runs in a backward pass that keeps its graph (retain_graph=True): another
// backward through the same forward recomputes it again, so the two takes below leave its
// record held, for its owner to release (a token, a non-reentrant node, the layer input's
// storage: frames.h) or the last backward, which does not keep its graph, to take.
bool backward_keeps_graph();

// Take the recompute's record for (anchor, slot) and check that this call repeats its
// first forward. `check_backend`: also that PyTorch would still choose the kept backend.
PayloadPtr take_for_replay(const SdpaCall& call, const at::Tensor& anchor, int64_t slot, bool check_backend = true);

// Take the record `owner` holds for its forward (a non-reentrant node's backward) and
// check the call against it.
PayloadPtr take_owned(const SdpaCall& call, RecordOwner& owner);

// Whether the record held for (anchor, slot) was kept by a non-reentrant first forward.
bool held_by_non_reentrant(const at::Tensor& anchor, int64_t slot);

// The entry held for (anchor, slot) by a non-reentrant first forward, checked against this
// call and left held (a non-reentrant recompute only refills what its node saved), or null
// if the record there was kept by a reentrant forward.
PayloadPtr peek_for_recompute(const SdpaCall& call, const at::Tensor& anchor, int64_t slot);

}  // namespace attnstash
