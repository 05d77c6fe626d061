// schemas.cpp: every op attnstash defines, one comment each. Start reading here.
//
// Note on `anchor`: tensors computed inside a checkpointed region (query, key, value)
// are new allocations in the recompute, and the caching allocator reuses addresses,
// so they cannot identify a forward. The decoder layer's input can: a reentrant
// recompute receives a detached alias of it (same storage, data pointer and version
// counter). A recompute therefore takes only what its own first forward kept.
#include <torch/library.h>

#include "stash.h"

TORCH_LIBRARY(attnstash, m) {
  // Fake (meta) kernels live in Python, in attnstash/ops.py.
  m.set_python_module("attnstash.ops");

  // F.scaled_dot_product_attention that, in a reentrant checkpoint's first forward
  // (grad off, anchor requires grad), keeps its output and log-sum-exp under
  // (anchor, slot), and in the recompute (grad on, inside backward) replays them.
  m.def(
      "sdpa_fwd_keep(Tensor query, Tensor key, Tensor value, Tensor anchor, int slot, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False) -> Tensor");
  // Takes what sdpa_fwd_keep kept for (anchor, slot) and returns it as a node whose
  // backward is the kept backend's derivative. Never runs the attention forward.
  m.def(
      "sdpa_replay(Tensor query, Tensor key, Tensor value, Tensor anchor, int slot, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False) -> Tensor");

  // The two halves of sdpa_replay's autograd node, as ops so that torch.compile can
  // trace it: the take (kept output, log-sum-exp, CPU int64 [backend, max_q, max_k,
  // bitmask of defined extras], and the backend's extra tensors) ...
  m.def(
      "_replay_take(Tensor query, Tensor key, Tensor value, Tensor anchor, int slot, Tensor? attn_mask, "
      "float dropout_p, bool is_causal, float? scale, bool enable_gqa) -> (Tensor output, Tensor logsumexp, "
      "Tensor info, Tensor[] extra)");
  // ... and the kept backend's backward, called with the arguments PyTorch's derivative passes
  // (attn_mask is the caller's: a boolean one is made additive as for the kept forward).
  m.def(
      "_replay_backward(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor output, "
      "Tensor logsumexp, Tensor info, Tensor[] extra, float dropout_p, bool is_causal, float? scale, bool enable_gqa) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");

  // The stash itself, for attnstash.stash_stats() and friends (Python: attnstash/ops.py).
  // [entries, bytes, peak_bytes, keeps, replays, misses, released_unused]
  m.def("stash_stats() -> int[]", &attnstash::stats_counters);
  // Releases every kept entry; returns how many.
  m.def("stash_clear() -> int", &attnstash::clear_entries);
  // Releases every entry of the anchor with this data pointer (it has been freed); returns how many.
  m.def("stash_release_anchor(int data_ptr) -> int", &attnstash::release_anchor_entries);
  // [slot, entries, bytes] for each slot that holds something.
  m.def("stash_held_by_slot() -> int[]", &attnstash::held_by_slot);
  // Sets peak_bytes to the bytes held now.
  m.def("stash_reset_peak() -> ()", &attnstash::reset_peak_bytes);
}
