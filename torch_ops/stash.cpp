// stash.cpp: the process-wide registry of kept attention, over the C core.
#include "stash.h"

#include "stash_registry.h"

#include <c10/util/Exception.h>

#include <map>
#include <sstream>

namespace attnstash {
namespace {

stash_registry* registry() {
  // Created once and never destroyed: tensors must not be freed during static
  // destruction, after the CUDA context may be gone.
  static stash_registry* reg = [] {
    stash_registry* r = nullptr;
    stash_status s = stash_registry_create(&r);
    TORCH_CHECK(s == STASH_OK, "attnstash: cannot create the stash registry: ", stash_status_message(s));
    return r;
  }();
  return reg;
}

void release_entry(void* payload) { delete static_cast<KeptEntry*>(payload); }

stash_key key_of(const at::Tensor& anchor, int64_t slot, const char* op) {
  stash_key key{};
  key.anchor = reinterpret_cast<uintptr_t>(anchor.data_ptr());
  key.version = static_cast<int64_t>(anchor._version());
  TORCH_CHECK(anchor.dim() <= STASH_MAX_RANK, "attnstash::", op, ": the anchor may have at most ", STASH_MAX_RANK,
              " dimensions, but it has ", anchor.dim(), " (shape ", anchor.sizes(),
              "). Pass the decoder layer's input, or a view of it with fewer dimensions.");
  key.rank = static_cast<int32_t>(anchor.dim());
  for (int64_t d = 0; d < anchor.dim(); ++d) key.shape[d] = anchor.size(d);
  key.slot = slot;
  return key;
}

bool same_storage(const KeptEntry& e, const at::Tensor& anchor) {
  auto alive = e.anchor_storage.lock();
  return alive && alive.get() == anchor.storage().unsafeGetStorageImpl();
}

std::string shape_str(const stash_key& k) {
  std::ostringstream s;
  s << "[";
  for (int32_t d = 0; d < k.rank; ++d) s << (d ? ", " : "") << k.shape[d];
  s << "]";
  return s.str();
}

}  // namespace

std::string TensorMeta::str() const {
  std::ostringstream s;
  s << c10::toString(dtype) << c10::IntArrayRef(sizes) << " on " << device;
  return s.str();
}

size_t KeptEntry::bytes() const {
  size_t n = attention.output.nbytes() + attention.logsumexp.nbytes();
  for (const auto& t : attention.extra) n += t.defined() ? t.nbytes() : 0;
  return n;
}

void keep_entry(const at::Tensor& anchor, int64_t slot, std::unique_ptr<KeptEntry> entry, const char* op) {
  stash_key key = key_of(anchor, slot, op);
  entry->anchor_storage = c10::weak_intrusive_ptr<c10::StorageImpl>(anchor.storage().getWeakStorageImpl());
  stash_entry e{entry.get(), entry->bytes(), release_entry};
  stash_status s = stash_keep(registry(), &key, e);
  TORCH_CHECK(s != STASH_ERR_DUPLICATE, "attnstash::", op, ": an attention output is already kept for this anchor (shape ",
              anchor.sizes(), ", version ", key.version, ") and slot ", slot,
              ": the same anchor went through this attention twice before its recompute. "
              "Give each forward its own anchor (the layer input) or each attention call its own slot, "
              "or run the backward of the first forward before the second.");
  TORCH_CHECK(s == STASH_OK, "attnstash::", op, ": cannot keep the attention output: ", stash_status_message(s));
  entry.release();  // the registry owns it now
}

std::unique_ptr<KeptEntry> take_entry(const at::Tensor& anchor, int64_t slot, const char* op) {
  stash_key key = key_of(anchor, slot, op);
  stash_entry e{};
  if (stash_take(registry(), &key, &e) == STASH_OK) {
    std::unique_ptr<KeptEntry> entry(static_cast<KeptEntry*>(e.payload));
    if (same_storage(*entry, anchor)) return entry;
    // A kept output of a freed anchor whose address, version and shape this one reuses.
    TORCH_CHECK(false, "attnstash::", op, ": nothing is kept for this anchor (shape ", anchor.sizes(), ", slot ", slot,
                "): the output kept at its address belonged to an earlier tensor that has been freed. "
                "The recompute must receive the same anchor tensor (or a detached alias of it) as its first forward.");
  }
  // Diagnose the miss: entries of this anchor and slot under another version or shape.
  struct Found {
    const stash_key* want;
    std::vector<std::pair<int64_t, std::string>> others;  // version, shape
  } found{&key, {}};
  stash_visit(
      registry(),
      [](const stash_key* k, const stash_entry*, void* ctx) {
        auto* f = static_cast<Found*>(ctx);
        if (k->anchor == f->want->anchor && k->slot == f->want->slot) f->others.emplace_back(k->version, shape_str(*k));
      },
      &found);
  if (!found.others.empty()) {
    // They can never be matched again (versions only grow): release them now.
    struct Stale {
      uintptr_t anchor;
      int64_t slot;
    } stale{key.anchor, key.slot};
    stash_release_if(
        registry(),
        [](const stash_key* k, const stash_entry*, void* ctx) {
          auto* s = static_cast<Stale*>(ctx);
          return static_cast<int>(k->anchor == s->anchor && k->slot == s->slot);
        },
        &stale, nullptr);
    const auto& [version, shape] = found.others.front();
    TORCH_CHECK(version == key.version,
                "attnstash::", op, ": the anchor was modified in place between the first forward and its recompute "
                "(its version was ", version, " when the output was kept and is ", key.version,
                " now), so the kept output may not match this input. "
                "Do not modify the layer input in place before backward; the kept output has been released.");
    TORCH_CHECK(false, "attnstash::", op, ": the anchor's shape changed between the first forward and its recompute (",
                shape, " when kept, ", anchor.sizes(), " now); the kept output has been released.");
  }
  TORCH_CHECK(false, "attnstash::", op, ": no attention output is kept for this anchor (shape ", anchor.sizes(),
              ", version ", key.version, ") and slot ", slot,
              ". A recompute can only replay what its first forward kept, and a first forward keeps only inside "
              "an activation checkpoint (reentrant: grad off; non-reentrant: under its saved-tensor hooks) with "
              "an anchor that requires grad. A cleared stash (attnstash.clear_stash()) or a second backward "
              "through the same forward leave nothing to replay either.");
}

bool read_entry(const at::Tensor& anchor, int64_t slot, const std::function<void(const KeptEntry&)>& read) {
  struct Find {
    const at::Tensor* anchor;
    const std::function<void(const KeptEntry&)>* read;
    bool found;
  } find{&anchor, &read, false};
  stash_key key = key_of(anchor, slot, "sdpa_fwd_keep");
  stash_peek(
      registry(), &key,
      [](const stash_key*, const stash_entry* e, void* ctx) {
        auto* f = static_cast<Find*>(ctx);
        const auto* entry = static_cast<const KeptEntry*>(e->payload);
        if (!same_storage(*entry, *f->anchor)) return;  // a freed anchor's entry at a reused address
        (*f->read)(*entry);
        f->found = true;
      },
      &find);
  return find.found;
}

void release_freed_entries() {
  stash_release_if(
      registry(),
      [](const stash_key*, const stash_entry* e, void*) {
        return static_cast<int>(static_cast<const KeptEntry*>(e->payload)->anchor_storage.expired());
      },
      nullptr, nullptr);
}

int64_t release_anchor_entries(int64_t data_ptr) {
  size_t released = 0;
  stash_release_anchor(registry(), static_cast<uintptr_t>(data_ptr), &released);
  return static_cast<int64_t>(released);
}

int64_t clear_entries() {
  size_t released = 0;
  stash_clear(registry(), &released);
  return static_cast<int64_t>(released);
}

std::vector<int64_t> stats_counters() {
  stash_stats s{};
  stash_get_stats(registry(), &s);
  return {static_cast<int64_t>(s.entries), static_cast<int64_t>(s.bytes),   static_cast<int64_t>(s.peak_bytes),
          static_cast<int64_t>(s.keeps),   static_cast<int64_t>(s.takes),   static_cast<int64_t>(s.misses),
          static_cast<int64_t>(s.released_unused)};
}

std::vector<int64_t> held_by_slot() {
  std::map<int64_t, std::pair<int64_t, int64_t>> by_slot;
  stash_visit(
      registry(),
      [](const stash_key* k, const stash_entry* e, void* ctx) {
        auto& held = (*static_cast<std::map<int64_t, std::pair<int64_t, int64_t>>*>(ctx))[k->slot];
        held.first += 1;
        held.second += static_cast<int64_t>(e->bytes);
      },
      &by_slot);
  std::vector<int64_t> flat;
  for (const auto& [slot, held] : by_slot) flat.insert(flat.end(), {slot, held.first, held.second});
  return flat;
}

void reset_peak_bytes() { stash_reset_peak(registry()); }

}  // namespace attnstash
