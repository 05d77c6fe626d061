// stash.h: the torch side of the stash. Adapts the C registry (csrc/stash_registry.h)
// to tensors: one process-wide registry holding KeptEntry payloads.
#pragma once

#include "sdpa_backend.h"

#include <c10/core/StorageImpl.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <memory>
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

// Everything one first forward leaves for its recompute.
struct KeptEntry {
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
  bool with_graph = false;     // kept behind a node of its forward's graph (non-reentrant)
  // Note: the anchor's storage, held weakly. A freed anchor's address can be reused by
  // a new tensor with the same version and shape; comparing storages (whose objects a
  // weak reference keeps from being reused) tells the two apart.
  c10::weak_intrusive_ptr<c10::StorageImpl> anchor_storage{c10::intrusive_ptr<c10::StorageImpl>()};

  size_t bytes() const;
};

// Store `entry` for (anchor, slot). Throws if an entry is already kept under that key.
void keep_entry(const at::Tensor& anchor, int64_t slot, std::unique_ptr<KeptEntry> entry, const char* op);

// Remove and return the entry for (anchor, slot). Throws a diagnosis if there is none.
std::unique_ptr<KeptEntry> take_entry(const at::Tensor& anchor, int64_t slot, const char* op);

// Calls `read` on the entry held for (anchor, slot), which stays held, under the
// registry's lock (so `read` must not call the stash); false if there is none.
bool read_entry(const at::Tensor& anchor, int64_t slot, const std::function<void(const KeptEntry&)>& read);

// Release every entry whose anchor storage has been freed. Called by both ops on entry.
void release_freed_entries();

// Release every entry of the anchor with this data pointer; returns how many.
int64_t release_anchor_entries(int64_t data_ptr);

// Release everything; returns how many entries.
int64_t clear_entries();

// [entries, bytes, peak_bytes, keeps, takes, misses, released_unused]
std::vector<int64_t> stats_counters();

// Flattened [slot, entries, bytes] triples, one per slot held.
std::vector<int64_t> held_by_slot();

void reset_peak_bytes();

}  // namespace attnstash
