// test_stash_registry.cpp: pins the behaviour of the C stash registry
// (csrc/stash_registry.h): keys, ids, error codes, shared records and their
// reference counts, declined records, the budget, retain and release callbacks,
// stats, growth, random runs against a std::map model, and concurrent use.

#include <gtest/gtest.h>

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
};

void CountRetain(void *payload) { static_cast<Payload *>(payload)->retains.fetch_add(1); }
void CountRelease(void *payload) { static_cast<Payload *>(payload)->releases.fetch_add(1); }

stash_entry EntryFor(Payload &p) { return stash_entry{&p, p.bytes, CountRetain, CountRelease}; }

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
// (handed to the registry by a keep), one per retain; each release, and each drop
// by the test of a reference it took or failed to store, removes one. The
// registry's callbacks are also logged, to be checked after every step.
struct ModelPayload {
  int index;
  int refs;
  std::vector<int> *retained;
  std::vector<int> *released;
};
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
  };

  explicit ModelRun(uint64_t seed) : rng_(seed) { EXPECT_EQ(stash_registry_create(&reg_), STASH_OK); }
  ~ModelRun() { Destroy(); }
  ModelRun(const ModelRun &) = delete;
  ModelRun &operator=(const ModelRun &) = delete;

  stash_registry *registry() const { return reg_; }
  const Coverage &coverage() const { return coverage_; }
  uint64_t declined_takes() const { return declined_takes_; }

  void Step();

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
  std::multiset<int> want_retained_, want_released_;
  std::map<CanonKey, Rec> model_;
  stash_stats expect_ = FreshStats();
  uint64_t last_id_ = 0;
  uint64_t declined_takes_ = 0;
  Coverage coverage_;
  stash_registry *reg_ = nullptr;
};

void ModelRun::Step() {
  retained_.clear();
  released_.clear();
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
  payloads_.push_back(ModelPayload{int(payloads_.size()), 1, &retained_, &released_});
  ModelPayload &p = payloads_.back();
  uint64_t bytes = uint64_t(Pick(1000));
  bool retain = Pick(4) != 0;
  stash_entry e{&p, bytes, retain ? ModelRetain : nullptr, ModelRelease};
  uint64_t id = 0;
  stash_status st = decline ? stash_decline(reg_, &k, e, &id) : stash_keep(reg_, &k, e, &id);

  // The sums stay far below 2^64 here: the overflow is pinned by its own test.
  stash_status want = model_.count(Canon(k))                                    ? STASH_ERR_DUPLICATE
                      : !decline && expect_.bytes + bytes > expect_.max_bytes ? STASH_ERR_BUDGET
                                                                                 : STASH_OK;
  ASSERT_EQ(st, want);
  if (st != STASH_OK) {
    coverage_.duplicates += st == STASH_ERR_DUPLICATE;
    coverage_.over_budget += st == STASH_ERR_BUDGET;
    p.refs--;  // the caller still owned it, and drops it
    return;
  }
  ASSERT_GT(id, last_id_);
  last_id_ = id;
  uint64_t held = decline ? 0 : bytes;
  model_[Canon(k)] = Rec{p.index, held, id, 1, decline, retain};
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
  ASSERT_EQ(got_id, rec.id);
  ASSERT_EQ(got_declined != 0, rec.declined);
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
