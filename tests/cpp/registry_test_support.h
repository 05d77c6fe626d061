// registry_test_support.h: what the registry suites (tests/cpp/test_registry_*.cpp) share:
// keys, payloads that count the callbacks made on them, a registry owned by one test, the
// stats and the records held read back in comparable form, and demotable payloads.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "stash_registry.h"

// gtest finds these by argument-dependent lookup, so they live in stash_stats's
// namespace (the global one). Both walk every counter of the X-macro.
inline bool operator==(const stash_stats &a, const stash_stats &b) {
#define STASH_STATS_SAME(name, meaning) \
  if (a.name != b.name) return false;
  STASH_STATS_FIELDS(STASH_STATS_SAME)
#undef STASH_STATS_SAME
  return true;
}

inline void PrintTo(const stash_stats &s, std::ostream *os) {
#define STASH_STATS_PRINT(name, meaning) *os << " " #name "=" << s.name;
  STASH_STATS_FIELDS(STASH_STATS_PRINT)
#undef STASH_STATS_PRINT
}

// --- helpers -----------------------------------------------------------------

inline stash_key MakeKey(uintptr_t anchor, int64_t version, std::vector<int64_t> shape, int64_t slot) {
  stash_key key;
  // Fill the unused sizes with junk: the registry must ignore everything past rank.
  for (int i = 0; i < STASH_MAX_RANK; ++i) key.shape[i] = -1000 - i;
  key.anchor = anchor;
  key.version = version;
  key.rank = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size() && i < STASH_MAX_RANK; ++i) key.shape[i] = shape[i];
  key.slot = slot;
  return key;
}

// A payload that counts the callbacks the registry made on it.
struct Payload {
  int id = 0;
  size_t bytes = 0;
  std::atomic<int> retains{0};
  std::atomic<int> releases{0};
  std::atomic<int> takes{0};  // bumped by whoever takes a reference back (concurrency tests)
  // Demotion: what the demote callback returns (nullptr: it fails, as out of memory), how
  // often it was called, and a log (may be nullptr) of the ids it was called for.
  Payload *stand_in = nullptr;
  std::atomic<int> demotes{0};
  std::vector<int> *demote_log = nullptr;
};

inline void CountRetain(void *payload) { static_cast<Payload *>(payload)->retains.fetch_add(1); }
inline void CountRelease(void *payload) { static_cast<Payload *>(payload)->releases.fetch_add(1); }
inline void *DemoteToStandIn(void *payload) {
  auto *p = static_cast<Payload *>(payload);
  p->demotes.fetch_add(1);
  if (p->demote_log != nullptr) p->demote_log->push_back(p->id);
  return p->stand_in;
}

inline stash_entry EntryFor(Payload &p) { return stash_entry{&p, p.bytes, CountRetain, CountRelease}; }

// A demotable entry: its demote callback hands the registry `stand_in` (nullptr: it fails).
// The stand-in is released, like the payload, with CountRelease.
inline stash_entry DemotableEntryFor(Payload &p, Payload *stand_in) {
  p.stand_in = stand_in;
  return stash_entry{&p, p.bytes, CountRetain, CountRelease, DemoteToStandIn};
}

// An entry that may never be shared: it has no retain callback.
inline stash_entry UnshareableEntryFor(Payload &p) { return stash_entry{&p, p.bytes, nullptr, CountRelease}; }

// Owns a registry for one test. Declare it after the payloads it will hold:
// its destructor releases them, so they must still be alive then.
struct Registry {
  stash_registry *r = nullptr;
  Registry() { EXPECT_EQ(stash_registry_create(&r), STASH_OK); }
  ~Registry() { stash_registry_destroy(r); }
  Registry(const Registry &) = delete;
  Registry &operator=(const Registry &) = delete;
  stash_registry *get() const { return r; }
  // Destroys the registry now, to check what destroy releases.
  void Destroy() {
    stash_registry_destroy(r);
    r = nullptr;
  }
};

inline stash_stats Stats(stash_registry *r) {
  stash_stats s;
  std::memset(&s, 0xab, sizeof s);
  EXPECT_EQ(stash_get_stats(r, &s), STASH_OK);
  return s;
}

// The stats of a registry that never held anything: all zero, and no budget.
inline stash_stats FreshStats() {
  stash_stats s{};
  s.max_bytes = UINT64_MAX;
  return s;
}

// Keeps (or declines) `entry` under `key` and returns the record's id.
inline uint64_t Keep(stash_registry *r, const stash_key &key, stash_entry entry) {
  uint64_t id = 0;
  EXPECT_EQ(stash_keep(r, &key, entry, &id), STASH_OK);
  return id;
}
inline uint64_t Decline(stash_registry *r, const stash_key &key, stash_entry entry) {
  uint64_t id = 0;
  EXPECT_EQ(stash_decline(r, &key, entry, &id), STASH_OK);
  return id;
}

// Everything one stash_take reports; the outputs start as sentinels.
struct Taken {
  stash_status status;
  stash_entry entry;
  uint64_t id;
  int declined;
};
inline Taken Take(stash_registry *r, const stash_key &key, uint64_t id = 0) {
  Taken t{STASH_ERR_NOMEM, stash_entry{nullptr, 777, nullptr, nullptr}, 777, 777};
  t.status = stash_take(r, &key, id, &t.entry, &t.id, &t.declined);
  return t;
}

// The comparable part of a key: only the first `rank` sizes.
using CanonKey = std::tuple<uintptr_t, int64_t, int32_t, std::vector<int64_t>, int64_t>;

inline CanonKey Canon(const stash_key &k) {
  return CanonKey{k.anchor, k.version, k.rank, std::vector<int64_t>(k.shape, k.shape + k.rank),
                  k.slot};
}

// A held record as predicates and visitors see it, comparable and printable.
struct Held {
  void *payload;
  uint64_t bytes;
  uint64_t id;
  uint32_t refs;
  bool declined;
  bool operator==(const Held &o) const {
    return std::tie(payload, bytes, id, refs, declined) ==
           std::tie(o.payload, o.bytes, o.id, o.refs, o.declined);
  }
};
inline void PrintTo(const Held &h, std::ostream *os) {
  *os << "{payload=" << h.payload << " bytes=" << h.bytes << " id=" << h.id << " refs=" << h.refs
      << " declined=" << h.declined << "}";
}

inline Held HeldOf(const stash_record &r) {
  return Held{r.entry->payload, r.entry->bytes, r.id, r.refs, r.declined != 0};
}

// Everything the registry holds, as key -> record, read through stash_visit.
inline std::map<CanonKey, Held> Contents(stash_registry *r) {
  struct Ctx {
    std::map<CanonKey, Held> out;
    size_t visits = 0;
  } ctx;
  EXPECT_EQ(stash_visit(
                r,
                [](const stash_record *rec, void *c) {
                  auto *ctx = static_cast<Ctx *>(c);
                  ctx->visits++;
                  ctx->out.emplace(Canon(*rec->key), HeldOf(*rec));
                },
                &ctx),
            STASH_OK);
  EXPECT_EQ(ctx.visits, ctx.out.size()) << "visit reported some key twice";
  return ctx.out;
}

// The record under `key`, read through stash_peek.
inline Held Peek(stash_registry *r, const stash_key &key) {
  Held h{};
  EXPECT_EQ(stash_peek(
                r, &key, [](const stash_record *rec, void *c) { *static_cast<Held *>(c) = HeldOf(*rec); },
                &h),
            STASH_OK);
  return h;
}

// The references held now: every record's refs, summed.
inline uint64_t LiveRefs(stash_registry *r) {
  uint64_t refs = 0;
  for (auto &kv : Contents(r)) refs += kv.second.refs;
  return refs;
}

// Demotable payloads (ids 0..n-1), each with a stand-in of its own (ids 1000 + i), logging
// the ids their demote callbacks were called for. Declare it before the Registry.
struct Demotables {
  std::deque<Payload> originals, stand_ins;
  std::vector<int> log;
  explicit Demotables(const std::vector<size_t> &bytes) : originals(bytes.size()), stand_ins(bytes.size()) {
    for (size_t i = 0; i < bytes.size(); ++i) {
      originals[i].id = int(i);
      originals[i].bytes = bytes[i];
      originals[i].demote_log = &log;
      stand_ins[i].id = 1000 + int(i);
    }
  }
  stash_entry Entry(size_t i) { return DemotableEntryFor(originals[i], &stand_ins[i]); }
  Held Kept(size_t i, uint64_t id, uint32_t refs = 1) {
    return Held{&originals[i], originals[i].bytes, id, refs, false};
  }
  Held Demoted(size_t i, uint64_t id, uint32_t refs = 1) { return Held{&stand_ins[i], 0, id, refs, true}; }
  // The ids the demote callbacks were called for, in increasing order (the contract says
  // which records are demoted, not in which order their callbacks run).
  std::vector<int> SortedLog() const {
    std::vector<int> sorted = log;
    std::sort(sorted.begin(), sorted.end());
    return sorted;
  }
  int Demotes(size_t i) const { return originals[i].demotes.load(); }
};
