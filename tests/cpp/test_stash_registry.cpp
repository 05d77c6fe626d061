// test_stash_registry.cpp: pins the behaviour of the C stash registry
// (csrc/stash_registry.h): keys, ids, error codes, shared records and their
// reference counts, declined records, the budget and its demotion of the oldest
// kept records, retain, release and demote callbacks, stats, growth, random runs
// against a std::map model, and concurrent use.

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
bool operator==(const stash_stats &a, const stash_stats &b) {
#define STASH_STATS_SAME(name, meaning) \
  if (a.name != b.name) return false;
  STASH_STATS_FIELDS(STASH_STATS_SAME)
#undef STASH_STATS_SAME
  return true;
}

void PrintTo(const stash_stats &s, std::ostream *os) {
#define STASH_STATS_PRINT(name, meaning) *os << " " #name "=" << s.name;
  STASH_STATS_FIELDS(STASH_STATS_PRINT)
#undef STASH_STATS_PRINT
}

namespace {

// --- helpers -----------------------------------------------------------------

stash_key MakeKey(uintptr_t anchor, int64_t version, std::vector<int64_t> shape, int64_t slot) {
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

void CountRetain(void *payload) { static_cast<Payload *>(payload)->retains.fetch_add(1); }
void CountRelease(void *payload) { static_cast<Payload *>(payload)->releases.fetch_add(1); }
void *DemoteToStandIn(void *payload) {
  auto *p = static_cast<Payload *>(payload);
  p->demotes.fetch_add(1);
  if (p->demote_log != nullptr) p->demote_log->push_back(p->id);
  return p->stand_in;
}

stash_entry EntryFor(Payload &p) { return stash_entry{&p, p.bytes, CountRetain, CountRelease}; }

// A demotable entry: its demote callback hands the registry `stand_in` (nullptr: it fails).
// The stand-in is released, like the payload, with CountRelease.
stash_entry DemotableEntryFor(Payload &p, Payload *stand_in) {
  p.stand_in = stand_in;
  return stash_entry{&p, p.bytes, CountRetain, CountRelease, DemoteToStandIn};
}

// An entry that may never be shared: it has no retain callback.
stash_entry UnshareableEntryFor(Payload &p) { return stash_entry{&p, p.bytes, nullptr, CountRelease}; }

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

stash_stats Stats(stash_registry *r) {
  stash_stats s;
  std::memset(&s, 0xab, sizeof s);
  EXPECT_EQ(stash_get_stats(r, &s), STASH_OK);
  return s;
}

// The stats of a registry that never held anything: all zero, and no budget.
stash_stats FreshStats() {
  stash_stats s{};
  s.max_bytes = UINT64_MAX;
  return s;
}

// Keeps (or declines) `entry` under `key` and returns the record's id.
uint64_t Keep(stash_registry *r, const stash_key &key, stash_entry entry) {
  uint64_t id = 0;
  EXPECT_EQ(stash_keep(r, &key, entry, &id), STASH_OK);
  return id;
}
uint64_t Decline(stash_registry *r, const stash_key &key, stash_entry entry) {
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
Taken Take(stash_registry *r, const stash_key &key, uint64_t id = 0) {
  Taken t{STASH_ERR_NOMEM, stash_entry{nullptr, 777, nullptr, nullptr}, 777, 777};
  t.status = stash_take(r, &key, id, &t.entry, &t.id, &t.declined);
  return t;
}

// The comparable part of a key: only the first `rank` sizes.
using CanonKey = std::tuple<uintptr_t, int64_t, int32_t, std::vector<int64_t>, int64_t>;

CanonKey Canon(const stash_key &k) {
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
void PrintTo(const Held &h, std::ostream *os) {
  *os << "{payload=" << h.payload << " bytes=" << h.bytes << " id=" << h.id << " refs=" << h.refs
      << " declined=" << h.declined << "}";
}

Held HeldOf(const stash_record &r) {
  return Held{r.entry->payload, r.entry->bytes, r.id, r.refs, r.declined != 0};
}

// Everything the registry holds, as key -> record, read through stash_visit.
std::map<CanonKey, Held> Contents(stash_registry *r) {
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
Held Peek(stash_registry *r, const stash_key &key) {
  Held h{};
  EXPECT_EQ(stash_peek(
                r, &key, [](const stash_record *rec, void *c) { *static_cast<Held *>(c) = HeldOf(*rec); },
                &h),
            STASH_OK);
  return h;
}

// The references held now: every record's refs, summed.
uint64_t LiveRefs(stash_registry *r) {
  uint64_t refs = 0;
  for (auto &kv : Contents(r)) refs += kv.second.refs;
  return refs;
}

// --- basic keep and take -------------------------------------------------------

TEST(StashRegistry, CreateRejectsNullOutput) {
  EXPECT_EQ(stash_registry_create(nullptr), STASH_ERR_ARGUMENT);
}

TEST(StashRegistry, NewRegistryIsEmptyWithZeroStatsAndNoBudget) {
  Registry reg;
  EXPECT_EQ(Stats(reg.get()), FreshStats());
  EXPECT_TRUE(Contents(reg.get()).empty());
}

TEST(StashRegistry, StatsAreExactlyTheXMacroFieldsEachAUint64) {
#define STASH_STATS_IS_U64(name, meaning) \
  static_assert(std::is_same<decltype(stash_stats::name), uint64_t>::value, #name " is a uint64_t");
  STASH_STATS_FIELDS(STASH_STATS_IS_U64)
#undef STASH_STATS_IS_U64
#define STASH_STATS_ONE(name, meaning) +1
  constexpr size_t fields = 0 STASH_STATS_FIELDS(STASH_STATS_ONE);
#undef STASH_STATS_ONE
  static_assert(sizeof(stash_stats) == fields * sizeof(uint64_t), "stash_stats has only the X-macro fields");
  // Every counter says what it means (the Python layer shows these).
#define STASH_STATS_MEANING(name, meaning) EXPECT_GT(std::strlen(meaning), 0u) << #name;
  STASH_STATS_FIELDS(STASH_STATS_MEANING)
#undef STASH_STATS_MEANING
}

TEST(StashRegistry, DestroyOfNullIsANoOp) { stash_registry_destroy(nullptr); }

TEST(StashRegistry, TakeHandsBackTheKeptPayloadBytesCallbacksAndId) {
  Payload p;
  Registry reg;
  p.bytes = 123;
  stash_key key = MakeKey(0x1000, 3, {2, 4}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));

  Taken t = Take(reg.get(), key);
  ASSERT_EQ(t.status, STASH_OK);
  EXPECT_EQ(t.entry.payload, &p);
  EXPECT_EQ(t.entry.bytes, 123u);
  EXPECT_EQ(t.entry.retain, &CountRetain);
  EXPECT_EQ(t.entry.release, &CountRelease);
  EXPECT_EQ(t.id, id);
  EXPECT_EQ(t.declined, 0);
  // The registry's own reference was handed out: no callback at all.
  EXPECT_EQ(p.retains.load(), 0);
  EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, TakeAcceptsNullIdAndDeclinedOutputs) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x1000, 0, {}, 0);
  Keep(reg.get(), key, EntryFor(p));
  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &key, 0, &out, nullptr, nullptr), STASH_OK);
  EXPECT_EQ(out.payload, &p);
}

TEST(StashRegistry, TakeOfTheLastReferenceUnlinksSoASecondTakeMisses) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x1000, 0, {8}, 0);
  Keep(reg.get(), key, EntryFor(p));
  ASSERT_EQ(Take(reg.get(), key).status, STASH_OK);
  EXPECT_EQ(Take(reg.get(), key).status, STASH_ERR_MISSING);
  EXPECT_TRUE(Contents(reg.get()).empty());
  stash_stats want = FreshStats();
  want.keeps = 1;
  want.replays = 1;
  want.misses = 1;
  EXPECT_EQ(Stats(reg.get()), want);
}

TEST(StashRegistry, TakeOfMissingKeyReturnsMissingCountsAMissAndLeavesOutputsAlone) {
  Registry reg;
  stash_key key = MakeKey(0x2000, 0, {}, 0);
  int sentinel = 0;
  stash_entry out{&sentinel, 77, nullptr, nullptr};
  uint64_t id = 55;
  int declined = 66;
  EXPECT_EQ(stash_take(reg.get(), &key, 0, &out, &id, &declined), STASH_ERR_MISSING);
  EXPECT_EQ(stash_take(reg.get(), &key, 0, &out, &id, &declined), STASH_ERR_MISSING);
  EXPECT_EQ(out.payload, &sentinel);
  EXPECT_EQ(out.bytes, 77u);
  EXPECT_EQ(id, 55u);
  EXPECT_EQ(declined, 66);
  stash_stats want = FreshStats();
  want.misses = 2;
  EXPECT_EQ(Stats(reg.get()), want);
}

TEST(StashRegistry, SecondKeepOrDeclineUnderSameKeyIsRejectedAndStoresNothing) {
  Payload first, second;
  Registry reg;
  first.bytes = 10;
  second.bytes = 1000;
  stash_key key = MakeKey(0x3000, 1, {5, 6, 7}, 2);
  uint64_t id = Keep(reg.get(), key, EntryFor(first));
  stash_stats before = Stats(reg.get());
  EXPECT_EQ(stash_keep(reg.get(), &key, EntryFor(second), nullptr), STASH_ERR_DUPLICATE);
  EXPECT_EQ(stash_decline(reg.get(), &key, EntryFor(second), nullptr), STASH_ERR_DUPLICATE);

  // The rejected payload stays the caller's: never retained or released, not counted.
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(second.retains.load() + second.releases.load(), 0);
  EXPECT_EQ(Peek(reg.get(), key), (Held{&first, 10, id, 1, false}));
}

TEST(StashRegistry, KeepUnderTheKeyOfADeclinedRecordIsADuplicate) {
  Payload declined, kept;
  Registry reg;
  stash_key key = MakeKey(0x3100, 0, {}, 0);
  Decline(reg.get(), key, EntryFor(declined));
  EXPECT_EQ(stash_keep(reg.get(), &key, EntryFor(kept), nullptr), STASH_ERR_DUPLICATE);
  EXPECT_EQ(Take(reg.get(), key).entry.payload, &declined);
}

// --- ids -----------------------------------------------------------------------

TEST(StashRegistry, IdsStartAtOneAndIncreaseAcrossKeepsDeclinesAndDrops) {
  std::deque<Payload> payloads(60);
  Registry reg;
  uint64_t last = 0;
  for (int i = 0; i < 60; ++i) {
    // Few keys, reused after every take or drop: an id must never come back.
    stash_key key = MakeKey(0x100 + 8 * uintptr_t(i % 4), 0, {}, 0);
    uint64_t id = i % 3 == 2 ? Decline(reg.get(), key, EntryFor(payloads[size_t(i)]))
                             : Keep(reg.get(), key, EntryFor(payloads[size_t(i)]));
    if (i == 0) {
      EXPECT_EQ(id, 1u);
    }
    EXPECT_GT(id, last) << i;
    last = id;
    EXPECT_EQ(stash_keep(reg.get(), &key, EntryFor(payloads[size_t(i)]), nullptr), STASH_ERR_DUPLICATE);
    if (i % 2 == 0) {
      ASSERT_EQ(Take(reg.get(), key).status, STASH_OK);
    } else {
      ASSERT_EQ(stash_release_id(reg.get(), id), STASH_OK);
    }
  }
}

TEST(StashRegistry, TakeWithTheRecordsIdFindsItAndWithAnotherIdMisses) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x1200, 0, {3}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));

  Taken wrong = Take(reg.get(), key, id + 1);
  EXPECT_EQ(wrong.status, STASH_ERR_MISSING);
  EXPECT_EQ(wrong.id, 777u);  // outputs untouched
  EXPECT_EQ(wrong.declined, 777);
  EXPECT_EQ(Stats(reg.get()).misses, 1u);
  EXPECT_EQ(Peek(reg.get(), key), (Held{&p, 0, id, 1, false}));

  Taken right = Take(reg.get(), key, id);
  ASSERT_EQ(right.status, STASH_OK);
  EXPECT_EQ(right.entry.payload, &p);
  EXPECT_EQ(right.id, id);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.replays, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.entries, 0u);
}

TEST(StashRegistry, TakeWithTheIdOfAnotherKeysRecordMisses) {
  Payload a, b;
  Registry reg;
  stash_key ka = MakeKey(0x1300, 0, {}, 0), kb = MakeKey(0x1300, 0, {}, 1);
  Keep(reg.get(), ka, EntryFor(a));
  uint64_t idb = Keep(reg.get(), kb, EntryFor(b));
  EXPECT_EQ(Take(reg.get(), ka, idb).status, STASH_ERR_MISSING);
  EXPECT_EQ(Stats(reg.get()).entries, 2u);
}

// --- keys --------------------------------------------------------------------

TEST(StashRegistry, RankAboveMaxOrNegativeIsRejectedWithoutSideEffects) {
  Payload p, held;
  Registry reg;
  p.bytes = 5;
  stash_key good = MakeKey(0x4000, 0, {1, 2}, 0);
  uint64_t id = Keep(reg.get(), good, EntryFor(held));
  stash_stats before = Stats(reg.get());
  auto noop = [](const stash_record *, void *) {};
  for (int32_t rank : {STASH_MAX_RANK + 1, -1, 1 << 30, -(1 << 30)}) {
    stash_key key = good;
    key.rank = rank;
    EXPECT_EQ(stash_keep(reg.get(), &key, EntryFor(p), nullptr), STASH_ERR_RANK) << rank;
    EXPECT_EQ(stash_decline(reg.get(), &key, EntryFor(p), nullptr), STASH_ERR_RANK) << rank;
    EXPECT_EQ(stash_share(reg.get(), &key, id), STASH_ERR_RANK) << rank;
    EXPECT_EQ(Take(reg.get(), key, 0).status, STASH_ERR_RANK) << rank;
    EXPECT_EQ(Take(reg.get(), key, id).status, STASH_ERR_RANK) << rank;
    EXPECT_EQ(stash_peek(reg.get(), &key, noop, nullptr), STASH_ERR_RANK) << rank;
  }
  // Nothing stored, shared or released, and a malformed take is not a miss.
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(Contents(reg.get()).size(), 1u);
  EXPECT_EQ(p.retains.load() + p.releases.load() + held.retains.load() + held.releases.load(), 0);
}

TEST(StashRegistry, RankEightIsAcceptedAndEveryOneOfItsSizesCounts) {
  Payload p, q;
  Registry reg;
  stash_key key = MakeKey(0x5000, 0, {1, 2, 3, 4, 5, 6, 7, 8}, 0);
  ASSERT_EQ(key.rank, STASH_MAX_RANK);
  Keep(reg.get(), key, EntryFor(p));

  stash_key last_differs = key;
  last_differs.shape[7] = 9;
  Keep(reg.get(), last_differs, EntryFor(q));

  EXPECT_EQ(Take(reg.get(), key).entry.payload, &p);
  EXPECT_EQ(Take(reg.get(), last_differs).entry.payload, &q);
}

TEST(StashRegistry, RankZeroKeyIsAValidKey) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x5100, 0, {}, 0);
  Keep(reg.get(), key, EntryFor(p));
  stash_key other_junk = key;
  for (auto &size : other_junk.shape) size = 42;
  EXPECT_EQ(Take(reg.get(), other_junk).entry.payload, &p);
}

TEST(StashRegistry, SizesBeyondRankAreIgnored) {
  Payload p, q;
  Registry reg;
  stash_key key = MakeKey(0x6000, 2, {3, 4}, 1);
  key.shape[2] = 111;
  key.shape[7] = 222;
  uint64_t id = Keep(reg.get(), key, EntryFor(p));

  stash_key same = key;
  same.shape[2] = -5;
  same.shape[7] = 0;
  // Same key for keep (duplicate), share, peek and take.
  EXPECT_EQ(stash_keep(reg.get(), &same, EntryFor(q), nullptr), STASH_ERR_DUPLICATE);
  EXPECT_EQ(stash_share(reg.get(), &same, id), STASH_OK);
  EXPECT_EQ(Peek(reg.get(), same).refs, 2u);
  EXPECT_EQ(Take(reg.get(), same).entry.payload, &p);
  EXPECT_EQ(Take(reg.get(), same).entry.payload, &p);
}

TEST(StashRegistry, AnchorVersionSlotShapeAndRankEachTellKeysApart) {
  std::vector<stash_key> keys = {
      MakeKey(0x7000, 0, {2, 3}, 0),     // the base key
      MakeKey(0x7008, 0, {2, 3}, 0),     // another anchor
      MakeKey(0x7000, 1, {2, 3}, 0),     // another version
      MakeKey(0x7000, -1, {2, 3}, 0),    // a negative version
      MakeKey(0x7000, 0, {2, 3}, 1),     // another slot
      MakeKey(0x7000, 0, {3, 2}, 0),     // the sizes swapped
      MakeKey(0x7000, 0, {2, 4}, 0),     // the last size changed
      MakeKey(0x7000, 0, {2}, 0),        // a prefix of the shape
      MakeKey(0x7000, 0, {2, 3, 1}, 0),  // a trailing size-1 dimension
      MakeKey(0x7000, 0, {}, 0),         // rank 0
  };
  // Make the junk past rank agree with the longer shapes, so only rank differs.
  keys[7].shape[1] = 3;  // {2} vs {2, 3}
  keys[0].shape[2] = 1;  // {2, 3} vs {2, 3, 1}
  std::deque<Payload> payloads(keys.size());
  Registry reg;
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_EQ(stash_keep(reg.get(), &keys[i], EntryFor(payloads[i]), nullptr), STASH_OK) << i;
  }
  EXPECT_EQ(Stats(reg.get()).entries, keys.size());
  for (size_t i = keys.size(); i-- > 0;) {
    Taken t = Take(reg.get(), keys[i]);
    ASSERT_EQ(t.status, STASH_OK) << i;
    EXPECT_EQ(t.entry.payload, &payloads[i]) << i;
  }
}

// --- argument checks -----------------------------------------------------------

TEST(StashRegistry, NullArgumentsAreRejectedAndChangeNothing) {
  Payload p;
  Registry reg;
  p.bytes = 9;
  stash_key key = MakeKey(0x8000, 0, {1}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));
  stash_stats before = Stats(reg.get());

  stash_entry out{};
  stash_stats stats{};
  size_t released = 0;
  uint64_t id_out = 0;
  auto pred = [](const stash_record *, void *) { return 1; };
  auto visitor = [](const stash_record *, void *) {};

  EXPECT_EQ(stash_keep(nullptr, &key, EntryFor(p), &id_out), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_keep(reg.get(), nullptr, EntryFor(p), &id_out), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_decline(nullptr, &key, EntryFor(p), &id_out), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_decline(reg.get(), nullptr, EntryFor(p), &id_out), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_share(nullptr, &key, id), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_share(reg.get(), nullptr, id), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_take(nullptr, &key, 0, &out, nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_take(reg.get(), nullptr, 0, &out, nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_take(reg.get(), &key, 0, nullptr, nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_release_id(nullptr, id), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_release_if(nullptr, pred, nullptr, &released), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_release_if(reg.get(), nullptr, nullptr, &released), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_clear(nullptr, &released), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_visit(nullptr, visitor, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_visit(reg.get(), nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_peek(nullptr, &key, visitor, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_peek(reg.get(), nullptr, visitor, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_peek(reg.get(), &key, nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_get_stats(nullptr, &stats), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_get_stats(reg.get(), nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_reset_peak(nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_set_max_bytes(nullptr, 0), STASH_ERR_ARGUMENT);

  // A rejected take is no miss, and the record is neither shared nor released.
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(Contents(reg.get()).size(), 1u);
  EXPECT_EQ(p.retains.load() + p.releases.load(), 0);
}

TEST(StashRegistry, ReleasedCountOutputMayBeNull) {
  Payload a, b;
  Registry reg;
  stash_key ka = MakeKey(0x8100, 0, {}, 0), kb = MakeKey(0x8200, 0, {}, 0);
  Keep(reg.get(), ka, EntryFor(a));
  Keep(reg.get(), kb, EntryFor(b));
  auto pred = [](const stash_record *r, void *) { return int(r->key->anchor == 0x8100); };
  EXPECT_EQ(stash_release_if(reg.get(), pred, nullptr, nullptr), STASH_OK);
  EXPECT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  EXPECT_EQ(a.releases.load() + b.releases.load(), 2);
}

// --- sharing and reference counts ------------------------------------------------

TEST(StashRegistry, ShareAddsAReferenceAndCountsAKeepWithoutRetaining) {
  Payload p;
  Registry reg;
  p.bytes = 70;
  stash_key key = MakeKey(0x9000, 0, {4}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));
  ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);
  ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);

  // The registry still owns one reference: sharing neither retains nor adds bytes.
  EXPECT_EQ(Peek(reg.get(), key), (Held{&p, 70, id, 3, false}));
  EXPECT_EQ(p.retains.load(), 0);
  stash_stats want = FreshStats();
  want.entries = 1;
  want.bytes = want.peak_bytes = 70;
  want.keeps = 3;
  EXPECT_EQ(Stats(reg.get()), want);
}

TEST(StashRegistry, TakeOfASharedRecordRetainsAndLeavesItHeld) {
  Payload p;
  Registry reg;
  p.bytes = 70;
  stash_key key = MakeKey(0x9100, 0, {4}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));
  ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);

  Taken first = Take(reg.get(), key);
  ASSERT_EQ(first.status, STASH_OK);
  EXPECT_EQ(first.entry.payload, &p);
  EXPECT_EQ(first.id, id);
  EXPECT_EQ(p.retains.load(), 1);  // the taker's own reference
  EXPECT_EQ(Peek(reg.get(), key), (Held{&p, 70, id, 1, false}));
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, 70u);
  EXPECT_EQ(s.replays, 1u);

  // The last forward gets the registry's own reference: no retain, the record goes.
  Taken last = Take(reg.get(), key);
  ASSERT_EQ(last.status, STASH_OK);
  EXPECT_EQ(p.retains.load(), 1);
  s = Stats(reg.get());
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.replays, 2u);
  EXPECT_EQ(s.released_unused, 0u);
  reg.Destroy();
  EXPECT_EQ(p.releases.load(), 0);  // both references were handed out
}

TEST(StashRegistry, EveryExtraReferenceHandedOutIsRetainedExactlyOnce) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x9200, 0, {}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));
  for (int i = 0; i < 4; ++i) ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);
  for (int taken = 1; taken <= 5; ++taken) {
    ASSERT_EQ(Take(reg.get(), key, id).status, STASH_OK) << taken;
    EXPECT_EQ(p.retains.load(), taken < 5 ? taken : 4) << taken;
  }
  EXPECT_EQ(Take(reg.get(), key, id).status, STASH_ERR_MISSING);
  reg.Destroy();
  EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, ShareOfARecordWithoutRetainIsAnArgumentErrorAndChangesNothing) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x9300, 0, {}, 0);
  uint64_t id = Keep(reg.get(), key, UnshareableEntryFor(p));
  stash_stats before = Stats(reg.get());
  EXPECT_EQ(stash_share(reg.get(), &key, id), STASH_ERR_ARGUMENT);
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(Peek(reg.get(), key).refs, 1u);
}

TEST(StashRegistry, ShareOfAMissingKeyOrAnotherIdIsMissingAndNoMiss) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x9400, 0, {}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));
  stash_stats before = Stats(reg.get());
  stash_key other = MakeKey(0x9400, 0, {}, 1);
  EXPECT_EQ(stash_share(reg.get(), &other, id), STASH_ERR_MISSING);
  EXPECT_EQ(stash_share(reg.get(), &key, id + 1), STASH_ERR_MISSING);
  // Ids start at 1, so no record has id 0.
  EXPECT_EQ(stash_share(reg.get(), &key, 0), STASH_ERR_MISSING);
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(Peek(reg.get(), key).refs, 1u);
}

TEST(StashRegistry, ReleaseIdDropsOneReferenceAndReleasesOnlyWithTheLast) {
  Payload p;
  Registry reg;
  p.bytes = 40;
  stash_key key = MakeKey(0x9500, 0, {}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));
  ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);
  ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);

  for (uint32_t left = 2; left >= 1; --left) {
    ASSERT_EQ(stash_release_id(reg.get(), id), STASH_OK);
    EXPECT_EQ(Peek(reg.get(), key).refs, left);
    EXPECT_EQ(p.releases.load(), 0);
    EXPECT_EQ(Stats(reg.get()).bytes, 40u);
  }
  ASSERT_EQ(stash_release_id(reg.get(), id), STASH_OK);
  EXPECT_EQ(p.releases.load(), 1);
  EXPECT_EQ(p.retains.load(), 0);
  stash_stats want = FreshStats();
  want.peak_bytes = 40;
  want.keeps = 3;
  want.released_unused = 3;
  EXPECT_EQ(Stats(reg.get()), want);

  // The record is gone: its id is unknown now.
  EXPECT_EQ(stash_release_id(reg.get(), id), STASH_ERR_MISSING);
  EXPECT_EQ(p.releases.load(), 1);
}

TEST(StashRegistry, ReleaseIdOfAnUnknownIdIsMissingAndCountsNothing) {
  Payload held, taken;
  Registry reg;
  stash_key kh = MakeKey(0x9600, 0, {}, 0), kt = MakeKey(0x9600, 0, {}, 1);
  uint64_t held_id = Keep(reg.get(), kh, EntryFor(held));
  uint64_t taken_id = Keep(reg.get(), kt, EntryFor(taken));
  ASSERT_EQ(Take(reg.get(), kt).status, STASH_OK);
  stash_stats before = Stats(reg.get());

  for (uint64_t id : {uint64_t(0), taken_id, held_id + 1, uint64_t(UINT64_MAX)}) {
    EXPECT_EQ(stash_release_id(reg.get(), id), STASH_ERR_MISSING) << id;
  }
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(held.releases.load() + taken.releases.load(), 0);
}

TEST(StashRegistry, ReleaseIdFindsItsRecordWhateverTheKey) {
  std::deque<Payload> payloads(12);
  Registry reg;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 12; ++i) {
    ids.push_back(Keep(reg.get(), MakeKey(0x9700 + 64 * uintptr_t(i % 3), i, {i}, i % 2),
                       EntryFor(payloads[size_t(i)])));
  }
  ASSERT_EQ(stash_release_id(reg.get(), ids[7]), STASH_OK);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(payloads[size_t(i)].releases.load(), i == 7 ? 1 : 0) << i;
  EXPECT_EQ(Stats(reg.get()).entries, 11u);
}

TEST(StashRegistry, SharedTakesAndReleaseIdsBalanceEveryReference) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x9800, 0, {}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));
  for (int i = 0; i < 3; ++i) ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);
  // Four forwards: two recomputes take theirs, two are dropped unused.
  ASSERT_EQ(Take(reg.get(), key).status, STASH_OK);
  ASSERT_EQ(stash_release_id(reg.get(), id), STASH_OK);
  ASSERT_EQ(Take(reg.get(), key).status, STASH_OK);
  EXPECT_EQ(p.releases.load(), 0);
  ASSERT_EQ(stash_release_id(reg.get(), id), STASH_OK);

  // Both takes left others sharing the record, so each got a retained reference;
  // the registry's own was released with the last forward, dropped unused.
  EXPECT_EQ(p.retains.load(), 2);
  EXPECT_EQ(p.releases.load(), 1);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.keeps, s.replays + s.released_unused);
  EXPECT_EQ(s.replays, 2u);
  EXPECT_EQ(s.released_unused, 2u);
  EXPECT_EQ(s.entries, 0u);
}

// --- declined records --------------------------------------------------------------

TEST(StashRegistry, DeclineStoresARecordWithoutBytesAndCountsDeclined) {
  Payload p;
  Registry reg;
  p.bytes = 500;
  stash_key key = MakeKey(0xa000, 0, {2}, 0);
  uint64_t id = Decline(reg.get(), key, EntryFor(p));
  EXPECT_EQ(id, 1u);
  EXPECT_EQ(Peek(reg.get(), key), (Held{&p, 0, id, 1, true}));
  stash_stats want = FreshStats();
  want.entries = 1;
  want.declined = 1;
  EXPECT_EQ(Stats(reg.get()), want);
}

TEST(StashRegistry, DeclineIsNeverRefusedByTheBudget) {
  Payload held, declined;
  Registry reg;
  held.bytes = 10;
  declined.bytes = SIZE_MAX;
  Keep(reg.get(), MakeKey(0xa100, 0, {}, 0), EntryFor(held));
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 0), STASH_OK);  // already passed by what is held
  Decline(reg.get(), MakeKey(0xa100, 0, {}, 1), EntryFor(declined));
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.declined, 1u);
  EXPECT_EQ(s.bytes, 10u);
}

TEST(StashRegistry, TakeOfADeclinedRecordReportsItAndIsNoReplay) {
  Payload p;
  Registry reg;
  p.bytes = 500;
  stash_key key = MakeKey(0xa200, 0, {}, 0);
  uint64_t id = Decline(reg.get(), key, EntryFor(p));
  Taken t = Take(reg.get(), key);
  ASSERT_EQ(t.status, STASH_OK);
  EXPECT_NE(t.declined, 0);
  EXPECT_EQ(t.id, id);
  EXPECT_EQ(t.entry.payload, &p);
  EXPECT_EQ(t.entry.bytes, 0u);  // a declined record holds no bytes
  stash_stats want = FreshStats();
  want.declined = 1;
  EXPECT_EQ(Stats(reg.get()), want);  // neither a replay nor a miss
  reg.Destroy();
  EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, ShareOfADeclinedRecordCountsDeclinedAndItsTakesRetain) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0xa300, 0, {}, 0);
  uint64_t id = Decline(reg.get(), key, EntryFor(p));
  ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.declined, 2u);
  EXPECT_EQ(s.keeps, 0u);

  Taken first = Take(reg.get(), key);
  ASSERT_EQ(first.status, STASH_OK);
  EXPECT_NE(first.declined, 0);
  EXPECT_EQ(p.retains.load(), 1);
  Taken last = Take(reg.get(), key);
  ASSERT_EQ(last.status, STASH_OK);
  EXPECT_NE(last.declined, 0);
  EXPECT_EQ(p.retains.load(), 1);
  EXPECT_EQ(Stats(reg.get()).replays, 0u);
}

TEST(StashRegistry, DeclinedRecordsAreReleasedLikeKeptOnes) {
  Payload a, b, c;
  {
    Registry reg;
    stash_key ka = MakeKey(0xa400, 0, {}, 0), kb = MakeKey(0xa400, 0, {}, 1),
              kc = MakeKey(0xa400, 0, {}, 2);
    uint64_t ida = Decline(reg.get(), ka, EntryFor(a));
    ASSERT_EQ(stash_share(reg.get(), &ka, ida), STASH_OK);
    ASSERT_EQ(stash_release_id(reg.get(), ida), STASH_OK);
    ASSERT_EQ(stash_release_id(reg.get(), ida), STASH_OK);
    Decline(reg.get(), kb, EntryFor(b));
    ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
    Decline(reg.get(), kc, EntryFor(c));
    EXPECT_EQ(Stats(reg.get()).released_unused, 3u);
  }
  EXPECT_EQ(a.releases.load(), 1);
  EXPECT_EQ(b.releases.load(), 1);
  EXPECT_EQ(c.releases.load(), 1);  // by destroy
}

// --- budget ------------------------------------------------------------------

TEST(StashRegistry, WithoutABudgetAnyKeepThatFitsInTheCountersIsAccepted) {
  Payload huge;
  Registry reg;
  huge.bytes = SIZE_MAX;
  Keep(reg.get(), MakeKey(0xb000, 0, {}, 0), EntryFor(huge));
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.max_bytes, UINT64_MAX);
  EXPECT_EQ(s.bytes, uint64_t(SIZE_MAX));
  EXPECT_EQ(s.peak_bytes, uint64_t(SIZE_MAX));
}

TEST(StashRegistry, SetMaxBytesIsReadBackInStatsAndTouchesNothingElse) {
  Payload p;
  Registry reg;
  p.bytes = 30;
  Keep(reg.get(), MakeKey(0xb100, 0, {}, 0), EntryFor(p));
  stash_stats want = Stats(reg.get());
  for (uint64_t max : {uint64_t(1000), uint64_t(0), uint64_t(UINT64_MAX)}) {
    ASSERT_EQ(stash_set_max_bytes(reg.get(), max), STASH_OK);
    want.max_bytes = max;
    EXPECT_EQ(Stats(reg.get()), want);
  }
}

TEST(StashRegistry, KeepThatWouldPassTheBudgetIsRefusedAndChangesNothing) {
  Payload a, b, c;
  Registry reg;
  a.bytes = 60;
  b.bytes = 41;
  c.bytes = 40;
  stash_key ka = MakeKey(0xb200, 0, {}, 0), kb = MakeKey(0xb200, 0, {}, 1),
            kc = MakeKey(0xb200, 0, {}, 2);
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);
  Keep(reg.get(), ka, EntryFor(a));
  stash_stats before = Stats(reg.get());

  EXPECT_EQ(stash_keep(reg.get(), &kb, EntryFor(b), nullptr), STASH_ERR_BUDGET);
  EXPECT_EQ(Stats(reg.get()), before);  // no counter moves
  EXPECT_EQ(stash_peek(reg.get(), &kb, [](const stash_record *, void *) {}, nullptr), STASH_ERR_MISSING);
  EXPECT_EQ(b.retains.load() + b.releases.load(), 0);  // still the caller's

  // Exactly reaching the budget is allowed.
  Keep(reg.get(), kc, EntryFor(c));
  EXPECT_EQ(Stats(reg.get()).bytes, 100u);
  // The caller may store the refused forward as declined instead.
  Decline(reg.get(), kb, EntryFor(b));
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 100u);
  EXPECT_EQ(s.peak_bytes, 100u);
  EXPECT_EQ(s.keeps, 2u);
  EXPECT_EQ(s.declined, 1u);
}

TEST(StashRegistry, ZeroBudgetRefusesEveryNonEmptyKeep) {
  Payload one, empty, declined;
  Registry reg;
  one.bytes = 1;
  declined.bytes = 1000;
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 0), STASH_OK);
  stash_key k1 = MakeKey(0xb300, 0, {}, 0);
  EXPECT_EQ(stash_keep(reg.get(), &k1, EntryFor(one), nullptr), STASH_ERR_BUDGET);
  Keep(reg.get(), MakeKey(0xb300, 0, {}, 1), EntryFor(empty));
  Decline(reg.get(), k1, EntryFor(declined));
  stash_stats want = FreshStats();
  want.max_bytes = 0;
  want.entries = 2;
  want.keeps = 1;
  want.declined = 1;
  EXPECT_EQ(Stats(reg.get()), want);
}

TEST(StashRegistry, BudgetComparisonCannotOverflow) {
  static_assert(sizeof(size_t) == sizeof(uint64_t), "the huge sizes below assume a 64-bit size_t");
  Payload held, huge, fits;
  Registry reg;
  held.bytes = 50;
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);
  Keep(reg.get(), MakeKey(0xb400, 0, {}, 0), EntryFor(held));
  stash_stats before = Stats(reg.get());

  // Each of these alone passes the budget; 50 + bytes computed in 64 bits would wrap
  // to 49, 0 and 9, well under it.
  stash_key key = MakeKey(0xb400, 0, {}, 1);
  for (size_t bytes : {SIZE_MAX, SIZE_MAX - 49, SIZE_MAX - 40, size_t(101)}) {
    huge.bytes = bytes;
    EXPECT_EQ(stash_keep(reg.get(), &key, EntryFor(huge), nullptr), STASH_ERR_BUDGET) << bytes;
  }
  EXPECT_EQ(Stats(reg.get()), before);

  // Without a cap the sum still must not wrap: 50 + (2^64 - 50) does not fit.
  ASSERT_EQ(stash_set_max_bytes(reg.get(), UINT64_MAX), STASH_OK);
  huge.bytes = SIZE_MAX - 49;
  EXPECT_EQ(stash_keep(reg.get(), &key, EntryFor(huge), nullptr), STASH_ERR_BUDGET);
  fits.bytes = SIZE_MAX - 50;
  Keep(reg.get(), key, EntryFor(fits));
  EXPECT_EQ(Stats(reg.get()).bytes, UINT64_MAX);
  EXPECT_EQ(huge.retains.load() + huge.releases.load(), 0);
}

TEST(StashRegistry, LoweringTheBudgetBelowWhatIsHeldKeepsItAndRefusesEveryKeep) {
  Payload a, b, small, empty, c;
  Registry reg;
  a.bytes = 100;
  b.bytes = 30;
  small.bytes = 1;
  c.bytes = 19;
  stash_key ka = MakeKey(0xb500, 0, {}, 0), kb = MakeKey(0xb500, 0, {}, 1),
            ks = MakeKey(0xb500, 0, {}, 2), ke = MakeKey(0xb500, 0, {}, 3),
            kc = MakeKey(0xb500, 0, {}, 4);
  uint64_t ida = Keep(reg.get(), ka, EntryFor(a));
  Keep(reg.get(), kb, EntryFor(b));
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 50), STASH_OK);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.bytes, 130u);
  EXPECT_EQ(a.releases.load() + b.releases.load(), 0);

  // Over the budget, even an empty keep is refused; sharing holds no new bytes.
  EXPECT_EQ(stash_keep(reg.get(), &ks, EntryFor(small), nullptr), STASH_ERR_BUDGET);
  EXPECT_EQ(stash_keep(reg.get(), &ke, EntryFor(empty), nullptr), STASH_ERR_BUDGET);
  EXPECT_EQ(stash_share(reg.get(), &ka, ida), STASH_OK);

  // Once the bytes held fall under the budget, keeps that fit go in again.
  ASSERT_EQ(Take(reg.get(), ka).status, STASH_OK);
  EXPECT_EQ(Stats(reg.get()).bytes, 130u);  // a is still shared
  ASSERT_EQ(Take(reg.get(), ka).status, STASH_OK);
  Keep(reg.get(), ks, EntryFor(small));
  Keep(reg.get(), kc, EntryFor(c));
  EXPECT_EQ(Stats(reg.get()).bytes, 50u);
  EXPECT_EQ(stash_keep(reg.get(), &ke, EntryFor(small), nullptr), STASH_ERR_BUDGET);
  EXPECT_EQ(Stats(reg.get()).peak_bytes, 130u);
}

// --- budget demotion ---------------------------------------------------------

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

TEST(StashRegistryDemotion, KeepOverTheBudgetDemotesTheOldestKeptRecordIntoADeclinedStandIn) {
  Demotables d({60});
  Payload b;
  Registry reg;
  b.bytes = 60;
  stash_key ka = MakeKey(0xe000, 0, {2}, 0), kb = MakeKey(0xe040, 0, {2}, 0);
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);
  uint64_t ida = Keep(reg.get(), ka, d.Entry(0));
  EXPECT_EQ(d.Demotes(0), 0);  // it fitted: nothing demoted
  uint64_t idb = Keep(reg.get(), kb, EntryFor(b));

  // The old record holds the stand-in, no bytes, and its id; the new one is kept.
  EXPECT_EQ(Peek(reg.get(), ka), d.Demoted(0, ida));
  EXPECT_EQ(Peek(reg.get(), kb), (Held{&b, 60, idb, 1, false}));
  stash_stats want = FreshStats();
  want.max_bytes = 100;
  want.entries = 2;
  want.bytes = want.peak_bytes = 60;  // never 120, not even for a moment
  want.keeps = 1;                     // the demoted forward moved from keeps...
  want.declined = 1;                  // ...to declined
  EXPECT_EQ(Stats(reg.get()), want);

  // Its demote callback ran once, on its payload; the registry released its reference
  // to the old payload and holds the stand-in's, which nothing retained or released.
  EXPECT_EQ(d.log, std::vector<int>({0}));
  EXPECT_EQ(d.originals[0].releases.load(), 1);
  EXPECT_EQ(d.originals[0].retains.load(), 0);
  EXPECT_EQ(d.stand_ins[0].releases.load() + d.stand_ins[0].retains.load(), 0);
  EXPECT_EQ(b.releases.load() + b.retains.load() + b.demotes.load(), 0);

  // The demoted record keeps its entry's callbacks.
  struct Seen {
    stash_entry entry;
    int declined;
  } seen{};
  ASSERT_EQ(stash_peek(
                reg.get(), &ka,
                [](const stash_record *r, void *c) { *static_cast<Seen *>(c) = Seen{*r->entry, r->declined}; },
                &seen),
            STASH_OK);
  EXPECT_EQ(seen.entry.retain, &CountRetain);
  EXPECT_EQ(seen.entry.release, &CountRelease);
  EXPECT_EQ(seen.entry.demote, &DemoteToStandIn);
  EXPECT_NE(seen.declined, 0);

  reg.Destroy();
  EXPECT_EQ(d.originals[0].releases.load(), 1);  // not again
  EXPECT_EQ(d.stand_ins[0].releases.load(), 1);
  EXPECT_EQ(b.releases.load(), 1);
}

TEST(StashRegistryDemotion, TheOldestRecordsByIdAreDemotedWhateverTheirAnchorVersionOrSlot) {
  // Twelve demotable records of 10 bytes: the even ones in one chain (one anchor, slots
  // 0, 2, ..., newest at the chain's head), the odd ones under anchors in reverse order.
  const size_t n = 12;
  Demotables d(std::vector<size_t>(n, 10));
  Payload n1, n2, n3, n4;
  Registry reg;
  n1.bytes = 35;
  n2.bytes = 10;
  n3.bytes = 50;
  n4.bytes = 40;
  std::vector<stash_key> keys;
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < n; ++i) {
    keys.push_back(i % 2 == 0 ? MakeKey(0xe100, 0, {4}, int64_t(i))
                              : MakeKey(0xe100 + 0x40 * (n - i), int64_t(i), {int64_t(i)}, 0));
    ids.push_back(Keep(reg.get(), keys[i], d.Entry(i)));
  }
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 120), STASH_OK);
  auto expect_demoted = [&](std::set<size_t> demoted, std::set<size_t> gone) {
    for (size_t i = 0; i < n; ++i) {
      if (gone.count(i)) continue;
      EXPECT_EQ(Peek(reg.get(), keys[i]), demoted.count(i) ? d.Demoted(i, ids[i]) : d.Kept(i, ids[i])) << i;
    }
  };

  // A hole: record 1 is taken back. 110 held; 35 more need 25: records 0, 2 and 3.
  ASSERT_EQ(Take(reg.get(), keys[1]).status, STASH_OK);
  Keep(reg.get(), MakeKey(0xe900, 0, {}, 0), EntryFor(n1));
  EXPECT_EQ(d.SortedLog(), std::vector<int>({0, 2, 3}));
  expect_demoted({0, 2, 3}, {1});
  EXPECT_EQ(Stats(reg.get()).bytes, 115u);

  // 10 more need 5: record 4 alone.
  Keep(reg.get(), MakeKey(0xe900, 0, {}, 1), EntryFor(n2));
  EXPECT_EQ(d.SortedLog(), std::vector<int>({0, 2, 3, 4}));
  expect_demoted({0, 2, 3, 4}, {1});

  // 50 more need 45: records 5 to 9, not the newer kept records 10 and 11.
  Keep(reg.get(), MakeKey(0xe900, 0, {}, 2), EntryFor(n3));
  EXPECT_EQ(d.SortedLog(), std::vector<int>({0, 2, 3, 4, 5, 6, 7, 8, 9}));
  expect_demoted({0, 2, 3, 4, 5, 6, 7, 8, 9}, {1});
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 115u);
  EXPECT_EQ(s.peak_bytes, 120u);
  EXPECT_EQ(s.keeps, 2u + 3u + 1u);  // records 10, 11 and n1..n3 (and 1, taken)
  EXPECT_EQ(s.declined, 9u);

  // 40 more need 35, but only records 10 and 11 (20 bytes) can still be demoted.
  stash_key k4 = MakeKey(0xe900, 0, {}, 3);
  EXPECT_EQ(stash_keep(reg.get(), &k4, EntryFor(n4), nullptr), STASH_ERR_BUDGET);
  EXPECT_EQ(Stats(reg.get()), s);
  expect_demoted({0, 2, 3, 4, 5, 6, 7, 8, 9}, {1});
  for (size_t i = 0; i < n; ++i) {
    const bool demoted = i != 1 && i < 10;
    EXPECT_EQ(d.originals[i].releases.load(), demoted ? 1 : 0) << i;
    // A demoted record holds its stand-in; one made in vain for 10 or 11 was released.
    EXPECT_EQ(d.stand_ins[i].releases.load(), demoted ? 0 : d.Demotes(i)) << i;
    EXPECT_LE(d.Demotes(i), 1) << i;
  }
}

TEST(StashRegistryDemotion, OnlyAsManyRecordsAreDemotedAsTheKeepNeeds) {
  Demotables d({10, 20, 30});
  Payload a, b, empty, fits;
  Registry reg;
  a.bytes = 10;
  b.bytes = 15;
  fits.bytes = 5;
  std::vector<stash_key> keys = {MakeKey(0xe200, 0, {}, 0), MakeKey(0xe200, 0, {}, 1), MakeKey(0xe200, 0, {}, 2)};
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < 3; ++i) ids.push_back(Keep(reg.get(), keys[i], d.Entry(i)));
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 60), STASH_OK);

  // An empty keep at a full budget needs no room.
  Keep(reg.get(), MakeKey(0xe240, 0, {}, 0), EntryFor(empty));
  EXPECT_TRUE(d.log.empty());
  // 10 more need 10: the 10-byte record, exactly.
  Keep(reg.get(), MakeKey(0xe240, 0, {}, 1), EntryFor(a));
  EXPECT_EQ(d.log, std::vector<int>({0}));
  // 15 more need 15: the 20-byte record frees enough; the 30-byte one stays.
  Keep(reg.get(), MakeKey(0xe240, 0, {}, 2), EntryFor(b));
  EXPECT_EQ(d.SortedLog(), std::vector<int>({0, 1}));
  EXPECT_EQ(Peek(reg.get(), keys[0]), d.Demoted(0, ids[0]));
  EXPECT_EQ(Peek(reg.get(), keys[1]), d.Demoted(1, ids[1]));
  EXPECT_EQ(Peek(reg.get(), keys[2]), d.Kept(2, ids[2]));
  EXPECT_EQ(Stats(reg.get()).bytes, 55u);
  // 5 more fit exactly: nothing is demoted.
  Keep(reg.get(), MakeKey(0xe240, 0, {}, 3), EntryFor(fits));
  EXPECT_EQ(d.SortedLog(), std::vector<int>({0, 1}));
  EXPECT_EQ(Peek(reg.get(), keys[2]), d.Kept(2, ids[2]));
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 60u);
  EXPECT_EQ(s.peak_bytes, 60u);
  EXPECT_EQ(s.keeps, 5u);
  EXPECT_EQ(s.declined, 2u);
}

TEST(StashRegistryDemotion, DeclinedAndNonDemotableRecordsAreSkippedAndADemotedRecordIsNeverDemotedAgain) {
  // Ids 1..4: a declined record with a demote callback, a kept one without, two demotable.
  Demotables d({50, 40, 30, 30});
  Payload n1, n2, n3;
  Registry reg;
  n1.bytes = n2.bytes = n3.bytes = 30;
  stash_key k0 = MakeKey(0xe300, 0, {}, 0), k1 = MakeKey(0xe300, 0, {}, 1), k2 = MakeKey(0xe300, 0, {}, 2),
            k3 = MakeKey(0xe300, 0, {}, 3);
  uint64_t id0 = Decline(reg.get(), k0, d.Entry(0));
  stash_entry plain = d.Entry(1);
  plain.demote = nullptr;  // never demoted
  uint64_t id1 = Keep(reg.get(), k1, plain);
  uint64_t id2 = Keep(reg.get(), k2, d.Entry(2));
  uint64_t id3 = Keep(reg.get(), k3, d.Entry(3));
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);

  Keep(reg.get(), MakeKey(0xe340, 0, {}, 0), EntryFor(n1));
  EXPECT_EQ(d.log, std::vector<int>({2}));
  Keep(reg.get(), MakeKey(0xe340, 0, {}, 1), EntryFor(n2));
  EXPECT_EQ(d.SortedLog(), std::vector<int>({2, 3}));
  // Only the kept record without a demote callback and the new ones hold bytes now.
  stash_key k6 = MakeKey(0xe340, 0, {}, 2);
  EXPECT_EQ(stash_keep(reg.get(), &k6, EntryFor(n3), nullptr), STASH_ERR_BUDGET);
  EXPECT_EQ(d.SortedLog(), std::vector<int>({2, 3}));

  EXPECT_EQ(Peek(reg.get(), k0), (Held{&d.originals[0], 0, id0, 1, true}));  // declined, not demoted
  EXPECT_EQ(Peek(reg.get(), k1), d.Kept(1, id1));
  EXPECT_EQ(Peek(reg.get(), k2), d.Demoted(2, id2));
  EXPECT_EQ(Peek(reg.get(), k3), d.Demoted(3, id3));
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(d.originals[i].releases.load() + d.stand_ins[i].releases.load(), 0) << i;
  }
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 100u);
  EXPECT_EQ(s.keeps, 3u);
  EXPECT_EQ(s.declined, 3u);
}

TEST(StashRegistryDemotion, TakeOfADemotedRecordHandsOutItsStandInAsDeclinedAndIsNoReplay) {
  Demotables d({80, 80});
  Payload b, c;
  Registry reg;
  b.bytes = c.bytes = 80;
  stash_key k0 = MakeKey(0xe400, 0, {3}, 0), k1 = MakeKey(0xe400, 1, {3}, 0);
  uint64_t id0 = Keep(reg.get(), k0, d.Entry(0));
  uint64_t id1 = Keep(reg.get(), k1, d.Entry(1));
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 160), STASH_OK);
  Keep(reg.get(), MakeKey(0xe400, 2, {3}, 0), EntryFor(b));
  EXPECT_EQ(d.log, std::vector<int>({0}));
  Keep(reg.get(), MakeKey(0xe400, 3, {3}, 0), EntryFor(c));
  EXPECT_EQ(d.SortedLog(), std::vector<int>({0, 1}));

  // By key, and by key and id.
  for (size_t i = 0; i < 2; ++i) {
    Taken t = Take(reg.get(), i == 0 ? k0 : k1, i == 0 ? 0 : id1);
    ASSERT_EQ(t.status, STASH_OK) << i;
    EXPECT_EQ(t.entry.payload, &d.stand_ins[i]) << i;
    EXPECT_EQ(t.entry.bytes, 0u) << i;
    EXPECT_EQ(t.entry.retain, &CountRetain) << i;
    EXPECT_EQ(t.entry.release, &CountRelease) << i;
    EXPECT_EQ(t.entry.demote, &DemoteToStandIn) << i;
    EXPECT_EQ(t.id, i == 0 ? id0 : id1) << i;
    EXPECT_EQ(t.declined, 1) << i;
  }
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.replays, 0u);
  EXPECT_EQ(s.misses, 0u);
  EXPECT_EQ(s.declined, 2u);
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.keeps + s.declined, s.replays + 2u /* declined takes */ + s.released_unused + LiveRefs(reg.get()));
  reg.Destroy();
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(d.originals[i].releases.load(), 1) << i;  // at the demotion
    EXPECT_EQ(d.stand_ins[i].releases.load(), 0) << i;  // handed out
    EXPECT_EQ(d.stand_ins[i].retains.load(), 0) << i;
  }
}

TEST(StashRegistryDemotion, ASharedRecordIsDemotedWithAllItsReferencesMovingFromKeepsToDeclined) {
  Demotables d({70});
  Payload b;
  Registry reg;
  b.bytes = 50;
  stash_key ka = MakeKey(0xe500, 0, {}, 0), kb = MakeKey(0xe500, 0, {}, 1);
  uint64_t id = Keep(reg.get(), ka, d.Entry(0));
  ASSERT_EQ(stash_share(reg.get(), &ka, id), STASH_OK);
  ASSERT_EQ(stash_share(reg.get(), &ka, id), STASH_OK);
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).keeps, 3u);

  Keep(reg.get(), kb, EntryFor(b));
  EXPECT_EQ(Peek(reg.get(), ka), d.Demoted(0, id, 3));
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.keeps, 1u);
  EXPECT_EQ(s.declined, 3u);
  EXPECT_EQ(s.bytes, 50u);
  // One reference of the old payload, the registry's, however many forwards: released once.
  EXPECT_EQ(d.originals[0].releases.load(), 1);
  EXPECT_EQ(d.originals[0].retains.load(), 0);
  EXPECT_EQ(d.stand_ins[0].retains.load(), 0);

  // One more forward shares it: declined now.
  ASSERT_EQ(stash_share(reg.get(), &ka, id), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).declined, 4u);
  // Takes while others share it retain the stand-in; the last one gets the registry's.
  Taken t1 = Take(reg.get(), ka);
  ASSERT_EQ(t1.status, STASH_OK);
  EXPECT_EQ(t1.entry.payload, &d.stand_ins[0]);
  EXPECT_EQ(t1.declined, 1);
  EXPECT_EQ(d.stand_ins[0].retains.load(), 1);
  ASSERT_EQ(stash_release_id(reg.get(), id), STASH_OK);
  Taken t2 = Take(reg.get(), ka, id);
  ASSERT_EQ(t2.status, STASH_OK);
  EXPECT_EQ(t2.entry.payload, &d.stand_ins[0]);
  EXPECT_EQ(d.stand_ins[0].retains.load(), 2);
  Taken t3 = Take(reg.get(), ka);
  ASSERT_EQ(t3.status, STASH_OK);
  EXPECT_EQ(t3.entry.payload, &d.stand_ins[0]);
  EXPECT_EQ(t3.declined, 1);
  EXPECT_EQ(d.stand_ins[0].retains.load(), 2);
  EXPECT_EQ(Take(reg.get(), ka).status, STASH_ERR_MISSING);

  s = Stats(reg.get());
  EXPECT_EQ(s.replays, 0u);
  EXPECT_EQ(s.released_unused, 1u);
  EXPECT_EQ(s.keeps + s.declined, s.replays + 3u /* declined takes */ + s.released_unused + LiveRefs(reg.get()));
  reg.Destroy();
  EXPECT_EQ(d.originals[0].releases.load(), 1);
  EXPECT_EQ(d.stand_ins[0].releases.load(), 0);  // all three references were handed out
  EXPECT_EQ(d.Demotes(0), 1);
  EXPECT_EQ(b.releases.load(), 1);
}

TEST(StashRegistryDemotion, EveryPayloadIsReleasedExactlyOnceStandInsIncludedAndNoneThatWasHandedOut) {
  // Six demotable records, all demoted by one keep, then dropped every way there is.
  const size_t n = 6;
  Demotables d(std::vector<size_t>(n, 10));
  Payload big;
  std::vector<stash_key> keys;
  std::vector<uint64_t> ids;
  {
    Registry reg;
    big.bytes = 60;
    for (size_t i = 0; i < n; ++i) {
      keys.push_back(MakeKey(0xe600 + 0x40 * (i % 2), int64_t(i), {}, 0));
      ids.push_back(Keep(reg.get(), keys[i], d.Entry(i)));
    }
    ASSERT_EQ(stash_share(reg.get(), &keys[3], ids[3]), STASH_OK);
    ASSERT_EQ(stash_set_max_bytes(reg.get(), 60), STASH_OK);
    Keep(reg.get(), MakeKey(0xe700, 0, {}, 0), EntryFor(big));
    EXPECT_EQ(d.SortedLog(), std::vector<int>({0, 1, 2, 3, 4, 5}));
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(d.originals[i].releases.load(), 1) << i;
      EXPECT_EQ(d.stand_ins[i].releases.load(), 0) << i;
    }
    ASSERT_EQ(Take(reg.get(), keys[0]).status, STASH_OK);     // 0: handed out
    ASSERT_EQ(stash_release_id(reg.get(), ids[1]), STASH_OK);  // 1: by id
    EXPECT_EQ(d.stand_ins[1].releases.load(), 1);
    auto version2 = [](const stash_record *r, void *) { return int(r->key->version == 2); };
    size_t released = 0;
    ASSERT_EQ(stash_release_if(reg.get(), version2, nullptr, &released), STASH_OK);  // 2
    EXPECT_EQ(released, 1u);
    EXPECT_EQ(d.stand_ins[2].releases.load(), 1);
    ASSERT_EQ(Take(reg.get(), keys[3]).status, STASH_OK);  // 3: one forward takes (retained)...
    ASSERT_EQ(stash_release_id(reg.get(), ids[3]), STASH_OK);  // ...the other is dropped
    EXPECT_EQ(d.stand_ins[3].retains.load(), 1);
    EXPECT_EQ(d.stand_ins[3].releases.load(), 1);
    auto anchor0 = [](const stash_record *r, void *) { return int(r->key->anchor == 0xe600 && r->declined); };
    ASSERT_EQ(stash_release_if(reg.get(), anchor0, nullptr, &released), STASH_OK);  // 4
    EXPECT_EQ(released, 1u);
    stash_stats s = Stats(reg.get());
    EXPECT_EQ(s.entries, 2u);  // 5 and big, for destroy
    EXPECT_EQ(s.keeps, 1u);
    EXPECT_EQ(s.declined, 7u);
    EXPECT_EQ(s.released_unused, 4u);
    EXPECT_EQ(s.replays, 0u);
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(d.originals[i].releases.load(), 1) << i;
    EXPECT_EQ(d.originals[i].retains.load(), 0) << i;
    EXPECT_EQ(d.stand_ins[i].releases.load(), i == 0 ? 0 : 1) << i;
    EXPECT_EQ(d.Demotes(i), 1) << i;
  }
  EXPECT_EQ(big.releases.load(), 1);
}

TEST(StashRegistryDemotion, ADemotedEntryWithoutAReleaseCallbackIsDemotedAllTheSame) {
  Payload a, stand_in, b;
  Registry reg;
  a.bytes = b.bytes = 40;
  stash_key ka = MakeKey(0xe780, 0, {}, 0);
  stash_entry e = DemotableEntryFor(a, &stand_in);
  e.release = nullptr;
  uint64_t id = Keep(reg.get(), ka, e);
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 50), STASH_OK);
  Keep(reg.get(), MakeKey(0xe780, 0, {}, 1), EntryFor(b));
  EXPECT_EQ(Peek(reg.get(), ka), (Held{&stand_in, 0, id, 1, true}));
  EXPECT_EQ(a.demotes.load(), 1);
  reg.Destroy();
  EXPECT_EQ(a.releases.load() + stand_in.releases.load(), 0);
  EXPECT_EQ(b.releases.load(), 1);
}

TEST(StashRegistryDemotion, KeepThatDemotingEveryRecordCouldNotMakeRoomForChangesNothing) {
  Demotables d({20, 30, 25});
  Payload big, held, too_big, fits;
  Registry reg;
  held.bytes = 50;
  big.bytes = 51;
  too_big.bytes = 101;
  fits.bytes = 40;
  std::vector<stash_key> keys = {MakeKey(0xe800, 0, {}, 0), MakeKey(0xe800, 0, {}, 1), MakeKey(0xe840, 0, {}, 0)};
  uint64_t id0 = Keep(reg.get(), keys[0], d.Entry(0));
  Keep(reg.get(), MakeKey(0xe880, 0, {}, 0), EntryFor(held));  // not demotable
  Decline(reg.get(), MakeKey(0xe880, 0, {}, 1), d.Entry(2));   // declined: nothing to free
  uint64_t id1 = Keep(reg.get(), keys[1], d.Entry(1));
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);
  const stash_stats before = Stats(reg.get());
  const auto contents = Contents(reg.get());
  ASSERT_EQ(before.bytes, 100u);

  // 101 bytes pass the budget by themselves, whatever is demoted (50 bytes could be).
  stash_key kbig = MakeKey(0xe8c0, 0, {}, 0);
  EXPECT_EQ(stash_keep(reg.get(), &kbig, EntryFor(too_big), nullptr), STASH_ERR_BUDGET);
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(Contents(reg.get()), contents);
  // With the 30-byte record taken, 70 are held, 20 of them demotable: 51 more need 21.
  ASSERT_EQ(Take(reg.get(), keys[1], id1).status, STASH_OK);
  const stash_stats before2 = Stats(reg.get());
  const auto contents2 = Contents(reg.get());
  EXPECT_EQ(stash_keep(reg.get(), &kbig, EntryFor(big), nullptr), STASH_ERR_BUDGET);
  EXPECT_EQ(Stats(reg.get()), before2);
  EXPECT_EQ(Contents(reg.get()), contents2);
  EXPECT_EQ(Peek(reg.get(), keys[0]), d.Kept(0, id0));
  // Nothing was released, retained or stored: a stand-in made in vain (if any) is
  // released, each exactly once.
  for (Payload *p : {&big, &too_big, &held}) EXPECT_EQ(p->releases.load() + p->retains.load(), 0);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(d.originals[i].releases.load(), 0) << i;
    EXPECT_EQ(d.stand_ins[i].releases.load(), d.Demotes(i)) << i;
    EXPECT_EQ(d.stand_ins[i].retains.load(), 0) << i;
  }

  // 40 more need 10: the 20-byte record makes room.
  const int vain = d.stand_ins[0].releases.load();
  Keep(reg.get(), kbig, EntryFor(fits));
  EXPECT_EQ(Peek(reg.get(), keys[0]), d.Demoted(0, id0));
  EXPECT_EQ(d.originals[0].releases.load(), 1);
  EXPECT_EQ(d.stand_ins[0].releases.load(), vain);
}

TEST(StashRegistryDemotion, ADemoteCallbackFailingPartWayChangesNothingAndReleasesTheStandInsMadeInVain) {
  // Four records of 10 at a full budget of 40; 35 more need all four. Record 1 (and, in
  // the second round, record 0) cannot make a stand-in.
  const size_t n = 4;
  Demotables d(std::vector<size_t>(n, 10));
  std::deque<Payload> second(n);  // fresh stand-ins for the keep that succeeds
  Payload big;
  Registry reg;
  big.bytes = 35;
  std::vector<stash_key> keys;
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < n; ++i) {
    keys.push_back(MakeKey(0xea00 + 0x40 * (i % 2), 0, {int64_t(i)}, int64_t(i)));
    ids.push_back(Keep(reg.get(), keys[i], d.Entry(i)));
  }
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 40), STASH_OK);
  const stash_stats before = Stats(reg.get());
  const auto contents = Contents(reg.get());
  stash_key kbig = MakeKey(0xeb00, 0, {}, 0);

  for (size_t failing : {size_t(1), size_t(0), size_t(3)}) {
    SCOPED_TRACE("failing " + std::to_string(failing));
    std::vector<int> demotes_before, releases_before;
    for (size_t i = 0; i < n; ++i) {
      demotes_before.push_back(d.Demotes(i));
      releases_before.push_back(d.stand_ins[i].releases.load());
    }
    d.originals[failing].stand_in = nullptr;
    EXPECT_EQ(stash_keep(reg.get(), &kbig, EntryFor(big), nullptr), STASH_ERR_BUDGET);
    d.originals[failing].stand_in = &d.stand_ins[failing];
    EXPECT_EQ(Stats(reg.get()), before);
    EXPECT_EQ(Contents(reg.get()), contents);
    EXPECT_EQ(d.Demotes(failing) - demotes_before[failing], 1);  // it had to be asked
    int made = 0;
    for (size_t i = 0; i < n; ++i) {
      if (i == failing) continue;
      int calls = d.Demotes(i) - demotes_before[i];
      EXPECT_LE(calls, 1) << i;
      made += calls;
      // Each stand-in made in vain is released exactly once, and nothing else is.
      EXPECT_EQ(d.stand_ins[i].releases.load() - releases_before[i], calls) << i;
      EXPECT_EQ(d.originals[i].releases.load(), 0) << i;
    }
    // Asked oldest first or youngest first, a stand-in is made before one in the middle fails.
    if (failing == 1) {
      EXPECT_GE(made, 1);
    }
    EXPECT_EQ(big.releases.load() + big.retains.load(), 0);
  }

  // With stand-ins for all, the same keep succeeds and demotes all four.
  for (size_t i = 0; i < n; ++i) d.originals[i].stand_in = &second[i];
  Keep(reg.get(), kbig, EntryFor(big));
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(Peek(reg.get(), keys[i]), (Held{&second[i], 0, ids[i], 1, true})) << i;
    EXPECT_EQ(d.originals[i].releases.load(), 1) << i;
  }
  reg.Destroy();
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(second[i].releases.load(), 1) << i;
    EXPECT_EQ(d.stand_ins[i].retains.load(), 0) << i;
  }
}

TEST(StashRegistryDemotion, ErrorsDeclinesAndSharesDemoteNothing) {
  Demotables d({50, 50});
  Payload p, bad;
  Registry reg;
  p.bytes = 60;
  bad.bytes = 60;
  stash_key k0 = MakeKey(0xec00, 0, {}, 0), k1 = MakeKey(0xec00, 0, {}, 1);
  uint64_t id0 = Keep(reg.get(), k0, d.Entry(0));
  Keep(reg.get(), k1, d.Entry(1));
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);
  const stash_stats before = Stats(reg.get());

  // A duplicate or a malformed key over the budget: an error, and nothing demoted.
  EXPECT_EQ(stash_keep(reg.get(), &k1, EntryFor(bad), nullptr), STASH_ERR_DUPLICATE);
  stash_key bad_rank = MakeKey(0xec40, 0, {}, 0);
  bad_rank.rank = STASH_MAX_RANK + 1;
  EXPECT_EQ(stash_keep(reg.get(), &bad_rank, EntryFor(bad), nullptr), STASH_ERR_RANK);
  EXPECT_EQ(stash_keep(reg.get(), nullptr, EntryFor(bad), nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(Stats(reg.get()), before);
  // A share holds no new bytes; a decline is never refused and holds none either.
  ASSERT_EQ(stash_share(reg.get(), &k0, id0), STASH_OK);
  Decline(reg.get(), MakeKey(0xec40, 0, {}, 1), EntryFor(p));
  EXPECT_TRUE(d.log.empty());
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 100u);
  EXPECT_EQ(s.keeps, 3u);
  EXPECT_EQ(s.declined, 1u);
  EXPECT_EQ(bad.releases.load() + bad.retains.load(), 0);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(d.stand_ins[i].releases.load() + d.originals[i].releases.load(), 0);
}

TEST(StashRegistryDemotion, DemotionMakesRoomUnderALoweredBudget) {
  // The budget lowered below what is held: a keep demotes the oldest records until what
  // is held, the new entry included, fits again.
  Demotables d({100, 30});
  Payload small;
  Registry reg;
  small.bytes = 1;
  stash_key k0 = MakeKey(0xed00, 0, {}, 0), k1 = MakeKey(0xed00, 0, {}, 1);
  uint64_t id0 = Keep(reg.get(), k0, d.Entry(0));
  uint64_t id1 = Keep(reg.get(), k1, d.Entry(1));
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 50), STASH_OK);
  EXPECT_TRUE(d.log.empty());  // lowering the budget demotes nothing by itself
  Keep(reg.get(), MakeKey(0xed00, 0, {}, 2), EntryFor(small));  // needs 81: the 100-byte record
  EXPECT_EQ(d.log, std::vector<int>({0}));
  EXPECT_EQ(Peek(reg.get(), k0), d.Demoted(0, id0));
  EXPECT_EQ(Peek(reg.get(), k1), d.Kept(1, id1));
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 31u);
  EXPECT_EQ(s.peak_bytes, 130u);  // from before the budget was lowered
}

// Payloads whose release callback re-enters the registry: it would deadlock if the
// registry released a demoted payload, or a stand-in made in vain, under its lock.
struct ReentrantDemotable {
  stash_registry *registry = nullptr;
  ReentrantDemotable *stand_in = nullptr;  // nullptr: the demote callback fails
  int demotes = 0;
  int releases = 0;
  stash_status status = STASH_ERR_MISSING;
  stash_stats seen{};  // the stats the release callback read
};
void *ReentrantDemote(void *payload) {
  auto *r = static_cast<ReentrantDemotable *>(payload);
  r->demotes++;
  return r->stand_in;
}
void ReentrantDemotableRelease(void *payload) {
  auto *r = static_cast<ReentrantDemotable *>(payload);
  r->releases++;
  r->status = stash_get_stats(r->registry, &r->seen);
  auto none = [](const stash_record *, void *) { return 0; };
  stash_release_if(r->registry, none, nullptr, nullptr);
}

TEST(StashRegistryDemotion, DemotedPayloadsAndStandInsMadeInVainAreReleasedAfterUnlocking) {
  ReentrantDemotable a, sa, c, sc, dd, c2, sc2;
  Payload b, e;
  Registry reg;
  for (ReentrantDemotable *r : {&a, &sa, &c, &sc, &dd, &c2, &sc2}) r->registry = reg.get();
  a.stand_in = &sa;
  c.stand_in = &sc;
  c2.stand_in = &sc2;
  b.bytes = 60;
  e.bytes = 60;
  auto entry = [](ReentrantDemotable &r, size_t bytes) {
    return stash_entry{&r, bytes, nullptr, ReentrantDemotableRelease, ReentrantDemote};
  };
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);
  Keep(reg.get(), MakeKey(0xee00, 0, {}, 0), entry(a, 60));
  Keep(reg.get(), MakeKey(0xee00, 0, {}, 1), EntryFor(b));

  // The old payload's release ran once the keep was done, the lock dropped.
  EXPECT_EQ(a.releases, 1);
  EXPECT_EQ(a.status, STASH_OK);
  EXPECT_EQ(a.seen.entries, 2u);
  EXPECT_EQ(a.seen.bytes, 60u);
  EXPECT_EQ(a.seen.keeps, 1u);
  EXPECT_EQ(a.seen.declined, 1u);
  EXPECT_EQ(sa.releases, 0);

  // c and c2 can be demoted, dd (between them) cannot: the keep fails, and the stand-ins
  // made in vain are released after unlocking, seeing nothing changed.
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 120), STASH_OK);
  Keep(reg.get(), MakeKey(0xee00, 0, {}, 2), entry(c, 20));
  Keep(reg.get(), MakeKey(0xee00, 0, {}, 3), entry(dd, 20));
  Keep(reg.get(), MakeKey(0xee00, 0, {}, 4), entry(c2, 20));
  const stash_stats before = Stats(reg.get());
  ASSERT_EQ(before.bytes, 120u);
  stash_key ke = MakeKey(0xee00, 0, {}, 5);
  EXPECT_EQ(stash_keep(reg.get(), &ke, EntryFor(e), nullptr), STASH_ERR_BUDGET);  // needs all three
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(dd.demotes, 1);
  EXPECT_GE(c.demotes + c2.demotes, 1);
  EXPECT_EQ(c.releases + dd.releases + c2.releases, 0);
  for (ReentrantDemotable *s : {&sc, &sc2}) {
    const int made = s == &sc ? c.demotes : c2.demotes;
    EXPECT_EQ(s->releases, made);
    if (made != 0) {
      EXPECT_EQ(s->status, STASH_OK);
      EXPECT_EQ(s->seen, before);
    }
  }
  const int vain = sc.releases + sc2.releases;
  reg.Destroy();
  // Destroy releases a's stand-in, c, dd and c2.
  EXPECT_EQ(a.releases, 1);
  EXPECT_EQ(sa.releases, 1);
  EXPECT_EQ(c.releases + dd.releases + c2.releases, 3);
  EXPECT_EQ(sc.releases + sc2.releases, vain);
}

// --- releasing ---------------------------------------------------------------

TEST(StashRegistry, ReleaseIfOnAnAnchorReleasesEveryVersionSlotAndShapeOfThatAnchorOnly) {
  const uintptr_t target = 0xc000, other = 0xc010;
  std::vector<stash_key> target_keys = {
      MakeKey(target, 0, {1, 2}, 0), MakeKey(target, 1, {1, 2}, 0), MakeKey(target, 0, {1, 2}, 1),
      MakeKey(target, 0, {4}, 0),    MakeKey(target, 7, {}, 3),
  };
  std::vector<stash_key> other_keys = {MakeKey(other, 0, {1, 2}, 0), MakeKey(other, 1, {4}, 1),
                                       MakeKey(target + 1, 0, {1, 2}, 0)};
  std::deque<Payload> tp(target_keys.size()), op(other_keys.size());
  Registry reg;
  for (size_t i = 0; i < target_keys.size(); ++i) {
    tp[i].bytes = 100;
    Keep(reg.get(), target_keys[i], EntryFor(tp[i]));
  }
  for (size_t i = 0; i < other_keys.size(); ++i) {
    op[i].bytes = 1;
    Keep(reg.get(), other_keys[i], EntryFor(op[i]));
  }

  auto on_anchor = [](const stash_record *r, void *a) {
    return int(r->key->anchor == *static_cast<uintptr_t *>(a));
  };
  uintptr_t anchor = target;
  size_t released = 99;
  ASSERT_EQ(stash_release_if(reg.get(), on_anchor, &anchor, &released), STASH_OK);
  EXPECT_EQ(released, target_keys.size());
  for (auto &p : tp) EXPECT_EQ(p.releases.load(), 1);
  for (auto &p : op) EXPECT_EQ(p.releases.load(), 0);

  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, other_keys.size());
  EXPECT_EQ(s.bytes, other_keys.size());
  EXPECT_EQ(s.released_unused, target_keys.size());
  EXPECT_EQ(s.peak_bytes, 100 * target_keys.size() + other_keys.size());

  auto held = Contents(reg.get());
  EXPECT_EQ(held.size(), other_keys.size());
  for (auto &k : other_keys) EXPECT_EQ(held.count(Canon(k)), 1u);

  // A second pass finds nothing and releases nothing again.
  ASSERT_EQ(stash_release_if(reg.get(), on_anchor, &anchor, &released), STASH_OK);
  EXPECT_EQ(released, 0u);
  for (auto &p : tp) EXPECT_EQ(p.releases.load(), 1);
}

TEST(StashRegistry, ReleaseIfReleasesExactlyWhatThePredicateSelectsAndPassesItsContext) {
  std::deque<Payload> payloads(20);
  Registry reg;
  for (int i = 0; i < 20; ++i) {
    payloads[i].id = i;
    payloads[i].bytes = 10;
    stash_key key = MakeKey(0xc100 + 16 * (i % 4), i / 4, {i}, i % 3);
    Keep(reg.get(), key, EntryFor(payloads[i]));
  }
  struct Ctx {
    int64_t slot;
    int calls;
  } ctx{1, 0};
  auto pred = [](const stash_record *r, void *c) {
    auto *ctx = static_cast<Ctx *>(c);
    ctx->calls++;
    EXPECT_NE(r->entry->payload, nullptr);
    return int(r->key->slot == ctx->slot);
  };
  size_t released = 0;
  ASSERT_EQ(stash_release_if(reg.get(), pred, &ctx, &released), STASH_OK);
  EXPECT_EQ(ctx.calls, 20);
  size_t expected = 0;
  for (int i = 0; i < 20; ++i) {
    bool selected = i % 3 == 1;
    expected += selected;
    EXPECT_EQ(payloads[i].releases.load(), selected ? 1 : 0) << i;
  }
  EXPECT_EQ(released, expected);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 20 - expected);
  EXPECT_EQ(s.bytes, 10 * (20 - expected));
  EXPECT_EQ(s.released_unused, expected);
}

TEST(StashRegistry, ReleaseIfSeesEachRecordsIdRefsAndDeclinedFlag) {
  Payload kept, shared, declined;
  Registry reg;
  kept.bytes = shared.bytes = declined.bytes = 8;
  stash_key kk = MakeKey(0xc200, 0, {}, 0), ks = MakeKey(0xc200, 0, {}, 1),
            kd = MakeKey(0xc200, 0, {}, 2);
  uint64_t idk = Keep(reg.get(), kk, EntryFor(kept));
  uint64_t ids = Keep(reg.get(), ks, EntryFor(shared));
  uint64_t idd = Decline(reg.get(), kd, EntryFor(declined));
  ASSERT_EQ(stash_share(reg.get(), &ks, ids), STASH_OK);

  std::map<uint64_t, Held> seen;
  auto none = [](const stash_record *r, void *c) {
    static_cast<std::map<uint64_t, Held> *>(c)->emplace(r->id, HeldOf(*r));
    return 0;
  };
  ASSERT_EQ(stash_release_if(reg.get(), none, &seen, nullptr), STASH_OK);
  std::map<uint64_t, Held> want = {{idk, Held{&kept, 8, idk, 1, false}},
                                   {ids, Held{&shared, 8, ids, 2, false}},
                                   {idd, Held{&declined, 0, idd, 1, true}}};
  EXPECT_EQ(seen, want);
  EXPECT_EQ(Stats(reg.get()).entries, 3u);
}

TEST(StashRegistry, ReleaseIfDropsWholeSharedRecordsCountingEveryReference) {
  Payload shared, single;
  Registry reg;
  shared.bytes = 64;
  single.bytes = 16;
  stash_key ks = MakeKey(0xc300, 0, {}, 0), k1 = MakeKey(0xc300, 0, {}, 1);
  uint64_t id = Keep(reg.get(), ks, EntryFor(shared));
  for (int i = 0; i < 2; ++i) ASSERT_EQ(stash_share(reg.get(), &ks, id), STASH_OK);
  Keep(reg.get(), k1, EntryFor(single));

  auto is_shared = [](const stash_record *r, void *) { return int(r->refs > 1); };
  size_t released = 0;
  ASSERT_EQ(stash_release_if(reg.get(), is_shared, nullptr, &released), STASH_OK);
  EXPECT_EQ(released, 1u);  // records, not references
  EXPECT_EQ(shared.releases.load(), 1);
  EXPECT_EQ(shared.retains.load(), 0);
  EXPECT_EQ(single.releases.load(), 0);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.released_unused, 3u);
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, 16u);
}

TEST(StashRegistry, ClearReleasesEverythingAndTheRegistryStaysUsable) {
  std::deque<Payload> payloads(50);
  Registry reg;
  for (int i = 0; i < 50; ++i) {
    payloads[i].bytes = 2;
    stash_key key = MakeKey(0xc400 + 8 * i, 0, {i, i}, 0);
    uint64_t id = Keep(reg.get(), key, EntryFor(payloads[i]));
    if (i % 10 == 0) {
      ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);
    }
  }
  size_t released = 0;
  ASSERT_EQ(stash_clear(reg.get(), &released), STASH_OK);
  EXPECT_EQ(released, 50u);
  for (auto &p : payloads) EXPECT_EQ(p.releases.load(), 1);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.peak_bytes, 100u);
  EXPECT_EQ(s.released_unused, 55u);  // every reference of the five shared records
  EXPECT_TRUE(Contents(reg.get()).empty());

  ASSERT_EQ(stash_clear(reg.get(), &released), STASH_OK);
  EXPECT_EQ(released, 0u);

  Payload again;
  stash_key key = MakeKey(0xc400, 0, {0, 0}, 0);
  Keep(reg.get(), key, EntryFor(again));
  EXPECT_EQ(Take(reg.get(), key).entry.payload, &again);
}

TEST(StashRegistry, DestroyReleasesEveryHeldRecordExactlyOnce) {
  std::deque<Payload> payloads(30);
  {
    Registry reg;
    for (int i = 0; i < 30; ++i) {
      stash_key key = MakeKey(0xc500 + 8 * (i % 5), i, {}, 0);
      uint64_t id = i % 4 == 3 ? Decline(reg.get(), key, EntryFor(payloads[i]))
                               : Keep(reg.get(), key, EntryFor(payloads[i]));
      if (i % 3 == 0) {
        ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);
      }
    }
  }
  for (auto &p : payloads) {
    EXPECT_EQ(p.releases.load(), 1);
    EXPECT_EQ(p.retains.load(), 0);
  }
}

TEST(StashRegistry, TakenReferencesAreNeverReleased) {
  Payload taken, shared, held;
  {
    Registry reg;
    stash_key kt = MakeKey(0xc600, 0, {}, 0), ks = MakeKey(0xc600, 0, {}, 1),
              kh = MakeKey(0xc600, 0, {}, 2);
    Keep(reg.get(), kt, EntryFor(taken));
    uint64_t ids = Keep(reg.get(), ks, EntryFor(shared));
    ASSERT_EQ(stash_share(reg.get(), &ks, ids), STASH_OK);
    Keep(reg.get(), kh, EntryFor(held));
    ASSERT_EQ(Take(reg.get(), kt).status, STASH_OK);
    ASSERT_EQ(Take(reg.get(), ks).status, STASH_OK);
    auto all = [](const stash_record *, void *) { return 1; };
    ASSERT_EQ(stash_release_if(reg.get(), all, nullptr, nullptr), STASH_OK);
    ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  }
  EXPECT_EQ(taken.releases.load(), 0);
  // The shared record: one reference taken (retained for the taker), the registry's released.
  EXPECT_EQ(shared.retains.load(), 1);
  EXPECT_EQ(shared.releases.load(), 1);
  EXPECT_EQ(held.releases.load(), 1);
}

TEST(StashRegistry, NullReleaseCallbackIsAllowedAndStillCounted) {
  Payload p;
  Registry reg;
  for (int i = 0; i < 4; ++i) {
    stash_key key = MakeKey(0xc700, 0, {}, i);
    Keep(reg.get(), key, stash_entry{&p, 1, CountRetain, nullptr});
  }
  auto all = [](const stash_record *, void *) { return 1; };
  size_t released = 0;
  ASSERT_EQ(stash_release_if(reg.get(), all, nullptr, &released), STASH_OK);
  EXPECT_EQ(released, 4u);
  EXPECT_EQ(Stats(reg.get()).released_unused, 4u);
  stash_key key = MakeKey(0xc700, 0, {}, 9);
  uint64_t id = Keep(reg.get(), key, stash_entry{&p, 1, nullptr, nullptr});
  ASSERT_EQ(stash_release_id(reg.get(), id), STASH_OK);
  Keep(reg.get(), key, stash_entry{&p, 1, nullptr, nullptr});
  // ...and destroy of a record without callbacks must not crash either.
}

// --- re-entrant release callbacks -----------------------------------------------

// Release callbacks get only the payload, so the re-entrant ones find the
// registry through this payload type.
struct Reentrant {
  stash_registry *registry = nullptr;
  int releases = 0;
  bool keep_replacement = false;  // keep a new record from inside the callback
  uintptr_t replacement_anchor = 0;
  uint64_t chained_id = 0;  // a record to release_id from inside the callback
  stash_status stats_status = STASH_ERR_MISSING;
  stash_stats seen{};
  stash_status keep_status = STASH_ERR_MISSING;
  stash_status chained_status = STASH_ERR_MISSING;
};

void ReentrantRelease(void *payload) {
  auto *r = static_cast<Reentrant *>(payload);
  r->releases++;
  r->stats_status = stash_get_stats(r->registry, &r->seen);
  auto none = [](const stash_record *, void *) { return 0; };
  stash_release_if(r->registry, none, nullptr, nullptr);  // takes the lock once more
  if (r->chained_id != 0) {
    r->chained_status = stash_release_id(r->registry, r->chained_id);
    r->chained_id = 0;
  }
  if (r->keep_replacement) {
    r->keep_replacement = false;
    stash_key key = MakeKey(r->replacement_anchor, 0, {}, 0);
    r->keep_status = stash_keep(r->registry, &key, stash_entry{r, 64, nullptr, ReentrantRelease}, nullptr);
  }
}

TEST(StashRegistry, ReleaseCallbackMayCallBackIntoTheRegistryWithoutDeadlock) {
  Reentrant payload;
  Payload chained;
  Registry reg;
  payload.registry = reg.get();
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x20;
  stash_key key = MakeKey(0x10, 0, {}, 0);
  uint64_t id = Keep(reg.get(), key, stash_entry{&payload, 32, nullptr, ReentrantRelease});
  payload.chained_id = Keep(reg.get(), MakeKey(0x11, 0, {}, 0), EntryFor(chained));

  // release_id: the callback reads the stats (already without the record), drops
  // another record by id and keeps a replacement under another anchor.
  ASSERT_EQ(stash_release_id(reg.get(), id), STASH_OK);
  EXPECT_EQ(payload.releases, 1);
  EXPECT_EQ(payload.stats_status, STASH_OK);
  EXPECT_EQ(payload.seen.entries, 1u);
  EXPECT_EQ(payload.seen.released_unused, 1u);
  EXPECT_EQ(payload.chained_status, STASH_OK);
  EXPECT_EQ(chained.releases.load(), 1);
  EXPECT_EQ(payload.keep_status, STASH_OK);
  EXPECT_EQ(Stats(reg.get()).entries, 1u);

  // release_if and clear re-enter as well.
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x30;
  auto all = [](const stash_record *, void *) { return 1; };
  ASSERT_EQ(stash_release_if(reg.get(), all, nullptr, nullptr), STASH_OK);
  EXPECT_EQ(payload.releases, 2);
  EXPECT_EQ(payload.keep_status, STASH_OK);
  ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  EXPECT_EQ(payload.releases, 3);
  EXPECT_EQ(payload.seen.released_unused, 4u);

  // Destroy clears too; a record kept by a callback during destroy is released as well.
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x40;
  Keep(reg.get(), MakeKey(0x50, 0, {}, 0), stash_entry{&payload, 8, nullptr, ReentrantRelease});
  reg.Destroy();
  EXPECT_EQ(payload.releases, 5);
}

// --- visit, stats, messages ------------------------------------------------------

TEST(StashRegistry, PeekSeesTheRecordUnderItsKeyAndLeavesItHeld) {
  Payload kept, other;
  Registry reg;
  kept.bytes = 12;
  stash_key key = MakeKey(0xd000, 3, {4, 5}, 1);
  stash_key other_slot = MakeKey(0xd000, 3, {4, 5}, 2);
  uint64_t id = Keep(reg.get(), key, EntryFor(kept));
  ASSERT_EQ(stash_share(reg.get(), &key, id), STASH_OK);
  Keep(reg.get(), other_slot, EntryFor(other));
  EXPECT_EQ(Peek(reg.get(), key), (Held{&kept, 12, id, 2, false}));
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.replays, 0u);
  EXPECT_EQ(kept.retains.load(), 0);

  stash_key missing = MakeKey(0xd000, 4, {4, 5}, 1);  // another version
  bool called = false;
  auto mark = [](const stash_record *, void *c) { *static_cast<bool *>(c) = true; };
  EXPECT_EQ(stash_peek(reg.get(), &missing, mark, &called), STASH_ERR_MISSING);
  EXPECT_FALSE(called);
  EXPECT_EQ(Stats(reg.get()).misses, 0u);  // a peek is no take
}

TEST(StashRegistry, VisitSeesEveryHeldRecordOnceWithItsKeyEntryAndCallbacks) {
  std::deque<Payload> payloads(40);
  Registry reg;
  int calls = 0;
  auto count = [](const stash_record *, void *c) { ++*static_cast<int *>(c); };
  ASSERT_EQ(stash_visit(reg.get(), count, &calls), STASH_OK);
  EXPECT_EQ(calls, 0);

  std::map<CanonKey, Held> expected;
  for (int i = 0; i < 40; ++i) {
    payloads[i].bytes = size_t(i);
    stash_key key = MakeKey(0xd100 + 8 * (i % 7), i % 2, {i, 2 * i}, i % 3);
    bool declined = i % 5 == 0;
    uint64_t id = declined ? Decline(reg.get(), key, EntryFor(payloads[i]))
                           : Keep(reg.get(), key, EntryFor(payloads[i]));
    expected[Canon(key)] = Held{&payloads[i], declined ? 0u : uint64_t(i), id, 1, declined};
  }
  EXPECT_EQ(Contents(reg.get()), expected);

  // The entry seen by the visitor is the one kept, callbacks included.
  int bad = 0;
  ASSERT_EQ(stash_visit(
                reg.get(),
                [](const stash_record *r, void *c) {
                  if (r->entry->retain != &CountRetain || r->entry->release != &CountRelease) {
                    ++*static_cast<int *>(c);
                  }
                },
                &bad),
            STASH_OK);
  EXPECT_EQ(bad, 0);
  for (auto &p : payloads) EXPECT_EQ(p.retains.load() + p.releases.load(), 0);
}

TEST(StashRegistry, StatsTrackEntriesBytesKeepsReplaysAndPeak) {
  Payload a, b, c;
  Registry reg;
  a.bytes = 100;
  b.bytes = 50;
  c.bytes = 30;
  stash_key ka = MakeKey(1, 0, {}, 0), kb = MakeKey(2, 0, {}, 0), kc = MakeKey(3, 0, {}, 0);
  Keep(reg.get(), ka, EntryFor(a));
  Keep(reg.get(), kb, EntryFor(b));
  ASSERT_EQ(Take(reg.get(), ka).status, STASH_OK);
  Keep(reg.get(), kc, EntryFor(c));

  stash_stats want = FreshStats();
  want.entries = 2;
  want.bytes = 80;
  want.peak_bytes = 150;  // a and b together, earlier
  want.keeps = 3;
  want.replays = 1;
  EXPECT_EQ(Stats(reg.get()), want);
}

TEST(StashRegistry, ResetPeakSetsPeakToTheBytesHeldNow) {
  Payload a, b;
  Registry reg;
  a.bytes = 100;
  b.bytes = 40;
  stash_key ka = MakeKey(1, 0, {}, 0), kb = MakeKey(2, 0, {}, 0);
  Keep(reg.get(), ka, EntryFor(a));
  Keep(reg.get(), kb, EntryFor(b));
  ASSERT_EQ(Take(reg.get(), ka).status, STASH_OK);
  stash_stats want = Stats(reg.get());
  EXPECT_EQ(want.peak_bytes, 140u);

  ASSERT_EQ(stash_reset_peak(reg.get()), STASH_OK);
  want.peak_bytes = 40;  // the other counters are untouched
  EXPECT_EQ(Stats(reg.get()), want);

  // The peak climbs again from there, and a release does not lower it.
  Keep(reg.get(), ka, EntryFor(a));
  EXPECT_EQ(Stats(reg.get()).peak_bytes, 140u);
  ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).peak_bytes, 140u);
  ASSERT_EQ(stash_reset_peak(reg.get()), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).peak_bytes, 0u);
}

TEST(StashRegistry, StatusMessagesAreDistinctAndOutOfRangeIsUnknown) {
  std::set<std::string> seen;
  for (int s = STASH_OK; s <= STASH_ERR_BUDGET; ++s) {
    const char *msg = stash_status_message(static_cast<stash_status>(s));
    ASSERT_NE(msg, nullptr);
    EXPECT_STRNE(msg, "unknown status") << s;
    EXPECT_GT(std::strlen(msg), 0u);
    seen.insert(msg);
  }
  EXPECT_EQ(seen.size(), 7u);
  // Only a value the C++ enum can represent (0..7): anything else is UB on this side.
  EXPECT_STREQ(stash_status_message(static_cast<stash_status>(7)), "unknown status");
  // Static strings: the same pointer every time.
  EXPECT_EQ(stash_status_message(STASH_ERR_BUDGET), stash_status_message(STASH_ERR_BUDGET));
}

// --- growth ------------------------------------------------------------------

TEST(StashRegistry, GrowsThroughThousandsOfRecordsAndGivesThemAllBack) {
  const int n = 20000;
  std::deque<Payload> payloads(n);
  Registry reg;
  std::vector<stash_key> keys;
  std::vector<uint64_t> ids;
  keys.reserve(n);
  for (int i = 0; i < n; ++i) {
    payloads[i].id = i;
    payloads[i].bytes = size_t(i % 97);
    // Mostly distinct anchors, plus a run of 625 sharing one anchor (one long chain).
    uintptr_t anchor = i % 32 == 0 ? 0x7f0000001000 : 0x7f0000100000 + 256 * uintptr_t(i);
    keys.push_back(MakeKey(anchor, i % 3, {i, 64}, i));
    uint64_t id = 0;
    ASSERT_EQ(stash_keep(reg.get(), &keys[i], EntryFor(payloads[i]), &id), STASH_OK) << i;
    ids.push_back(id);
  }
  size_t total = 0;
  for (auto &p : payloads) total += p.bytes;
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, size_t(n));
  EXPECT_EQ(s.bytes, total);
  EXPECT_EQ(Contents(reg.get()).size(), size_t(n));

  // Every key and every id is still found after the table grew under it.
  for (int i = 0; i < n; i += 2) {
    ASSERT_EQ(stash_keep(reg.get(), &keys[i], EntryFor(payloads[i]), nullptr), STASH_ERR_DUPLICATE) << i;
  }
  // release_id walks the whole table, so only a sample of ids goes that way.
  auto by_id = [](int i) { return i % 100 == 0; };
  for (int i = 0; i < n; ++i) {
    if (by_id(i)) {
      ASSERT_EQ(stash_release_id(reg.get(), ids[size_t(i)]), STASH_OK) << i;
    }
  }
  uint64_t taken = 0;
  for (int i = n; i-- > 0;) {
    if (by_id(i)) continue;
    Taken t = Take(reg.get(), keys[i], ids[size_t(i)]);
    ASSERT_EQ(t.status, STASH_OK) << i;
    ASSERT_EQ(t.entry.payload, &payloads[i]) << i;
    taken++;
  }
  s = Stats(reg.get());
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.peak_bytes, total);
  EXPECT_EQ(s.replays, taken);
  EXPECT_EQ(s.released_unused, uint64_t(n) - taken);
  for (int i = 0; i < n; ++i) EXPECT_EQ(payloads[i].releases.load(), by_id(i) ? 1 : 0) << i;
}

TEST(StashRegistry, ReleaseIfAfterGrowthReleasesOnlyThatAnchor) {
  const int n = 5000;
  std::deque<Payload> payloads(n);
  Registry reg;
  for (int i = 0; i < n; ++i) {
    Keep(reg.get(), MakeKey(0x100000 + 64 * uintptr_t(i % 50), i, {}, 0), EntryFor(payloads[i]));
  }
  auto anchor7 = [](const stash_record *r, void *) { return int(r->key->anchor == 0x100000 + 64 * 7); };
  size_t released = 0;
  ASSERT_EQ(stash_release_if(reg.get(), anchor7, nullptr, &released), STASH_OK);
  EXPECT_EQ(released, size_t(n / 50));
  for (int i = 0; i < n; ++i) EXPECT_EQ(payloads[i].releases.load(), i % 50 == 7 ? 1 : 0) << i;
}

// --- a random run against a reference model --------------------------------------

// Each payload of the random runs counts its references: one made by the test
// (handed to the registry by a keep) or by a demote callback (a stand-in, handed to
// the registry), one per retain; each release, and each drop by the test of a
// reference it took or failed to store, removes one. The registry's callbacks are
// also logged, to be checked after every step.
class ModelRun;
struct ModelPayload {
  int index;
  int refs;
  std::vector<int> *retained;
  std::vector<int> *released;
  ModelRun *run = nullptr;   // makes the stand-ins of demotable entries
  bool fail_demote = false;  // the demote callback returns NULL (set for one keep)
};
void *ModelDemote(void *payload);
void ModelRetain(void *payload) {
  auto *p = static_cast<ModelPayload *>(payload);
  p->refs++;
  p->retained->push_back(p->index);
}
void ModelRelease(void *payload) {
  auto *p = static_cast<ModelPayload *>(payload);
  p->refs--;
  p->released->push_back(p->index);
}

// Random operations on a registry, each checked against a std::map model: its
// status and outputs, the callbacks it made, the records held and every counter.
class ModelRun {
 public:
  // How often each path was taken, to check that the run exercised them all.
  struct Coverage {
    int keeps = 0, declines = 0, duplicates = 0, over_budget = 0;
    int shares = 0, shares_without_retain = 0, shares_missing = 0;
    int replays = 0, shared_takes = 0, wrong_id_misses = 0, misses = 0;
    int partial_release_ids = 0, last_release_ids = 0, missing_release_ids = 0;
    int shared_records_released_if = 0, budget_changes = 0;
    // With demotion: keeps that demoted, records demoted (shared ones among them), keeps
    // refused as demoting everything possible could not make room, keeps refused as a
    // demote callback failed (stand-ins made in vain), takes and drops of stand-ins.
    int demoting_keeps = 0, demoted_records = 0, shared_demoted = 0, multi_demotions = 0;
    int no_room = 0, failed_demotes = 0, stand_ins_made_in_vain = 0;
    int stand_in_takes = 0, stand_ins_dropped = 0;
  };

  // With `demotion`, two thirds of the entries are demotable (the other runs keep the
  // previous contract's entries, whose demote is NULL, and their random sequence).
  explicit ModelRun(uint64_t seed, bool demotion = false) : rng_(seed), demotion_(demotion) {
    EXPECT_EQ(stash_registry_create(&reg_), STASH_OK);
  }
  ~ModelRun() { Destroy(); }
  ModelRun(const ModelRun &) = delete;
  ModelRun &operator=(const ModelRun &) = delete;

  stash_registry *registry() const { return reg_; }
  const Coverage &coverage() const { return coverage_; }
  uint64_t declined_takes() const { return declined_takes_; }

  void Step();

  // The demote callback of payload `p`: a new payload, the stand-in, with one reference
  // for the registry (or NULL when the test made it fail). Runs under the registry's lock.
  void *StandInFor(ModelPayload &p) {
    demote_calls_.push_back(p.index);
    if (p.fail_demote) return nullptr;
    payloads_.push_back(ModelPayload{int(payloads_.size()), 1, &retained_, &released_, this});
    made_.emplace_back(p.index, payloads_.back().index);
    return &payloads_.back();
  }

  // Destroys the registry, which must release exactly what the model holds; every
  // reference ever made is then gone.
  void CheckDestroy() {
    std::multiset<int> want;
    for (auto &kv : model_) want.insert(kv.second.payload);
    released_.clear();
    Destroy();
    EXPECT_EQ(std::multiset<int>(released_.begin(), released_.end()), want);
    for (auto &p : payloads_) ASSERT_EQ(p.refs, 0) << "payload " << p.index;
  }

 private:
  struct Rec {
    int payload;
    uint64_t bytes;
    uint64_t id;
    uint32_t refs;
    bool declined;
    bool retain;
    bool demotable;
    bool stand_in;  // demoted: payload is the stand-in
  };

  void Destroy() {
    stash_registry_destroy(reg_);
    reg_ = nullptr;
  }
  int Pick(int n) { return int(rng_() % uint64_t(n)); }
  uint64_t RandomId() { return 1 + uint64_t(Pick(int(last_id_) + 2)); }
  // A small key space so that duplicates, hits and shared anchors are common.
  stash_key RandomKey() {
    std::vector<int64_t> shape(size_t(Pick(3)));
    for (auto &d : shape) d = 1 + Pick(2);
    return WithJunk(MakeKey(0x1000 + 0x40 * uintptr_t(Pick(4)), Pick(2), shape, Pick(2)));
  }
  stash_key WithJunk(stash_key k) {
    for (int i = k.rank; i < STASH_MAX_RANK; ++i) k.shape[i] = int64_t(rng_());
    return k;
  }
  stash_key KeyOf(const CanonKey &c) {
    stash_key k = MakeKey(std::get<0>(c), std::get<1>(c), std::get<3>(c), std::get<4>(c));
    return WithJunk(k);
  }
  std::map<CanonKey, Rec>::iterator RandomHeld() {
    return std::next(model_.begin(), Pick(int(model_.size())));
  }
  std::map<CanonKey, Rec>::iterator FindId(uint64_t id) {
    for (auto it = model_.begin(); it != model_.end(); ++it) {
      if (it->second.id == id) return it;
    }
    return model_.end();
  }
  // Unlinks a record from the model, as the registry does with its last reference.
  void Unlink(std::map<CanonKey, Rec>::iterator it) {
    expect_.entries--;
    expect_.bytes -= it->second.bytes;
    model_.erase(it);
  }
  void StoreOp(bool decline);
  void ShareOp();
  void TakeOp();
  void ReleaseIdOp();
  void ReleaseIfOp();
  void CheckAfterStep();

  std::mt19937_64 rng_;
  std::deque<ModelPayload> payloads_;
  std::vector<int> retained_, released_;
  std::vector<int> demote_calls_;              // this step: the payloads demote was called for
  std::vector<std::pair<int, int>> made_;      // this step: (payload, its stand-in)
  std::multiset<int> want_retained_, want_released_;
  std::map<CanonKey, Rec> model_;
  stash_stats expect_ = FreshStats();
  uint64_t last_id_ = 0;
  uint64_t declined_takes_ = 0;
  Coverage coverage_;
  bool demotion_ = false;
  stash_registry *reg_ = nullptr;
};

void *ModelDemote(void *payload) {
  auto *p = static_cast<ModelPayload *>(payload);
  return p->run->StandInFor(*p);
}

void ModelRun::Step() {
  retained_.clear();
  released_.clear();
  demote_calls_.clear();
  made_.clear();
  want_retained_.clear();
  want_released_.clear();
  int op = Pick(1000);
  if (op < 300) {
    StoreOp(false);
  } else if (op < 380) {
    StoreOp(true);
  } else if (op < 480) {
    ShareOp();
  } else if (op < 700) {
    TakeOp();
  } else if (op < 800) {
    ReleaseIdOp();
  } else if (op < 840) {
    ReleaseIfOp();
  } else if (op < 920) {  // a budget: none, some room above what is held, or under it
    int kind = Pick(4);
    uint64_t max = kind == 0   ? UINT64_MAX
                   : kind == 3 ? expect_.bytes / 2
                               : expect_.bytes + uint64_t(Pick(3000));
    ASSERT_EQ(stash_set_max_bytes(reg_, max), STASH_OK);
    expect_.max_bytes = max;
    coverage_.budget_changes++;
  } else if (op < 990) {
    ASSERT_EQ(stash_reset_peak(reg_), STASH_OK);
    expect_.peak_bytes = expect_.bytes;
  } else {
    size_t released = 99;
    ASSERT_EQ(stash_clear(reg_, &released), STASH_OK);
    ASSERT_EQ(released, model_.size());
    for (auto &kv : model_) {
      want_released_.insert(kv.second.payload);
      expect_.released_unused += kv.second.refs;
    }
    model_.clear();
    expect_.entries = expect_.bytes = 0;
  }
  if (::testing::Test::HasFatalFailure()) return;
  CheckAfterStep();
}

void ModelRun::StoreOp(bool decline) {
  stash_key k = RandomKey();
  payloads_.push_back(ModelPayload{int(payloads_.size()), 1, &retained_, &released_, this});
  ModelPayload &p = payloads_.back();
  uint64_t bytes = uint64_t(Pick(1000));
  bool retain = Pick(4) != 0;
  bool demotable = demotion_ && Pick(3) != 0;
  stash_entry e{&p, bytes, retain ? ModelRetain : nullptr, ModelRelease, demotable ? ModelDemote : nullptr};

  // A keep over the budget demotes the oldest kept demotable records (by id), as many as
  // it takes to make room, or none at all if they all could not. The sums stay far below
  // 2^64 here: the overflow is pinned by its own test.
  const bool duplicate = model_.count(Canon(k)) != 0;
  using It = std::map<CanonKey, Rec>::iterator;
  std::map<uint64_t, It> candidates;  // by id
  for (auto it = model_.begin(); it != model_.end(); ++it) {
    if (!it->second.declined && it->second.demotable) candidates.emplace(it->second.id, it);
  }
  std::vector<It> victims;
  bool room = true, needs_room = false;
  if (!decline && !duplicate && expect_.bytes + bytes > expect_.max_bytes) {
    needs_room = true;
    room = false;
    if (bytes <= expect_.max_bytes) {
      const uint64_t need = expect_.bytes + bytes - expect_.max_bytes;
      uint64_t freed = 0;
      for (auto &kv : candidates) {
        if (freed >= need) break;
        victims.push_back(kv.second);
        freed += kv.second->second.bytes;
      }
      room = freed >= need;
    }
  }
  // Now and then one victim cannot be demoted (out of memory): the keep fails as a whole.
  ModelPayload *failing = nullptr;
  if (room && !victims.empty() && Pick(6) == 0) {
    failing = &payloads_[size_t(victims[size_t(Pick(int(victims.size())))]->second.payload)];
    failing->fail_demote = true;
  }
  uint64_t id = 0;
  stash_status st = decline ? stash_decline(reg_, &k, e, &id) : stash_keep(reg_, &k, e, &id);
  if (failing != nullptr) failing->fail_demote = false;

  stash_status want = duplicate ? STASH_ERR_DUPLICATE : !room || failing ? STASH_ERR_BUDGET : STASH_OK;
  ASSERT_EQ(st, want);
  // Each demote callback runs at most once, and only for a record that could be demoted.
  std::set<int> calls(demote_calls_.begin(), demote_calls_.end());
  ASSERT_EQ(calls.size(), demote_calls_.size()) << "a record was asked for two stand-ins";
  std::set<int> candidate_payloads;
  for (auto &kv : candidates) candidate_payloads.insert(kv.second->second.payload);
  for (int c : calls) ASSERT_EQ(candidate_payloads.count(c), 1u) << "demote called for payload " << c;
  ASSERT_EQ(made_.size() + (failing != nullptr && calls.count(failing->index) ? 1 : 0), calls.size());

  if (st != STASH_OK) {
    coverage_.duplicates += st == STASH_ERR_DUPLICATE;
    coverage_.over_budget += st == STASH_ERR_BUDGET;
    if (failing != nullptr) {
      ASSERT_EQ(calls.count(failing->index), 1u) << "the failing demote was never called";
      coverage_.failed_demotes++;
    } else if (needs_room && bytes <= expect_.max_bytes && !candidates.empty()) {
      coverage_.no_room++;
    }
    // Nothing changed; the stand-ins made in vain are released (exactly once, checked
    // after the step with every other callback).
    for (auto &m : made_) want_released_.insert(m.second);
    coverage_.stand_ins_made_in_vain += int(made_.size());
    p.refs--;  // the caller still owned it, and drops it
    return;
  }
  // Demoted: exactly the victims, each now holding its stand-in; the registry released
  // its reference to the old payload, and the record's forwards count as declined.
  std::set<int> victim_payloads;
  for (auto &v : victims) victim_payloads.insert(v->second.payload);
  ASSERT_EQ(calls, victim_payloads);
  for (auto &v : victims) {
    Rec &rec = v->second;
    auto made = std::find_if(made_.begin(), made_.end(),
                             [&](const std::pair<int, int> &m) { return m.first == rec.payload; });
    ASSERT_NE(made, made_.end());
    want_released_.insert(rec.payload);
    expect_.bytes -= rec.bytes;
    expect_.keeps -= rec.refs;
    expect_.declined += rec.refs;
    rec.payload = made->second;
    rec.bytes = 0;
    rec.declined = true;
    rec.stand_in = true;
    coverage_.demoted_records++;
    coverage_.shared_demoted += rec.refs > 1;
  }
  coverage_.demoting_keeps += !victims.empty();
  coverage_.multi_demotions += victims.size() > 1;

  ASSERT_GT(id, last_id_);
  last_id_ = id;
  uint64_t held = decline ? 0 : bytes;
  model_[Canon(k)] = Rec{p.index, held, id, 1, decline, retain, demotable, false};
  expect_.entries++;
  expect_.bytes += held;
  if (expect_.bytes > expect_.peak_bytes) expect_.peak_bytes = expect_.bytes;
  (decline ? expect_.declined : expect_.keeps)++;
  (decline ? coverage_.declines : coverage_.keeps)++;
}

void ModelRun::ShareOp() {
  stash_key k;
  uint64_t id;
  if (!model_.empty() && Pick(4) != 0) {  // mostly a record known to be held
    auto it = RandomHeld();
    k = KeyOf(it->first);
    id = it->second.id;
  } else {
    k = RandomKey();
    id = RandomId();
  }
  stash_status st = stash_share(reg_, &k, id);
  auto it = model_.find(Canon(k));
  if (it == model_.end() || it->second.id != id) {
    ASSERT_EQ(st, STASH_ERR_MISSING);
    coverage_.shares_missing++;
  } else if (!it->second.retain) {
    ASSERT_EQ(st, STASH_ERR_ARGUMENT);
    coverage_.shares_without_retain++;
  } else {
    ASSERT_EQ(st, STASH_OK);
    it->second.refs++;
    (it->second.declined ? expect_.declined : expect_.keeps)++;
    coverage_.shares++;
  }
}

void ModelRun::TakeOp() {
  stash_key k = RandomKey();
  uint64_t id = 0;
  if (!model_.empty() && Pick(2) == 0) {  // half of the time a key known to be held
    auto it = RandomHeld();
    k = KeyOf(it->first);
    int mode = Pick(5);
    if (mode == 3) id = it->second.id;
    if (mode == 4) id = it->second.id + 1 + uint64_t(Pick(3));  // another record's, or none
  } else if (Pick(4) == 0) {
    id = RandomId();
  }
  stash_entry out{};
  uint64_t got_id = 0;
  int got_declined = -1;
  stash_status st = stash_take(reg_, &k, id, &out, &got_id, &got_declined);

  auto it = model_.find(Canon(k));
  if (it == model_.end() || (id != 0 && it->second.id != id)) {
    ASSERT_EQ(st, STASH_ERR_MISSING);
    expect_.misses++;
    coverage_.misses++;
    coverage_.wrong_id_misses += it != model_.end();
    return;
  }
  ASSERT_EQ(st, STASH_OK);
  Rec &rec = it->second;
  ModelPayload &p = payloads_[size_t(rec.payload)];
  ASSERT_EQ(out.payload, &p);
  ASSERT_EQ(out.bytes, rec.bytes);
  ASSERT_EQ(out.retain, rec.retain ? &ModelRetain : nullptr);
  ASSERT_EQ(out.release, &ModelRelease);
  ASSERT_EQ(out.demote, rec.demotable ? &ModelDemote : nullptr);
  ASSERT_EQ(got_id, rec.id);
  ASSERT_EQ(got_declined != 0, rec.declined);
  coverage_.stand_in_takes += rec.stand_in;
  if (rec.declined) {
    declined_takes_++;
  } else {
    expect_.replays++;
    coverage_.replays++;
  }
  if (rec.refs > 1) {  // others still share it: the taker gets a retained reference
    want_retained_.insert(rec.payload);
    rec.refs--;
    coverage_.shared_takes++;
  } else {
    Unlink(it);
  }
  p.refs--;  // the taker is done with its reference
}

void ModelRun::ReleaseIdOp() {
  uint64_t id = !model_.empty() && Pick(4) != 0 ? RandomHeld()->second.id : RandomId();
  stash_status st = stash_release_id(reg_, id);
  auto it = FindId(id);
  if (it == model_.end()) {
    ASSERT_EQ(st, STASH_ERR_MISSING);
    coverage_.missing_release_ids++;
    return;
  }
  ASSERT_EQ(st, STASH_OK);
  expect_.released_unused++;
  if (it->second.refs > 1) {
    it->second.refs--;
    coverage_.partial_release_ids++;
  } else {
    want_released_.insert(it->second.payload);
    coverage_.stand_ins_dropped += it->second.stand_in;
    Unlink(it);
    coverage_.last_release_ids++;
  }
}

void ModelRun::ReleaseIfOp() {
  // Select by version and slot, or the shared records, or the declined ones.
  struct Select {
    int by;
    int64_t version, slot;
    bool operator()(const CanonKey &k, uint32_t refs, bool declined) const {
      if (by == 0) return std::get<1>(k) == version && std::get<4>(k) == slot;
      return by == 1 ? refs > 1 : declined;
    }
  } select{Pick(3), Pick(2), Pick(2)};
  auto pred = [](const stash_record *r, void *c) {
    return int((*static_cast<Select *>(c))(Canon(*r->key), r->refs, r->declined != 0));
  };
  size_t released = 99;
  ASSERT_EQ(stash_release_if(reg_, pred, &select, &released), STASH_OK);

  size_t want = 0;
  for (auto it = model_.begin(); it != model_.end();) {
    auto next = std::next(it);
    if (select(it->first, it->second.refs, it->second.declined)) {
      want++;
      want_released_.insert(it->second.payload);
      expect_.released_unused += it->second.refs;
      coverage_.shared_records_released_if += it->second.refs > 1;
      coverage_.stand_ins_dropped += it->second.stand_in;
      Unlink(it);
    }
    it = next;
  }
  ASSERT_EQ(released, want);
}

void ModelRun::CheckAfterStep() {
  ASSERT_EQ(std::multiset<int>(released_.begin(), released_.end()), want_released_);
  ASSERT_EQ(std::multiset<int>(retained_.begin(), retained_.end()), want_retained_);
  std::map<CanonKey, Held> want;
  for (auto &kv : model_) {
    const Rec &r = kv.second;
    want[kv.first] = Held{&payloads_[size_t(r.payload)], r.bytes, r.id, r.refs, r.declined};
  }
  ASSERT_EQ(Contents(reg_), want);
  ASSERT_EQ(Stats(reg_), expect_);
  // The registry owns exactly one reference per record, however many forwards share it,
  // and a payload whose record went is no longer referenced at all.
  for (auto &kv : model_) ASSERT_EQ(payloads_[size_t(kv.second.payload)].refs, 1);
  for (int index : want_released_) ASSERT_EQ(payloads_[size_t(index)].refs, 0);
}

TEST(StashRegistry, RandomOperationsMatchAReferenceModel) {
  ModelRun run(20240607);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
  }
  // The run must have exercised every path.
  const ModelRun::Coverage &c = run.coverage();
  EXPECT_GT(c.keeps, 800);
  EXPECT_GT(c.declines, 350);
  EXPECT_GT(c.duplicates, 120);
  EXPECT_GT(c.over_budget, 450);
  EXPECT_GT(c.shares, 250);
  EXPECT_GT(c.shares_without_retain, 70);
  EXPECT_GT(c.shares_missing, 140);
  EXPECT_GT(c.replays, 300);
  EXPECT_GT(run.declined_takes(), 90u);
  EXPECT_GT(c.shared_takes, 50);
  EXPECT_GT(c.wrong_id_misses, 90);
  EXPECT_GT(c.misses, 600);
  EXPECT_GT(c.partial_release_ids, 45);
  EXPECT_GT(c.last_release_ids, 250);
  EXPECT_GT(c.missing_release_ids, 140);
  EXPECT_GT(c.shared_records_released_if, 60);
  EXPECT_GT(c.budget_changes, 380);

  // Destroy releases what the model still holds.
  run.CheckDestroy();
}

TEST(StashRegistryDemotion, RandomOperationsWithDemotableEntriesMatchAReferenceModel) {
  ModelRun run(20240611, true);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
  }
  // Demotion happened often, in every form.
  const ModelRun::Coverage &c = run.coverage();
  EXPECT_GT(c.keeps, 1400);
  EXPECT_GT(c.replays, 400);
  EXPECT_GT(c.over_budget, 400);
  EXPECT_GT(c.demoting_keeps, 230);
  EXPECT_GT(c.demoted_records, 380);
  EXPECT_GT(c.multi_demotions, 80);
  EXPECT_GT(c.shared_demoted, 40);
  EXPECT_GT(c.no_room, 120);
  EXPECT_GT(c.failed_demotes, 40);
  EXPECT_GT(c.stand_ins_made_in_vain, 10);
  EXPECT_GT(c.stand_in_takes, 90);
  EXPECT_GT(c.stand_ins_dropped, 220);
  // Destroy releases what the model still holds, stand-ins included.
  run.CheckDestroy();
}

TEST(StashRegistryDemotion, EveryForwardIsReplayedTakenReleasedOrStillHeldThroughoutARandomRunWithDemotion) {
  ModelRun run(11, true);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
    stash_stats s = Stats(run.registry());
    ASSERT_EQ(s.keeps + s.declined,
              s.replays + run.declined_takes() + s.released_unused + LiveRefs(run.registry()));
  }
  const ModelRun::Coverage &c = run.coverage();
  EXPECT_GT(c.demoted_records, 330);
  EXPECT_GT(c.shared_demoted, 30);
  EXPECT_GT(c.stand_in_takes, 80);
  EXPECT_GT(Stats(run.registry()).declined, 1000u);
}

TEST(StashRegistry, EveryForwardIsReplayedTakenReleasedOrStillHeldThroughoutARandomRun) {
  ModelRun run(7);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
    // From the registry alone (and the declined takes, which no counter records).
    stash_stats s = Stats(run.registry());
    ASSERT_EQ(s.keeps + s.declined,
              s.replays + run.declined_takes() + s.released_unused + LiveRefs(run.registry()));
  }
  EXPECT_GT(Stats(run.registry()).declined, 300u);
  EXPECT_GT(run.declined_takes(), 50u);
}

// --- concurrency ---------------------------------------------------------------

TEST(StashRegistryConcurrency, ParallelKeepsSharesTakesAndReleasesLoseNothingAndReleaseNothingTwice) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);

  const int workers = 8;
  const int iterations = 10000;
  const uintptr_t shared_anchor = 0xabc000;

  // Preallocated so that no payload moves while another thread holds its address.
  struct Worker {
    std::deque<Payload> payloads;
    std::vector<char> kept;  // kept[i]: payload i was accepted by stash_keep
    uint64_t keeps = 0, shares = 0, takes = 0, misses = 0, duplicates = 0, failures = 0;
  };
  std::vector<Worker> state(workers);
  for (auto &w : state) {
    w.payloads.resize(2 * iterations);
    w.kept.assign(2 * iterations, 0);
  }
  std::atomic<bool> stop{false};

  auto take = [&](Worker &w, const stash_key &key) {
    stash_entry out{};
    int declined = -1;
    stash_status st = stash_take(reg, &key, 0, &out, nullptr, &declined);
    if (st == STASH_OK) {
      w.takes++;
      auto *p = static_cast<Payload *>(out.payload);
      p->takes.fetch_add(1);
      if (out.bytes != p->bytes || declined != 0) w.failures++;
    } else if (st == STASH_ERR_MISSING) {
      w.misses++;
    } else {
      w.failures++;
    }
  };

  auto worker = [&](int t) {
    Worker &w = state[size_t(t)];
    std::mt19937 rng(unsigned(1234 + t));
    const uintptr_t own_anchor = 0x100000 * uintptr_t(t + 1);
    auto own_key = [&](int i) { return MakeKey(own_anchor, i % 5, {t, i}, 0); };
    for (int i = 0; i < iterations; ++i) {
      // Own key: kept now (every fourth one shared by a second forward), taken back
      // below; nobody else touches this anchor.
      Payload &own = w.payloads[size_t(2 * i)];
      own.bytes = size_t(1 + i % 64);
      stash_key key = own_key(i);
      uint64_t id = 0;
      if (stash_keep(reg, &key, EntryFor(own), &id) != STASH_OK) {
        w.failures++;
      } else {
        w.kept[size_t(2 * i)] = 1;
        w.keeps++;
        if (i % 4 == 1) {
          if (stash_share(reg, &key, id) == STASH_OK) {
            w.shares++;
          } else {
            w.failures++;
          }
        }
      }

      // Shared keys: a small space that every worker keeps into, shares and takes
      // from, so duplicates, cross-thread takes, retains and misses all happen.
      Payload &shared = w.payloads[size_t(2 * i + 1)];
      shared.bytes = 1000;
      stash_key shared_key = MakeKey(shared_anchor, 0, {4}, int64_t(rng() % 16));
      stash_status st = stash_keep(reg, &shared_key, EntryFor(shared), nullptr);
      if (st == STASH_OK) {
        w.kept[size_t(2 * i + 1)] = 1;
        w.keeps++;
      } else if (st == STASH_ERR_DUPLICATE) {
        // Share the held one instead; it may be gone, or replaced, by the time we do.
        w.duplicates++;
        Held held{};
        auto read = [](const stash_record *r, void *c) { *static_cast<Held *>(c) = HeldOf(*r); };
        if (stash_peek(reg, &shared_key, read, &held) == STASH_OK) {
          st = stash_share(reg, &shared_key, held.id);
          if (st == STASH_OK) {
            w.shares++;
          } else if (st != STASH_ERR_MISSING) {
            w.failures++;
          }
        }
      } else {
        w.failures++;
      }
      shared_key.slot = int64_t(rng() % 16);
      take(w, shared_key);

      // Leave some own records for a while (so the table grows), then take every
      // reference back.
      if (i % 4 == 3) {
        for (int j = i - 3; j <= i; ++j) {
          take(w, own_key(j));
          if (j % 4 == 1) take(w, own_key(j));
        }
      }
    }
  };

  // The monitor reads stats, visits and drops the shared anchor while workers run.
  uint64_t monitor_records = 0, monitor_refs = 0, monitor_rounds = 0, monitor_failures = 0;
  auto monitor = [&]() {
    while (!stop.load()) {
      stash_stats s;
      if (stash_get_stats(reg, &s) != STASH_OK) monitor_failures++;
      // Under the lock the counters agree at every instant: every record holds at
      // least one of the forwards not yet replayed or dropped.
      if (s.keeps < s.replays + s.released_unused + s.entries) monitor_failures++;
      if (s.bytes > s.peak_bytes || s.declined != 0) monitor_failures++;
      stash_visit(
          reg,
          [](const stash_record *r, void *failures) {
            auto *p = static_cast<Payload *>(r->entry->payload);
            // A held payload was never released, and holds its own bytes.
            if (r->entry->bytes != p->bytes || p->releases.load() != 0 || r->refs < 1) {
              ++*static_cast<uint64_t *>(failures);
            }
          },
          &monitor_failures);
      struct Dropped {
        uintptr_t anchor;
        uint64_t refs;
      } dropped{shared_anchor, 0};
      auto on_shared = [](const stash_record *r, void *c) {
        auto *d = static_cast<Dropped *>(c);
        if (r->key->anchor != d->anchor) return 0;
        d->refs += r->refs;  // the lock is held: every reference seen here goes
        return 1;
      };
      size_t released = 0;
      if (stash_release_if(reg, on_shared, &dropped, &released) != STASH_OK) monitor_failures++;
      monitor_records += released;
      monitor_refs += dropped.refs;
      monitor_rounds++;
      std::this_thread::yield();
    }
  };

  std::thread mon(monitor);
  std::vector<std::thread> threads;
  for (int t = 0; t < workers; ++t) threads.emplace_back(worker, t);
  for (auto &th : threads) th.join();
  stop.store(true);
  mon.join();

  uint64_t keeps = 0, shares = 0, takes = 0, misses = 0, duplicates = 0, failures = 0;
  for (auto &w : state) {
    keeps += w.keeps;
    shares += w.shares;
    takes += w.takes;
    misses += w.misses;
    duplicates += w.duplicates;
    failures += w.failures;
  }
  EXPECT_EQ(failures, 0u);
  EXPECT_GT(duplicates, 0u);  // the shared keys really were contended
  EXPECT_GT(misses, 0u);
  EXPECT_EQ(monitor_failures, 0u);
  EXPECT_GT(monitor_rounds, 0u);

  stash_stats s = Stats(reg);
  EXPECT_EQ(s.keeps, keeps + shares);
  EXPECT_EQ(s.replays, takes);
  EXPECT_EQ(s.misses, misses);
  EXPECT_EQ(s.keeps, s.replays + s.released_unused + LiveRefs(reg));
  EXPECT_EQ(s.released_unused, monitor_refs);
  // Workers took all their own references back; only shared records may remain.
  EXPECT_EQ(s.entries, Contents(reg).size());
  EXPECT_LE(s.entries, 16u);
  EXPECT_EQ(s.bytes, 1000u * s.entries);

  // Each accepted payload's references (the registry's, plus one per retain) end up
  // taken or released, and the registry releases each at most once; a payload that
  // was never accepted is never touched.
  const uint64_t held_before_destroy = s.entries;
  stash_registry_destroy(reg);
  uint64_t total_releases = 0, bad = 0;
  for (auto &w : state) {
    for (size_t i = 0; i < w.payloads.size(); ++i) {
      const Payload &p = w.payloads[i];
      int r = p.releases.load(), tk = p.takes.load(), rt = p.retains.load();
      total_releases += uint64_t(r);
      if (w.kept[i] ? (r + tk != 1 + rt || r > 1) : r + tk + rt != 0) bad++;
    }
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(total_releases, monitor_records + held_before_destroy);
}

TEST(StashRegistryConcurrency, BytesHeldNeverPassTheBudgetUnderConcurrentKeepsAndTakes) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);
  const uint64_t budget = 16000;
  ASSERT_EQ(stash_set_max_bytes(reg, budget), STASH_OK);

  const int workers = 6;
  const int iterations = 5000;
  const int window = 4;  // records each worker holds at once: ~6 * 4 * 1000 bytes, over budget
  struct Worker {
    std::deque<Payload> payloads;
    std::vector<char> declined;
    uint64_t keeps = 0, declines = 0, replays = 0, declined_takes = 0, failures = 0;
  };
  std::vector<Worker> state(workers);
  for (auto &w : state) {
    w.payloads.resize(iterations);
    w.declined.assign(iterations, 0);
  }
  std::atomic<bool> stop{false};

  auto worker = [&](int t) {
    Worker &w = state[size_t(t)];
    std::mt19937 rng(unsigned(99 + t));
    auto key = [&](int i) { return MakeKey(0x200000 * uintptr_t(t + 1), i, {t}, 0); };
    for (int i = 0; i < iterations; ++i) {
      Payload &p = w.payloads[size_t(i)];
      p.bytes = 1 + rng() % 2000;
      stash_key k = key(i);
      stash_status st = stash_keep(reg, &k, EntryFor(p), nullptr);
      if (st == STASH_OK) {
        w.keeps++;
      } else if (st == STASH_ERR_BUDGET) {
        // What the torch layer does: remember the forward as declined.
        if (stash_decline(reg, &k, EntryFor(p), nullptr) != STASH_OK) w.failures++;
        w.declined[size_t(i)] = 1;
        w.declines++;
      } else {
        w.failures++;
      }
      if (i >= window - 1) {
        int j = i - (window - 1);
        stash_entry out{};
        int declined = -1;
        stash_key kj = key(j);
        if (stash_take(reg, &kj, 0, &out, nullptr, &declined) != STASH_OK ||
            (declined != 0) != (w.declined[size_t(j)] != 0) || out.payload != &w.payloads[size_t(j)]) {
          w.failures++;
        }
        (declined ? w.declined_takes : w.replays)++;
      }
    }
  };

  // The checker reads the stats and the records held, each under one lock.
  uint64_t checks = 0, check_failures = 0;
  auto checker = [&]() {
    while (!stop.load()) {
      stash_stats s = Stats(reg);
      if (s.bytes > budget || s.peak_bytes > budget || s.max_bytes != budget) check_failures++;
      uint64_t held = 0;
      stash_visit(
          reg, [](const stash_record *r, void *c) { *static_cast<uint64_t *>(c) += r->entry->bytes; },
          &held);
      if (held > budget) check_failures++;
      checks++;
      std::this_thread::yield();
    }
  };

  std::thread check(checker);
  std::vector<std::thread> threads;
  for (int t = 0; t < workers; ++t) threads.emplace_back(worker, t);
  for (auto &th : threads) th.join();
  stop.store(true);
  check.join();

  uint64_t keeps = 0, declines = 0, replays = 0, declined_takes = 0, failures = 0;
  for (auto &w : state) {
    keeps += w.keeps;
    declines += w.declines;
    replays += w.replays;
    declined_takes += w.declined_takes;
    failures += w.failures;
  }
  EXPECT_EQ(failures, 0u);
  EXPECT_EQ(check_failures, 0u);
  EXPECT_GT(checks, 0u);
  EXPECT_GT(keeps, 0u);
  EXPECT_GT(declines, 0u);  // the budget really was contended

  stash_stats s = Stats(reg);
  EXPECT_LE(s.peak_bytes, budget);
  EXPECT_GT(s.peak_bytes, budget / 2);
  EXPECT_EQ(s.keeps, keeps);
  EXPECT_EQ(s.declined, declines);
  EXPECT_EQ(s.replays, replays);
  EXPECT_EQ(s.released_unused, 0u);
  EXPECT_EQ(s.entries, uint64_t(workers * (window - 1)));
  EXPECT_EQ(s.keeps + s.declined, s.replays + declined_takes + s.released_unused + LiveRefs(reg));
  stash_registry_destroy(reg);
  uint64_t releases = 0;
  for (auto &w : state) {
    for (auto &p : w.payloads) releases += uint64_t(p.releases.load());
  }
  EXPECT_EQ(releases, s.entries);
}

TEST(StashRegistryConcurrency, BytesHeldNeverPassTheBudgetWhileConcurrentKeepsDemoteOlderRecords) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);
  const uint64_t budget = 16000;
  ASSERT_EQ(stash_set_max_bytes(reg, budget), STASH_OK);

  const int workers = 6;
  const int iterations = 4000;
  // Records each worker holds at once: ~20 * 1700 bytes, over the budget even for one
  // worker alone, so that demotion happens however the threads are scheduled.
  const int window = 20;
  const int left = 3;  // records each worker leaves for destroy
  // Payload i of a worker: demotable unless i % 4 == 0 (those, held by all workers at once,
  // fill about the budget on their own, so that some keeps are refused); its demote fails
  // if i % 101 == 0; shared by a second forward if i % 5 == 0. Stand-ins have negative ids.
  auto demotable = [](int i) { return i % 4 != 0; };
  auto demote_fails = [](int i) { return i % 101 == 0; };
  struct Worker {
    std::deque<Payload> payloads, stand_ins;
    std::vector<char> declined;  // refused by the budget, stored declined by the worker
    std::vector<int> forwards;   // forwards that hold payload i's record
    uint64_t keeps = 0, declines = 0, shares = 0, replays = 0, declined_takes = 0, stand_in_takes = 0;
    uint64_t failures = 0;
  };
  std::vector<Worker> state(workers);
  for (auto &w : state) {
    w.payloads.resize(iterations);
    w.stand_ins.resize(iterations);
    w.declined.assign(iterations, 0);
    w.forwards.assign(iterations, 0);
  }
  std::atomic<bool> stop{false}, go{false};
  std::atomic<int> finished{0};

  auto key = [](int t, int i) {
    return MakeKey(0x300000 * uintptr_t(t + 1) + 0x40 * uintptr_t(i % 3), i, {t}, i % 2);
  };
  // Takes back every forward of worker t's record j, checking what comes back.
  auto take_back = [&](int t, int j) {
    Worker &w = state[size_t(t)];
    stash_key kj = key(t, j);
    for (int f = 0; f < w.forwards[size_t(j)]; ++f) {
      stash_entry out{};
      int declined = -1;
      if (stash_take(reg, &kj, 0, &out, nullptr, &declined) != STASH_OK) {
        w.failures++;
        continue;
      }
      auto *got = static_cast<Payload *>(out.payload);
      if (got == &w.payloads[size_t(j)]) {  // kept (and replayed), or declined by the worker
        if ((declined != 0) != (w.declined[size_t(j)] != 0) || out.bytes != (declined ? 0 : got->bytes)) {
          w.failures++;
        }
      } else if (got == &w.stand_ins[size_t(j)]) {  // demoted by some worker's keep
        if (declined != 1 || out.bytes != 0 || w.declined[size_t(j)] || !demotable(j) || demote_fails(j)) {
          w.failures++;
        }
        w.stand_in_takes++;
      } else {
        w.failures++;
        continue;
      }
      got->takes.fetch_add(1);
      (declined ? w.declined_takes : w.replays)++;
    }
  };

  auto worker = [&](int t) {
    Worker &w = state[size_t(t)];
    std::mt19937 rng(unsigned(4242 + t));
    while (!go.load()) std::this_thread::yield();  // all together, for contention
    for (int i = 0; i < iterations; ++i) {
      Payload &p = w.payloads[size_t(i)];
      p.id = i;
      w.stand_ins[size_t(i)].id = -1 - i;
      p.bytes = 1 + rng() % (demotable(i) ? 2000 : 1200);
      stash_entry e = demotable(i) ? DemotableEntryFor(p, demote_fails(i) ? nullptr : &w.stand_ins[size_t(i)])
                                   : EntryFor(p);
      stash_key k = key(t, i);
      uint64_t id = 0;
      stash_status st = stash_keep(reg, &k, e, &id);
      if (st == STASH_OK) {
        w.keeps++;
      } else if (st == STASH_ERR_BUDGET) {
        if (stash_decline(reg, &k, e, &id) != STASH_OK) w.failures++;
        w.declined[size_t(i)] = 1;
        w.declines++;
      } else {
        w.failures++;
      }
      w.forwards[size_t(i)] = 1;
      if (i % 5 == 0) {  // kept or demoted by now, or declined: a share counts as the record is
        if (stash_share(reg, &k, id) == STASH_OK) {
          w.forwards[size_t(i)] = 2;
          w.shares++;
        } else {
          w.failures++;
        }
      }
      if (i >= window - 1) take_back(t, i - (window - 1));
    }
    // Once every worker is done keeping, take back all but the last `left` records (a
    // worker's leftovers must not crowd out those that still run: they hold bytes).
    finished.fetch_add(1);
    while (finished.load() < workers) std::this_thread::yield();
    for (int j = iterations - (window - 1); j < iterations - left; ++j) take_back(t, j);
  };

  // The checker reads the stats and the records held, each under one lock.
  uint64_t checks = 0, check_failures = 0;
  auto checker = [&]() {
    while (!stop.load()) {
      stash_stats s = Stats(reg);
      if (s.bytes > budget || s.peak_bytes > budget || s.max_bytes != budget) check_failures++;
      struct Seen {
        uint64_t held = 0, bad = 0;
      } seen;
      stash_visit(
          reg,
          [](const stash_record *r, void *c) {
            auto *seen = static_cast<Seen *>(c);
            auto *p = static_cast<Payload *>(r->entry->payload);
            seen->held += r->entry->bytes;
            // A kept record holds its own payload, unreleased, and its bytes; a declined
            // one (a stand-in among them) holds none.
            if (r->declined ? r->entry->bytes != 0
                            : p->id < 0 || r->entry->bytes != p->bytes || p->releases.load() != 0) {
              seen->bad++;
            }
            if (p->id < 0 && !r->declined) seen->bad++;
          },
          &seen);
      if (seen.held > budget || seen.bad != 0) check_failures++;
      checks++;
      std::this_thread::yield();
    }
  };

  std::thread check(checker);
  std::vector<std::thread> threads;
  for (int t = 0; t < workers; ++t) threads.emplace_back(worker, t);
  go.store(true);
  for (auto &th : threads) th.join();
  stop.store(true);
  check.join();

  uint64_t keeps = 0, declines = 0, shares = 0, replays = 0, declined_takes = 0, stand_in_takes = 0, failures = 0;
  for (auto &w : state) {
    keeps += w.keeps;
    declines += w.declines;
    shares += w.shares;
    replays += w.replays;
    declined_takes += w.declined_takes;
    stand_in_takes += w.stand_in_takes;
    failures += w.failures;
  }
  EXPECT_EQ(failures, 0u);
  EXPECT_EQ(check_failures, 0u);
  EXPECT_GT(checks, 0u);
  EXPECT_GT(keeps, 0u);
  EXPECT_GT(declines, 0u);  // the budget really was contended, past what demotion could do
  EXPECT_GT(stand_in_takes, 0u);

  stash_stats s = Stats(reg);
  EXPECT_LE(s.peak_bytes, budget);
  EXPECT_GT(s.peak_bytes, budget / 2);
  // Demotion moves forwards from keeps to declined, never adds or loses one.
  EXPECT_EQ(s.keeps + s.declined, keeps + declines + shares);
  EXPECT_GT(s.declined, declines);
  EXPECT_EQ(s.replays, replays);
  EXPECT_EQ(s.misses, 0u);
  EXPECT_EQ(s.released_unused, 0u);
  EXPECT_EQ(s.entries, uint64_t(workers * left));
  EXPECT_EQ(s.keeps + s.declined, s.replays + declined_takes + s.released_unused + LiveRefs(reg));

  // Before destroy only demotions released anything: the old payloads, and the stand-ins
  // made in vain when a demote failed.
  uint64_t demoted = 0;
  for (auto &w : state) {
    for (int i = 0; i < iterations; ++i) {
      const Payload &p = w.payloads[size_t(i)];
      demoted += uint64_t(p.releases.load());
      if (p.releases.load() > (demotable(i) && !demote_fails(i) ? 1 : 0)) failures++;
    }
  }
  EXPECT_GT(demoted, 0u);
  stash_registry_destroy(reg);
  // Every reference ends up taken or released exactly once: the registry's own (one per
  // stored payload, one per stand-in made) and one per retain.
  uint64_t bad = 0;
  for (auto &w : state) {
    for (int i = 0; i < iterations; ++i) {
      const Payload &p = w.payloads[size_t(i)], &sp = w.stand_ins[size_t(i)];
      const int made = demotable(i) && !demote_fails(i) ? p.demotes.load() : 0;
      if (p.releases.load() + p.takes.load() != 1 + p.retains.load() || p.releases.load() > 1) bad++;
      if (sp.releases.load() + sp.takes.load() != made + sp.retains.load()) bad++;
      if (!demotable(i) && p.demotes.load() != 0) bad++;
    }
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(failures, 0u);
}

// Release callbacks that re-enter the registry while other threads hammer it.
std::atomic<stash_registry *> g_reentrant_registry{nullptr};
std::atomic<int> g_reentrant_releases{0};
void RetainNothing(void *) {}
void ReenterOnRelease(void *) {
  stash_registry *reg = g_reentrant_registry.load();
  stash_stats s;
  stash_get_stats(reg, &s);
  stash_key key = MakeKey(0xfeed000, 0, {}, 0);  // never kept: a miss
  stash_entry out{};
  stash_take(reg, &key, 0, &out, nullptr, nullptr);
  stash_release_id(reg, UINT64_MAX);  // no such record, but the lock is taken again
  g_reentrant_releases.fetch_add(1);
}

TEST(StashRegistryConcurrency, ReentrantReleaseCallbacksUnderContentionDoNotDeadlock) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);
  g_reentrant_registry.store(reg);
  g_reentrant_releases.store(0);
  const int threads_n = 4, iterations = 2000;
  std::vector<int> kept(threads_n, 0), shared(threads_n, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < threads_n; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < iterations; ++i) {
        const uintptr_t anchor = 0x10000 * uintptr_t(t + 1) + 16 * uintptr_t(i % 8);
        stash_key key = MakeKey(anchor, i, {}, 0);
        uint64_t id = 0;
        if (stash_keep(reg, &key, stash_entry{nullptr, 1, RetainNothing, ReenterOnRelease}, &id) ==
            STASH_OK) {
          kept[size_t(t)]++;
          if (i % 5 == 0 && stash_share(reg, &key, id) == STASH_OK) shared[size_t(t)]++;
        }
        if (i % 3 == 0) stash_release_id(reg, id);
        if (i % 97 == 0) {
          auto odd = [](const stash_record *r, void *) { return int(r->key->version % 2); };
          stash_release_if(reg, odd, nullptr, nullptr);
        }
      }
    });
  }
  for (auto &th : threads) th.join();
  stash_stats s = Stats(reg);
  const uint64_t live_refs = LiveRefs(reg);
  stash_registry_destroy(reg);
  int total_kept = 0, total_shared = 0;
  for (int t = 0; t < threads_n; ++t) {
    total_kept += kept[size_t(t)];
    total_shared += shared[size_t(t)];
  }
  EXPECT_EQ(s.keeps, uint64_t(total_kept + total_shared));
  EXPECT_EQ(s.keeps, s.released_unused + live_refs);  // nothing was ever taken
  // Every record was released exactly once: by release_id, release_if or destroy.
  EXPECT_EQ(g_reentrant_releases.load(), total_kept);
}

}  // namespace
