// schemas.cpp: every op attnstash defines, one comment each. Start reading here.
//
// Note on `anchor`: tensors computed inside a checkpointed region (query, key, value)
// are new allocations in the recompute, and the caching allocator reuses addresses,
// so they cannot identify a forward. The decoder layer's input can: a reentrant
// recompute receives a detached alias of it (same storage, data pointer and version
// counter), a non-reentrant one the tensor itself. A recompute therefore takes only what
// its own first forward kept (or, when one anchor went through the same attention twice
// before either recompute, a forward that was bitwise the same). Where saved-tensor hooks
// offload the checkpoint's inputs, the recompute gets a copy of the layer input instead: a
// 0-dim tensor that the caller creates for one checkpoint call and holds until its recompute
// (a token, _new_token below) identifies the forward then (the installer's core.Run does), and its
// memory, freed with the caller's checkpoint, releases what is left under it.
//
// Kernels: sdpa_device.cpp (CPU, CUDA), sdpa_autograd.cpp (Autograd), sdpa_autocast.cpp
// (AutocastCPU, AutocastCUDA); the stash ops below are plain functions (records.cpp).
#include <torch/library.h>

#include "records.h"

TORCH_LIBRARY(attnstash, m) {
  // Fake (meta) kernels live in Python, in attnstash/ops.py.
  m.set_python_module("attnstash.ops");

  // F.scaled_dot_product_attention that, in an activation checkpoint's first forward,
  // keeps its output and log-sum-exp for (anchor, slot) (or a declined record where the budget
  // has no room: csrc/stash_registry.h, Budget), and in the recompute hands them back instead of running attention:
  // reentrant checkpointing (first forward: grad off) and non-reentrant checkpointing
  // (first forward: grad on, under the checkpoint's saved-tensor hooks) alike. Anywhere
  // else it is exactly F.sdpa and keeps nothing.
  m.def(
      "sdpa_fwd_keep(Tensor query, Tensor key, Tensor value, Tensor anchor, int slot, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False) -> Tensor");
  // The recompute half on its own: takes what sdpa_fwd_keep kept for (anchor, slot) and
  // returns it as a node whose backward is the kept backend's derivative. Never runs the
  // attention forward (but for a declined record, whose recompute runs it as usual).
  m.def(
      "sdpa_replay(Tensor query, Tensor key, Tensor value, Tensor anchor, int slot, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False) -> Tensor");

  // The two halves of the reentrant replay's autograd node, as ops so that torch.compile
  // can trace it: the take (kept output, log-sum-exp, CPU int64 [backend, max_q, max_k,
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

  // sdpa_fwd_keep for a layer that torch.compile traces inside an activation checkpoint that
  // runs eagerly (attnstash/install/compiled.py): what it does is decided when the compiled
  // graph runs, by _keep_or_take, and its node's backward is the kept backend's derivative ...
  m.def(
      "_sdpa_compiled(Tensor query, Tensor key, Tensor value, Tensor anchor, int slot, Tensor? attn_mask, "
      "float dropout_p, bool is_causal, float? scale, bool enable_gqa) -> Tensor");
  // ... and that decision (keep_replay.h, compiled_phase_of), with _replay_take's outputs: a
  // recompute takes what its first forward kept, a first forward keeps, anything else attends.
  m.def(
      "_keep_or_take(Tensor query, Tensor key, Tensor value, Tensor anchor, int slot, Tensor? attn_mask, "
      "float dropout_p, bool is_causal, float? scale, bool enable_gqa) -> (Tensor output, Tensor logsumexp, "
      "Tensor info, Tensor[] extra)");

  // The stash itself (Python: attnstash/ops.py). Its counters by name, as
  // csrc/stash_registry.h's STASH_STATS_FIELDS defines them (max_bytes -1: no budget) ...
  m.def("stash_stats() -> Dict(str, int)", &attnstash::records::stats);
  // ... and what each counter means.
  m.def("stash_stats_meanings() -> Dict(str, str)", &attnstash::records::stats_meanings);
  // Releases every record; returns how many.
  m.def("stash_clear() -> int", &attnstash::records::clear);
  // Sets peak_bytes to the bytes held now.
  m.def("stash_reset_peak() -> ()", &attnstash::records::reset_peak);
  // Sets the budget: the most bytes the stash holds at once (negative: no budget); what it
  // does: csrc/stash_registry.h, Budget.
  m.def("stash_set_max_bytes(int max_bytes) -> ()", &attnstash::records::set_max_bytes);
  // [slot, records, bytes, declined records] for each slot that holds something.
  m.def("stash_held_by_slot() -> int[]", &attnstash::records::held_by_slot);
  // The ids of every record held now.
  m.def("stash_held_ids() -> int[]", &attnstash::records::held_ids);
  // The id of the record held for (anchor, slot), 0 if none: what a forward's owner holds.
  m.def("stash_record_id(Tensor anchor, int slot) -> int", &attnstash::records::record_id);
  // "device:SDPBackend value:name:forward op" for every kept backend (torch_ops/backends/):
  // what attnstash/backends.py's KEPT_BACKENDS holds ...
  m.def("stash_kept_backends() -> str[]", &attnstash::kept_backend_rows);
  // ... and the forward and backward of one of them (device, SDPBackend value), for the shapes
  // of what they return on meta or fake tensors (the fake kernels, the planner): the backend's
  // file is the one statement of its calls (torch_ops/backends/kept_backends.cpp).
  m.def(
      "_backend_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, bool is_causal, float? scale, "
      "str device, int backend) -> (Tensor output, Tensor logsumexp, Tensor[] extra)");
  m.def(
      "_backend_backward(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor output, "
      "Tensor logsumexp, Tensor[] extra, bool is_causal, float? scale, str device, int backend) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // Offloading (attnstash/install/offload.py): a kept record's output and log-sum-exp handed
  // out, its bytes counted apart ([] if there is nothing to move), and put back before its
  // recompute (whether it was still held): records.h, move_out.
  m.def("_record_move_out(int id) -> Tensor[]", &attnstash::records::move_out);
  m.def("_record_move_in(int id, Tensor output, Tensor logsumexp) -> bool", &attnstash::records::move_in);
  // The random-number check (attnstash/install/random_state.py): the random state a first
  // forward's call was made in, noted on its record, and read back before its recompute's
  // call: records.h, note_rng.
  m.def("_record_note_rng(int id, Tensor state) -> bool", &attnstash::records::note_rng);
  m.def("_record_noted_rng(Tensor anchor, int slot) -> Tensor?", &attnstash::records::noted_rng);
  // A token (records.h, new_token): a 0-dim tensor to anchor one checkpoint call's forwards on,
  // whose memory releases what is held under it as it is freed.
  m.def("_new_token() -> Tensor", &attnstash::records::new_token);
  // Releases one forward's reference of record `id` (its graph was dropped without a
  // backward); whether it was held.
  m.def("stash_release(int id) -> bool", &attnstash::records::release);
  // Releases every record under slots [first, first + count) (attnstash/install/installer.py:
  // an uninstall that releases what a layer still holds); how many.
  m.def("_release_slots(int first, int count) -> int", &attnstash::records::release_slots);
}
