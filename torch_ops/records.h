// records.h: the C++ side of the stash. Adapts the C registry (csrc/stash_registry.h: its
// words, entry, payload, record, kept, declined, demoted, slot, anchor, are used here in the
// same sense) to tensors: one process-wide registry whose entries' payloads are Payloads.
#pragma once

#include "sdpa_backend.h"
#include "stash_registry.h"

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

namespace attnstash {

// Shape, dtype and device of one tensor of the kept call, checked at replay.
struct TensorMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;

  static TensorMeta of(const at::Tensor& t) { return {t.sizes().vec(), t.scalar_type(), t.device()}; }
  bool operator==(const TensorMeta& o) const { return sizes == o.sizes && dtype == o.dtype && device == o.device; }
  std::string str() const;
};

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// A first forward's attention call as its recompute must repeat it (keep_replay.cpp,
// call_difference, compares them), and what it was kept for.
struct CallSignature {
  const SdpaBackend* backend = nullptr;  // the kept backend F.sdpa chose
  TensorMeta query, key, value;
  std::optional<TensorMeta> mask;
  // The first forward's mask, weakly: while it lives, the recompute's mask is compared with it
  // (the same memory by version, other memory by content). The mask itself is not kept.
  WeakTensor mask_impl{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  int64_t mask_version = 0;
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  bool enable_gqa = false;
  // The anchor's storage, weakly: a freed anchor's address can be reused by a new tensor of
  // the same version and shape; comparing storages (which a weak reference keeps from being
  // reused) tells them apart.
  c10::weak_intrusive_ptr<c10::StorageImpl> anchor_storage{c10::intrusive_ptr<c10::StorageImpl>()};
  // The anchor is a token (records::new_token), whose freeing releases the record: only a record
  // anchored on anything else waits for records::release_freed.
  bool on_token = false;
  // Kept behind its first forward's own node (non-reentrant checkpointing): the recompute only
  // refills what that node saved, and the node's backward takes the record.
  bool non_reentrant = false;
  // The random state the call was made in, where its recompute must make it in the same state
  // (attnstash/install/random_state.py: records::note_rng); undefined where nothing is checked.
  at::Tensor rng_state;
};

// A record's state, each with the data it carries. A non-reentrant node decides from it what
// to save (node_saves_output), its recompute what to run, its backward what to use.
struct Kept {  // holds the attention: the recompute takes it
  KeptAttention attention;
  int64_t output_version = 0;  // to detect an in-place change of the returned output
  bool moved = false;          // output and log-sum-exp moved off it until the recompute (records::move_out)
  TensorMeta moved_output, moved_logsumexp;  // what they were when moved: they must come back so
};
struct Declined {};  // declined when stored: a non-reentrant node saved the output itself
struct Demoted {     // demoted after it was kept (the registry's Budget)
  // For a non-reentrant record: its node saved no output, so its recompute, which runs the
  // forward, leaves the result here for that node's backward (null for a reentrant record).
  struct Refill {
    std::mutex mutex;
    std::optional<KeptAttention> attention;
  };
  std::shared_ptr<Refill> refill;
};
using RecordState = std::variant<Kept, Declined, Demoted>;

// The payload of one record (its entry's): everything a first forward leaves for its recompute.
// Reference-counted: forwards that repeat one another (the same anchor, bitwise the same
// attention) share one record.
struct Payload : c10::intrusive_ptr_target {
  CallSignature call;
  RecordState state;

  const Kept* kept() const { return std::get_if<Kept>(&state); }
  size_t bytes() const;  // what the registry counts for it: a kept record's tensors
};
using PayloadPtr = c10::intrusive_ptr<Payload>;

// The registry key of (anchor, slot): its data pointer, version and shape, and the slot.
stash_key key_of(const at::Tensor& anchor, int64_t slot, const char* op);

// Whether `payload` was kept for this very anchor tensor (not a freed one at the same address).
bool kept_for(const Payload& payload, const at::Tensor& anchor);

// The registry, as the ops use it. (Named apart from the C API's stash_* functions.)
namespace records {

// What storing a first forward's record did.
struct Stored {
  uint64_t id = 0;         // the record now held for it (0: a duplicate, nothing stored)
  bool declined = false;   // the budget had no room: a declined record was stored instead
  bool duplicate = false;  // a record is already held under this key: nothing was stored
};

// Store a kept record under `key`; when the budget has no room for it, make it Declined
// (dropping its tensors) and store that.
Stored store(const stash_key& key, const PayloadPtr& payload);

// One more forward shares the record `id` under `key`; false if it is gone.
bool share(const stash_key& key, uint64_t id);

// A record taken back: one reference to its payload, and its id.
struct Taken {
  PayloadPtr payload;  // null: nothing was held (a miss)
  uint64_t id = 0;
};

// Take one forward's reference of the record under `key` (with this id, unless 0); with
// `leave`, a reference of our own, the record staying held (stash_read: a recompute that may run
// again).
Taken take(const stash_key& key, uint64_t id, bool leave = false);

// The record held under `key`, left held (null if none), and its id.
Taken peek(const stash_key& key);

// Release one forward's reference of record `id`; false if it is not held.
bool release(int64_t id);

// Release every record whose anchor storage has been freed. Called by both ops on entry; it
// looks through the registry only while a record not anchored on a token may be held.
void release_freed();

// Whether `anchor` is a token made by new_token.
bool is_token(const at::Tensor& anchor);

// A token: what a caller anchors one checkpoint call's forwards on in place of the layer input
// (schemas.cpp, anchor): a 0-dim CPU float tensor that requires grad, whose memory, as it is
// freed with the last reference to the token, releases every record still held under it (so
// that they go with whatever holds the token, at once, not at the next op call).
at::Tensor new_token();

// Every record under this anchor pointer and slot whatever its version and shape, as
// (version, shape) strings for a diagnosis, after releasing them (they can never be
// matched again: versions only grow, shapes are fixed). Looks at that anchor's records only.
std::vector<std::pair<int64_t, std::string>> release_stale(const stash_key& key);

// The counters by name (STASH_STATS_FIELDS), for attnstash.stash_stats().
c10::Dict<std::string, int64_t> stats();

// The meaning of each counter, by name.
c10::Dict<std::string, std::string> stats_meanings();

// Release everything; returns how many records.
int64_t clear();

// Release every record under the slots [first, first + count) (one layer's range: what an
// uninstall that releases drops); returns how many.
int64_t release_slots(int64_t first, int64_t count);

// Set peak_bytes to the bytes held now.
void reset_peak();

// The first slot of a new range of STASH_SLOTS_PER_RANGE (stash_new_slot_range): a stashed
// layer's, or a compiled layer class's.
int64_t new_slot_base();

// Set the budget in bytes; a negative value removes it. (What it does: stash_registry.h, Budget.)
void set_max_bytes(int64_t max_bytes);

// Flattened [slot, records, bytes, declined records] quadruples, one per slot held.
std::vector<int64_t> held_by_slot();

// The ids of every record held now.
std::vector<int64_t> held_ids();

// The id of the record held for (anchor, slot), 0 if none.
int64_t record_id(const at::Tensor& anchor, int64_t slot);

// Offloading (attnstash/install/offload.py): hand out a kept record's output and log-sum-exp,
// which the record then no longer holds, its bytes counted apart (stash_set_moved); [] if the
// record is not a kept one, or gone, or its output was modified in place (left for the
// recompute to refuse). move_in puts them back before its recompute; false if it is gone;
// fails if they come back with another shape, dtype or device than they left with.
std::vector<at::Tensor> move_out(int64_t id);
bool move_in(int64_t id, const at::Tensor& output, const at::Tensor& logsumexp);

// The random-number check (attnstash/install/random_state.py): note on record `id` the random
// state its first forward's call was made in (false if the record is gone); noted_rng gives the
// state noted on the record held for (anchor, slot), if any. The note goes with the record.
bool note_rng(int64_t id, const at::Tensor& state);
std::optional<at::Tensor> noted_rng(const at::Tensor& anchor, int64_t slot);

}  // namespace records

// Owns one forward's reference to a record for the life of that forward's graph node
// (non-reentrant checkpointing): the node's backward takes it (taken = true), but for one that
// keeps the graph (backward_keeps_graph), and a graph dropped without such a backward
// releases it as the node is destroyed.
struct RecordOwner : torch::CustomClassHolder {
  stash_key key;
  uint64_t id = 0;
  bool taken = false;
  RecordOwner(const stash_key& k, uint64_t i) : key(k), id(i) {}
  ~RecordOwner() override;
};

}  // namespace attnstash
