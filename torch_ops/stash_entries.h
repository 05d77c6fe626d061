// stash_entries.h: the C++ side of the stash. Adapts the C registry (csrc/stash_registry.h)
// to tensors: one process-wide registry whose records hold KeptEntry payloads.
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

// Everything one first forward leaves for its recompute. Reference-counted: forwards that
// repeat one another (the same anchor, bitwise the same attention) share one entry.
struct KeptEntry : c10::intrusive_ptr_target {
  // Declined: the budget had no room. No tensors are held (attention.backend stays): the
  // recompute runs the backend's forward itself, as the normal recompute would.
  bool declined = false;
  // Declined after it was kept: a later keep needed the room (the registry demotes the
  // oldest records first). A non-reentrant node kept behind saved no output for it, so
  // its recompute, which runs the forward, leaves the result here for that node's backward.
  bool evicted = false;
  struct Refill {
    std::mutex mutex;
    std::optional<KeptAttention> attention;
  };
  std::shared_ptr<Refill> refill;
  // Kept behind its first forward's own node (non-reentrant checkpointing): the recompute
  // only refills what that node saved, and the node's backward takes the entry.
  bool non_reentrant = false;
  KeptAttention attention;
  TensorMeta query, key, value;
  std::optional<TensorMeta> mask;
  // The first forward's mask, weakly: while it lives, the recompute's mask is compared
  // with it (the same memory by version, other memory by content). The mask itself is
  // not kept.
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> mask_impl{
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  int64_t mask_version = 0;
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  bool enable_gqa = false;
  int64_t output_version = 0;  // to detect an in-place change of the returned output
  // Note: the anchor's storage, held weakly. A freed anchor's address can be reused by
  // a new tensor with the same version and shape; comparing storages (whose objects a
  // weak reference keeps from being reused) tells the two apart.
  c10::weak_intrusive_ptr<c10::StorageImpl> anchor_storage{c10::intrusive_ptr<c10::StorageImpl>()};

  size_t bytes() const;
};
using KeptPtr = c10::intrusive_ptr<KeptEntry>;

// The registry key of (anchor, slot): its data pointer, version and shape, and the slot.
stash_key key_of(const at::Tensor& anchor, int64_t slot, const char* op);

// Whether `entry` was kept for this very anchor tensor (not a freed one at the same address).
bool kept_for(const KeptEntry& entry, const at::Tensor& anchor);

// What storing a first forward's entry did.
struct Stored {
  uint64_t id = 0;         // the record now held for it (0: a duplicate, nothing stored)
  bool declined = false;   // the budget had no room: a declined record was stored instead
  bool duplicate = false;  // a record is already held under this key: nothing was stored
};

// Store `entry` under `key`; when the budget has no room for it, drop its tensors and store
// it as declined.
Stored stash_store(const stash_key& key, const KeptPtr& entry);

// One more forward shares the record `id` under `key`; false if it is gone.
bool stash_share(const stash_key& key, uint64_t id);

// A record taken back: one reference to its entry, and its id.
struct Taken {
  KeptPtr entry;  // null: nothing was held (a miss)
  uint64_t id = 0;
};

// Take one forward's reference of the record under `key` (with this id, unless 0).
Taken stash_take(const stash_key& key, uint64_t id);

// The entry held under `key`, left held (null if none), and its record id.
Taken stash_peek(const stash_key& key);

// Release one forward's reference of record `id`; false if it is not held.
bool stash_release(int64_t id);

// Release every record whose anchor storage has been freed. Called by both ops on entry.
void stash_release_freed();

// Every record under this anchor pointer and slot whatever its version and shape, as
// (version, shape) strings for a diagnosis, after releasing them (they can never be
// matched again: versions only grow, shapes are fixed).
std::vector<std::pair<int64_t, std::string>> stash_release_stale(const stash_key& key);

// The stash's counters by name (STASH_STATS_FIELDS), for attnstash.stash_stats().
c10::Dict<std::string, int64_t> stash_stats();

// The meaning of each counter, by name.
c10::Dict<std::string, std::string> stash_stats_meanings();

// Release everything; returns how many records.
int64_t stash_clear();

// Set peak_bytes to the bytes held now.
void stash_reset_peak();

// Set the budget in bytes; a negative value removes it.
void stash_set_max_bytes(int64_t max_bytes);

// Flattened [slot, entries, bytes, declined entries] quadruples, one per slot held.
std::vector<int64_t> stash_held_by_slot();

// The ids of every record held now.
std::vector<int64_t> stash_held_ids();

// The id of the record held for (anchor, slot), 0 if none.
int64_t stash_entry_id(const at::Tensor& anchor, int64_t slot);

// Owns one forward's reference to a record for the life of that forward's graph node
// (non-reentrant checkpointing): the node's backward takes it (taken = true), and a graph
// dropped without a backward releases it as the node is destroyed.
struct EntryOwner : torch::CustomClassHolder {
  stash_key key;
  uint64_t id = 0;
  bool taken = false;
  EntryOwner(const stash_key& k, uint64_t i) : key(k), id(i) {}
  ~EntryOwner() override;
};

}  // namespace attnstash
