// records.cpp: the process-wide registry of kept attention, over the C core.
#include "records.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <limits>
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

// The registry's payload callbacks: one reference of a Payload ...
void retain_payload(void* payload) { c10::raw::intrusive_ptr::incref(static_cast<Payload*>(payload)); }
void release_payload(void* payload) { c10::raw::intrusive_ptr::decref(static_cast<Payload*>(payload)); }

// ... and its demoted stand-in, when the budget needs its room: the call it was kept for, in
// the Demoted state (a new object: whoever holds the kept one keeps it whole).
void* demote_payload(void* payload) noexcept {
  try {
    const auto& kept = *static_cast<const Payload*>(payload);
    auto stand_in = c10::make_intrusive<Payload>();
    stand_in->call = kept.call;
    stand_in->state = Demoted{kept.call.non_reentrant ? std::make_shared<Demoted::Refill>() : nullptr};
    return stand_in.release();  // the registry's reference
  } catch (...) {
    return nullptr;  // out of memory: the record stays kept
  }
}

// Typed trampolines: the registry's C callbacks take a function pointer and a context;
// these let call sites pass ordinary lambdas.
template <class F>
void visit_records(F f) {
  stash_visit(
      registry(), [](const stash_record* r, void* ctx) { (*static_cast<F*>(ctx))(*r); }, &f);
}

template <class F>
bool peek_record(const stash_key& key, F f) {
  return stash_peek(
             registry(), &key, [](const stash_record* r, void* ctx) { (*static_cast<F*>(ctx))(*r); }, &f) ==
         STASH_OK;
}

template <class F>
size_t release_records_if(F f) {
  size_t released = 0;
  stash_release_if(
      registry(), [](const stash_record* r, void* ctx) { return static_cast<int>((*static_cast<F*>(ctx))(*r)); },
      &f, &released);
  return released;
}

// The records of one anchor for which f returns true: stash_release_anchor's lambda form.
template <class F>
void release_anchor_records_if(uintptr_t anchor, F f) {
  stash_release_anchor(
      registry(), anchor,
      [](const stash_record* r, void* ctx) { return static_cast<int>((*static_cast<F*>(ctx))(*r)); }, &f, nullptr);
}

// How many times a record not anchored on a token was stored (or a token's deleter failed)
// since release_freed last found no such record held: while 0, no record can outlive its
// anchor's memory (a token's deleter releases its own), and release_freed has nothing to do.
std::atomic<uint64_t> awaiting_release_freed{0};

// A token's memory, freed with the token: every record still under it goes with it.
void free_token(void* cell) {
  try {
    stash_release_anchor(registry(), reinterpret_cast<uintptr_t>(cell), nullptr, nullptr, nullptr);
  } catch (...) {  // (a deleter must not throw; release_freed takes what is left)
    awaiting_release_freed.fetch_add(1);
  }
  delete static_cast<float*>(cell);
}

const Payload& payload_of(const stash_record& r) { return *static_cast<const Payload*>(r.entry->payload); }

stash_entry entry_for(const PayloadPtr& payload) {
  return stash_entry{payload.get(), payload->bytes(), retain_payload, release_payload, demote_payload};
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

size_t Payload::bytes() const {
  const Kept* k = kept();
  if (k == nullptr) return 0;
  size_t n = k->attention.output.nbytes() + k->attention.logsumexp.nbytes();
  for (const auto& t : k->attention.extra) n += t.defined() ? t.nbytes() : 0;
  return n;
}

stash_key key_of(const at::Tensor& anchor, int64_t slot, const char* op) {
  TORCH_CHECK(anchor.dim() <= STASH_MAX_RANK, "attnstash::", op, ": the anchor may have at most ", STASH_MAX_RANK,
              " dimensions, but it has ", anchor.dim(), " (shape ", anchor.sizes(),
              "). Pass the decoder layer's input, or a view of it with fewer dimensions.");
  stash_key key{};
  key.anchor = reinterpret_cast<uintptr_t>(anchor.data_ptr());
  key.version = static_cast<int64_t>(anchor._version());
  key.rank = static_cast<int32_t>(anchor.dim());
  for (int64_t d = 0; d < anchor.dim(); ++d) key.shape[d] = anchor.size(d);
  key.slot = slot;
  return key;
}

bool kept_for(const Payload& payload, const at::Tensor& anchor) {
  auto alive = payload.call.anchor_storage.lock();
  return alive && alive.get() == anchor.storage().unsafeGetStorageImpl();
}

namespace records {

Stored store(const stash_key& key, const PayloadPtr& payload) {
  Stored stored;
  // The registry's reference, made before the payload can be seen (and taken) by another
  // thread; released by release_payload, or below if nothing was stored.
  c10::raw::intrusive_ptr::incref(payload.get());
  stash_status s = stash_keep(registry(), &key, entry_for(payload), &stored.id);
  if (s == STASH_ERR_BUDGET) {  // keep only what the recompute needs to run the forward and check its call
    payload->state = Declined{};
    stored.declined = true;
    s = stash_decline(registry(), &key, entry_for(payload), &stored.id);
  }
  if (s != STASH_OK) c10::raw::intrusive_ptr::decref(payload.get());
  if (s == STASH_OK && !payload->call.on_token) awaiting_release_freed.fetch_add(1);  // (after the store)
  if (s == STASH_ERR_DUPLICATE) {
    stored.duplicate = true;
    stored.id = 0;
    return stored;
  }
  TORCH_CHECK(s == STASH_OK, "attnstash: cannot keep the attention output: ", stash_status_message(s));
  return stored;
}

bool share(const stash_key& key, uint64_t id) { return stash_share(registry(), &key, id) == STASH_OK; }

Taken take(const stash_key& key, uint64_t id, bool leave) {
  stash_entry e{};
  Taken taken;
  if ((leave ? stash_read : stash_take)(registry(), &key, id, &e, &taken.id, nullptr) == STASH_OK)
    taken.payload = PayloadPtr::reclaim(static_cast<Payload*>(e.payload));  // the reference handed to us
  return taken;
}

Taken peek(const stash_key& key) {
  Taken found;
  peek_record(key, [&](const stash_record& r) {
    found.payload = PayloadPtr::unsafe_reclaim_from_nonowning(static_cast<Payload*>(r.entry->payload));
    found.id = r.id;
  });
  return found;
}

bool release(int64_t id) { return id > 0 && stash_release_id(registry(), static_cast<uint64_t>(id)) == STASH_OK; }

void release_freed() {
  const uint64_t seen = awaiting_release_freed.load();
  if (seen == 0) return;
  size_t waiting = 0;  // records left that are not on a token
  release_records_if([&waiting](const stash_record& r) {
    const CallSignature& call = payload_of(r).call;
    if (call.anchor_storage.expired()) return true;
    waiting += !call.on_token;
    return false;
  });
  // None left, and none stored (nor a deleter failed) since `seen` was read: nothing to look for.
  uint64_t expected = seen;
  if (waiting == 0) awaiting_release_freed.compare_exchange_strong(expected, 0);
}

bool is_token(const at::Tensor& anchor) {
  return anchor.has_storage() && anchor.storage().data_ptr().get_deleter() == &free_token;
}

at::Tensor new_token() {
  auto* cell = new float(0.f);
  at::Tensor token = at::for_blob(cell, {}).context(cell, &free_token).options(at::dtype(at::kFloat)).make_tensor();
  token.set_requires_grad(true);
  return token;
}

std::vector<std::pair<int64_t, std::string>> release_stale(const stash_key& key) {
  std::vector<std::pair<int64_t, std::string>> stale;
  release_anchor_records_if(key.anchor, [&](const stash_record& r) {
    if (r.key->slot != key.slot) return false;
    stale.emplace_back(r.key->version, shape_str(*r.key));
    return true;
  });
  return stale;
}

c10::Dict<std::string, int64_t> stats() {
  release_freed();  // what freed anchors left is no longer held for anyone
  ::stash_stats s{};
  stash_get_stats(registry(), &s);
  c10::Dict<std::string, int64_t> out;
  auto as_int = [](uint64_t v) {  // UINT64_MAX (no budget) reads as -1
    return v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? int64_t{-1} : static_cast<int64_t>(v);
  };
#define ATTNSTASH_STAT(name, meaning) out.insert(#name, as_int(s.name));
  STASH_STATS_FIELDS(ATTNSTASH_STAT)
#undef ATTNSTASH_STAT
  return out;
}

c10::Dict<std::string, std::string> stats_meanings() {
  c10::Dict<std::string, std::string> out;
#define ATTNSTASH_STAT(name, meaning) out.insert(#name, meaning);
  STASH_STATS_FIELDS(ATTNSTASH_STAT)
#undef ATTNSTASH_STAT
  return out;
}

int64_t clear() {
  size_t released = 0;
  stash_clear(registry(), &released);
  return static_cast<int64_t>(released);
}

int64_t release_slots(int64_t first, int64_t count) {
  return static_cast<int64_t>(
      release_records_if([&](const stash_record& r) { return r.key->slot >= first && r.key->slot < first + count; }));
}

void reset_peak() { stash_reset_peak(registry()); }

int64_t new_slot_base() {
  int64_t first = 0;
  const stash_status s = stash_new_slot_range(registry(), &first);
  TORCH_CHECK(s == STASH_OK, "attnstash: cannot hand out a new range of slots: ", stash_status_message(s));
  return first;
}

void set_max_bytes(int64_t max_bytes) {
  stash_set_max_bytes(registry(), max_bytes < 0 ? UINT64_MAX : static_cast<uint64_t>(max_bytes));
}

std::vector<int64_t> held_by_slot() {
  struct Held {
    int64_t records = 0, bytes = 0, declined = 0;
  };
  std::map<int64_t, Held> by_slot;
  visit_records([&](const stash_record& r) {
    Held& held = by_slot[r.key->slot];
    held.records += 1;
    held.bytes += static_cast<int64_t>(r.entry->bytes);
    held.declined += r.declined ? 1 : 0;
  });
  std::vector<int64_t> flat;
  for (const auto& [slot, held] : by_slot) flat.insert(flat.end(), {slot, held.records, held.bytes, held.declined});
  return flat;
}

std::vector<int64_t> held_ids() {
  std::vector<int64_t> ids;
  visit_records([&](const stash_record& r) { ids.push_back(static_cast<int64_t>(r.id)); });
  return ids;
}

int64_t record_id(const at::Tensor& anchor, int64_t slot) {
  stash_key key = key_of(anchor, slot, "stash_record_id");
  int64_t id = 0;
  peek_record(key, [&](const stash_record& r) {
    if (kept_for(payload_of(r), anchor)) id = static_cast<int64_t>(r.id);
  });
  return id;
}

namespace {
// The payload of the record with this id (a reference of the caller's), or null.
PayloadPtr payload_by_id(int64_t id) {
  PayloadPtr found;
  visit_records([&](const stash_record& r) {
    if (static_cast<int64_t>(r.id) == id)
      found = PayloadPtr::unsafe_reclaim_from_nonowning(static_cast<Payload*>(r.entry->payload));
  });
  return found;
}
}  // namespace

bool note_rng(int64_t id, const at::Tensor& state) {
  PayloadPtr payload = payload_by_id(id);
  if (!payload) return false;
  payload->call.rng_state = state;
  return true;
}

std::optional<at::Tensor> noted_rng(const at::Tensor& anchor, int64_t slot) {
  stash_key key = key_of(anchor, slot, "_record_noted_rng");
  std::optional<at::Tensor> state;
  peek_record(key, [&](const stash_record& r) {
    const Payload& payload = payload_of(r);
    if (payload.call.rng_state.defined() && kept_for(payload, anchor)) state = payload.call.rng_state;
  });
  return state;
}

std::vector<at::Tensor> move_out(int64_t id) {
  PayloadPtr payload = payload_by_id(id);
  auto* kept = payload ? std::get_if<Kept>(&payload->state) : nullptr;
  if (kept == nullptr || kept->moved || kept->attention.output._version() != kept->output_version) return {};
  std::vector<at::Tensor> out{kept->attention.output, kept->attention.logsumexp};
  kept->moved_output = TensorMeta::of(out[0]);
  kept->moved_logsumexp = TensorMeta::of(out[1]);
  kept->attention.output = at::Tensor();
  kept->attention.logsumexp = at::Tensor();
  kept->moved = true;
  stash_set_moved(registry(), static_cast<uint64_t>(id), 1);
  return out;
}

bool move_in(int64_t id, const at::Tensor& output, const at::Tensor& logsumexp) {
  PayloadPtr payload = payload_by_id(id);
  auto* kept = payload ? std::get_if<Kept>(&payload->state) : nullptr;
  if (kept == nullptr || !kept->moved) return false;
  for (auto [name, was, is] : {std::tuple{"output", &kept->moved_output, TensorMeta::of(output)},
                               std::tuple{"log-sum-exp", &kept->moved_logsumexp, TensorMeta::of(logsumexp)}})
    TORCH_CHECK(*was == is, "attnstash: a kept attention ", name, " came back from offloading as ", is.str(),
                ", but it left as ", was->str(), ": the saved-tensor hooks around this layer's checkpoint (or "
                "attnstash's offload) must give back what they were given. An offloader that changes what it "
                "holds (another dtype, a compressed form) cannot carry what attnstash keeps: turn it off around "
                "the stashed layers, or do not stash them.");
  kept->attention.output = output;
  kept->attention.logsumexp = logsumexp;
  kept->output_version = static_cast<int64_t>(output._version());
  kept->moved = false;
  stash_set_moved(registry(), static_cast<uint64_t>(id), 0);
  return true;
}

}  // namespace records

RecordOwner::~RecordOwner() {
  if (!taken) stash_release_id(registry(), id);
}

}  // namespace attnstash
