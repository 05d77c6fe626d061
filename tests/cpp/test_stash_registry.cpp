// test_stash_registry.cpp: pins the behaviour of the C stash registry
// (csrc/stash_registry.h): keys, error codes, release callbacks, stats, growth,
// a random model-based run against std::map, and concurrent use.

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "stash_registry.h"

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

// A payload that counts how often the registry released it.
struct Payload {
  int id = 0;
  size_t bytes = 0;
  std::atomic<int> releases{0};
  std::atomic<int> takes{0};  // bumped by whoever takes it back (concurrency test)
};

void CountRelease(void *payload) { static_cast<Payload *>(payload)->releases.fetch_add(1); }

stash_entry EntryFor(Payload &p, stash_release_fn release = CountRelease) {
  return stash_entry{&p, p.bytes, release};
}

// Owns a registry for one test. Declare it after the payloads it will hold:
// its destructor releases them, so they must still be alive then.
struct Registry {
  stash_registry *r = nullptr;
  Registry() { EXPECT_EQ(stash_registry_create(&r), STASH_OK); }
  ~Registry() { stash_registry_destroy(r); }
  Registry(const Registry &) = delete;
  Registry &operator=(const Registry &) = delete;
  stash_registry *get() const { return r; }
};

stash_stats Stats(stash_registry *r) {
  stash_stats s;
  std::memset(&s, 0xab, sizeof s);
  EXPECT_EQ(stash_get_stats(r, &s), STASH_OK);
  return s;
}

bool StatsEqual(const stash_stats &a, const stash_stats &b) {
  return a.entries == b.entries && a.bytes == b.bytes && a.peak_bytes == b.peak_bytes &&
         a.keeps == b.keeps && a.takes == b.takes && a.misses == b.misses &&
         a.released_unused == b.released_unused;
}

// The comparable part of a key: only the first `rank` sizes.
using CanonKey = std::tuple<uintptr_t, int64_t, int32_t, std::vector<int64_t>, int64_t>;

CanonKey Canon(const stash_key &k) {
  return CanonKey{k.anchor, k.version, k.rank, std::vector<int64_t>(k.shape, k.shape + k.rank),
                  k.slot};
}

// Everything the registry holds, as key -> payload, read through stash_visit.
std::map<CanonKey, void *> Contents(stash_registry *r) {
  std::map<CanonKey, void *> out;
  size_t visits = 0;
  struct Ctx {
    std::map<CanonKey, void *> *out;
    size_t *visits;
  } ctx{&out, &visits};
  EXPECT_EQ(stash_visit(
                r,
                [](const stash_key *k, const stash_entry *e, void *c) {
                  auto *ctx = static_cast<Ctx *>(c);
                  (*ctx->visits)++;
                  ctx->out->emplace(Canon(*k), e->payload);
                },
                &ctx),
            STASH_OK);
  EXPECT_EQ(visits, out.size()) << "visit reported some key twice";
  return out;
}

// --- basic keep and take -------------------------------------------------------

TEST(StashRegistry, CreateRejectsNullOutput) {
  EXPECT_EQ(stash_registry_create(nullptr), STASH_ERR_ARGUMENT);
}

TEST(StashRegistry, NewRegistryIsEmptyWithZeroStats) {
  Registry reg;
  stash_stats zero{};
  EXPECT_TRUE(StatsEqual(Stats(reg.get()), zero));
  EXPECT_TRUE(Contents(reg.get()).empty());
}

TEST(StashRegistry, DestroyOfNullIsANoOp) { stash_registry_destroy(nullptr); }

TEST(StashRegistry, TakeHandsBackTheKeptPayloadBytesAndReleaseFunction) {
  Payload p;
  Registry reg;
  p.bytes = 123;
  stash_key key = MakeKey(0x1000, 3, {2, 4}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(p)), STASH_OK);

  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &key, &out), STASH_OK);
  EXPECT_EQ(out.payload, &p);
  EXPECT_EQ(out.bytes, 123u);
  EXPECT_EQ(out.release, &CountRelease);
  EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, TakeRemovesTheEntrySoASecondTakeMisses) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x1000, 0, {8}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(p)), STASH_OK);
  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &key, &out), STASH_OK);
  EXPECT_EQ(stash_take(reg.get(), &key, &out), STASH_ERR_MISSING);
  EXPECT_TRUE(Contents(reg.get()).empty());
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.takes, 1u);
  EXPECT_EQ(s.misses, 1u);
}

TEST(StashRegistry, TakeOfMissingKeyReturnsMissingCountsAMissAndLeavesOutputAlone) {
  Registry reg;
  stash_key key = MakeKey(0x2000, 0, {}, 0);
  int sentinel = 0;
  stash_entry out{&sentinel, 77, nullptr};
  EXPECT_EQ(stash_take(reg.get(), &key, &out), STASH_ERR_MISSING);
  EXPECT_EQ(stash_take(reg.get(), &key, &out), STASH_ERR_MISSING);
  EXPECT_EQ(out.payload, &sentinel);
  EXPECT_EQ(out.bytes, 77u);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(s.takes, 0u);
}

TEST(StashRegistry, SecondKeepUnderSameKeyIsRejectedAndStoresNothing) {
  Payload first, second;
  Registry reg;
  first.bytes = 10;
  second.bytes = 1000;
  stash_key key = MakeKey(0x3000, 1, {5, 6, 7}, 2);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(first)), STASH_OK);
  EXPECT_EQ(stash_keep(reg.get(), &key, EntryFor(second)), STASH_ERR_DUPLICATE);

  // The rejected payload stays the caller's: never released, not counted.
  EXPECT_EQ(second.releases.load(), 0);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, 10u);
  EXPECT_EQ(s.peak_bytes, 10u);
  EXPECT_EQ(s.keeps, 1u);

  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &key, &out), STASH_OK);
  EXPECT_EQ(out.payload, &first);
  EXPECT_EQ(second.releases.load(), 0);
  EXPECT_EQ(first.releases.load(), 0);
}

// --- keys --------------------------------------------------------------------

TEST(StashRegistry, RankAboveMaxOrNegativeIsRejectedWithoutSideEffects) {
  Payload p;
  Registry reg;
  p.bytes = 5;
  for (int32_t rank : {STASH_MAX_RANK + 1, -1, 1 << 30, -(1 << 30)}) {
    stash_key key = MakeKey(0x4000, 0, {1, 2}, 0);
    key.rank = rank;
    EXPECT_EQ(stash_keep(reg.get(), &key, EntryFor(p)), STASH_ERR_RANK) << rank;
    stash_entry out{};
    EXPECT_EQ(stash_take(reg.get(), &key, &out), STASH_ERR_RANK) << rank;
  }
  // Nothing stored, nothing released, and a malformed take is not a miss.
  stash_stats zero{};
  EXPECT_TRUE(StatsEqual(Stats(reg.get()), zero));
  EXPECT_TRUE(Contents(reg.get()).empty());
  EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, RankEightIsAcceptedAndEveryOneOfItsSizesCounts) {
  Payload p, q;
  Registry reg;
  stash_key key = MakeKey(0x5000, 0, {1, 2, 3, 4, 5, 6, 7, 8}, 0);
  ASSERT_EQ(key.rank, STASH_MAX_RANK);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(p)), STASH_OK);

  stash_key last_differs = key;
  last_differs.shape[7] = 9;
  ASSERT_EQ(stash_keep(reg.get(), &last_differs, EntryFor(q)), STASH_OK);

  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &key, &out), STASH_OK);
  EXPECT_EQ(out.payload, &p);
  ASSERT_EQ(stash_take(reg.get(), &last_differs, &out), STASH_OK);
  EXPECT_EQ(out.payload, &q);
}

TEST(StashRegistry, RankZeroKeyIsAValidKey) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x5100, 0, {}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(p)), STASH_OK);
  stash_key other_junk = key;
  for (auto &size : other_junk.shape) size = 42;
  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &other_junk, &out), STASH_OK);
  EXPECT_EQ(out.payload, &p);
}

TEST(StashRegistry, SizesBeyondRankAreIgnored) {
  Payload p, q;
  Registry reg;
  stash_key key = MakeKey(0x6000, 2, {3, 4}, 1);
  key.shape[2] = 111;
  key.shape[7] = 222;
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(p)), STASH_OK);

  stash_key same = key;
  same.shape[2] = -5;
  same.shape[7] = 0;
  // Same key for keep (duplicate) and for take.
  EXPECT_EQ(stash_keep(reg.get(), &same, EntryFor(q)), STASH_ERR_DUPLICATE);
  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &same, &out), STASH_OK);
  EXPECT_EQ(out.payload, &p);
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
    ASSERT_EQ(stash_keep(reg.get(), &keys[i], EntryFor(payloads[i])), STASH_OK) << i;
  }
  EXPECT_EQ(Stats(reg.get()).entries, keys.size());
  for (size_t i = keys.size(); i-- > 0;) {
    stash_entry out{};
    ASSERT_EQ(stash_take(reg.get(), &keys[i], &out), STASH_OK) << i;
    EXPECT_EQ(out.payload, &payloads[i]) << i;
  }
}

// --- argument checks -----------------------------------------------------------

TEST(StashRegistry, NullArgumentsAreRejectedAndChangeNothing) {
  Payload p;
  Registry reg;
  p.bytes = 9;
  stash_key key = MakeKey(0x8000, 0, {1}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(p)), STASH_OK);
  stash_stats before = Stats(reg.get());

  stash_entry out{};
  stash_stats stats{};
  size_t released = 0;
  auto pred = [](const stash_key *, const stash_entry *, void *) { return 1; };
  auto visitor = [](const stash_key *, const stash_entry *, void *) {};

  EXPECT_EQ(stash_keep(nullptr, &key, EntryFor(p)), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_keep(reg.get(), nullptr, EntryFor(p)), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_take(nullptr, &key, &out), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_take(reg.get(), nullptr, &out), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_take(reg.get(), &key, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_release_anchor(nullptr, 0x8000, &released), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_release_if(nullptr, pred, nullptr, &released), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_release_if(reg.get(), nullptr, nullptr, &released), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_clear(nullptr, &released), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_visit(nullptr, visitor, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_visit(reg.get(), nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_get_stats(nullptr, &stats), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_get_stats(reg.get(), nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_reset_peak(nullptr), STASH_ERR_ARGUMENT);

  EXPECT_TRUE(StatsEqual(Stats(reg.get()), before));
  EXPECT_EQ(Contents(reg.get()).size(), 1u);
  EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, ReleasedCountOutputMayBeNull) {
  Payload a, b, c;
  Registry reg;
  stash_key ka = MakeKey(0x8100, 0, {}, 0), kb = MakeKey(0x8200, 0, {}, 0),
            kc = MakeKey(0x8300, 0, {}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &ka, EntryFor(a)), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &kb, EntryFor(b)), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &kc, EntryFor(c)), STASH_OK);
  EXPECT_EQ(stash_release_anchor(reg.get(), 0x8100, nullptr), STASH_OK);
  auto pred = [](const stash_key *k, const stash_entry *, void *) {
    return int(k->anchor == 0x8200);
  };
  EXPECT_EQ(stash_release_if(reg.get(), pred, nullptr, nullptr), STASH_OK);
  EXPECT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  EXPECT_EQ(a.releases.load() + b.releases.load() + c.releases.load(), 3);
}

// --- releasing ---------------------------------------------------------------

TEST(StashRegistry, ReleaseAnchorReleasesEveryVersionSlotAndShapeOfThatAnchorOnly) {
  const uintptr_t target = 0x9000, other = 0x9010;
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
    ASSERT_EQ(stash_keep(reg.get(), &target_keys[i], EntryFor(tp[i])), STASH_OK);
  }
  for (size_t i = 0; i < other_keys.size(); ++i) {
    op[i].bytes = 1;
    ASSERT_EQ(stash_keep(reg.get(), &other_keys[i], EntryFor(op[i])), STASH_OK);
  }

  size_t released = 99;
  ASSERT_EQ(stash_release_anchor(reg.get(), target, &released), STASH_OK);
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

  // A second release of the same anchor finds nothing and releases nothing again.
  ASSERT_EQ(stash_release_anchor(reg.get(), target, &released), STASH_OK);
  EXPECT_EQ(released, 0u);
  for (auto &p : tp) EXPECT_EQ(p.releases.load(), 1);
}

TEST(StashRegistry, ReleaseAnchorOfAnUnknownAnchorReleasesNothing) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0xa000, 0, {}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(p)), STASH_OK);
  size_t released = 99;
  ASSERT_EQ(stash_release_anchor(reg.get(), 0xa001, &released), STASH_OK);
  EXPECT_EQ(released, 0u);
  EXPECT_EQ(p.releases.load(), 0);
  EXPECT_EQ(Stats(reg.get()).released_unused, 0u);
}

TEST(StashRegistry, ReleaseIfReleasesExactlyWhatThePredicateSelectsAndPassesItsContext) {
  std::deque<Payload> payloads(20);
  Registry reg;
  for (int i = 0; i < 20; ++i) {
    payloads[i].id = i;
    payloads[i].bytes = 10;
    stash_key key = MakeKey(0xb000 + 16 * (i % 4), i / 4, {i}, i % 3);
    ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(payloads[i])), STASH_OK);
  }
  struct Ctx {
    int64_t slot;
    int calls;
  } ctx{1, 0};
  auto pred = [](const stash_key *k, const stash_entry *e, void *c) {
    auto *ctx = static_cast<Ctx *>(c);
    ctx->calls++;
    EXPECT_NE(e->payload, nullptr);
    return int(k->slot == ctx->slot);
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

TEST(StashRegistry, ClearReleasesEverythingAndTheRegistryStaysUsable) {
  std::deque<Payload> payloads(50);
  Registry reg;
  for (int i = 0; i < 50; ++i) {
    payloads[i].bytes = 2;
    stash_key key = MakeKey(0xc000 + 8 * i, 0, {i, i}, 0);
    ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(payloads[i])), STASH_OK);
  }
  size_t released = 0;
  ASSERT_EQ(stash_clear(reg.get(), &released), STASH_OK);
  EXPECT_EQ(released, 50u);
  for (auto &p : payloads) EXPECT_EQ(p.releases.load(), 1);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.peak_bytes, 100u);
  EXPECT_EQ(s.released_unused, 50u);
  EXPECT_TRUE(Contents(reg.get()).empty());

  ASSERT_EQ(stash_clear(reg.get(), &released), STASH_OK);
  EXPECT_EQ(released, 0u);

  Payload again;
  stash_key key = MakeKey(0xc000, 0, {0, 0}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(again)), STASH_OK);
  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &key, &out), STASH_OK);
  EXPECT_EQ(out.payload, &again);
}

TEST(StashRegistry, DestroyReleasesEveryHeldEntryExactlyOnce) {
  std::deque<Payload> payloads(30);
  {
    Registry reg;
    for (int i = 0; i < 30; ++i) {
      stash_key key = MakeKey(0xd000 + 8 * (i % 5), i, {}, 0);
      ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(payloads[i])), STASH_OK);
    }
  }
  for (auto &p : payloads) EXPECT_EQ(p.releases.load(), 1);
}

TEST(StashRegistry, TakenEntriesAreNeverReleased) {
  Payload taken, held;
  {
    Registry reg;
    stash_key kt = MakeKey(0xe000, 0, {}, 0), kh = MakeKey(0xe000, 0, {}, 1);
    ASSERT_EQ(stash_keep(reg.get(), &kt, EntryFor(taken)), STASH_OK);
    ASSERT_EQ(stash_keep(reg.get(), &kh, EntryFor(held)), STASH_OK);
    stash_entry out{};
    ASSERT_EQ(stash_take(reg.get(), &kt, &out), STASH_OK);
    ASSERT_EQ(stash_release_anchor(reg.get(), 0xe000, nullptr), STASH_OK);
    ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  }
  EXPECT_EQ(taken.releases.load(), 0);
  EXPECT_EQ(held.releases.load(), 1);
}

TEST(StashRegistry, NullReleaseCallbackIsAllowedAndStillCounted) {
  Payload p;
  Registry reg;
  for (int i = 0; i < 4; ++i) {
    stash_key key = MakeKey(0xf000, 0, {}, i);
    ASSERT_EQ(stash_keep(reg.get(), &key, stash_entry{&p, 1, nullptr}), STASH_OK);
  }
  size_t released = 0;
  ASSERT_EQ(stash_release_anchor(reg.get(), 0xf000, &released), STASH_OK);
  EXPECT_EQ(released, 4u);
  EXPECT_EQ(Stats(reg.get()).released_unused, 4u);
  stash_key key = MakeKey(0xf000, 0, {}, 9);
  ASSERT_EQ(stash_keep(reg.get(), &key, stash_entry{&p, 1, nullptr}), STASH_OK);
  // ...and destroy of an entry without a callback must not crash either.
}

// --- re-entrant release callbacks -----------------------------------------------

// Release callbacks get only the payload, so the re-entrant ones find the
// registry through this payload type.
struct Reentrant {
  stash_registry *registry = nullptr;
  int releases = 0;
  bool keep_replacement = false;  // keep a new entry from inside the callback
  uintptr_t replacement_anchor = 0;
  stash_status stats_status = STASH_ERR_MISSING;
  stash_stats seen{};
  stash_status keep_status = STASH_ERR_MISSING;
};

void ReentrantRelease(void *payload) {
  auto *r = static_cast<Reentrant *>(payload);
  r->releases++;
  r->stats_status = stash_get_stats(r->registry, &r->seen);
  size_t n = 0;
  stash_release_anchor(r->registry, 0xdead0000, &n);  // takes the lock once more
  if (r->keep_replacement) {
    r->keep_replacement = false;
    stash_key key = MakeKey(r->replacement_anchor, 0, {}, 0);
    r->keep_status = stash_keep(r->registry, &key, stash_entry{r, 64, ReentrantRelease});
  }
}

TEST(StashRegistry, ReleaseCallbackMayCallBackIntoTheRegistryWithoutDeadlock) {
  Reentrant payload;
  Registry reg;
  payload.registry = reg.get();
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x20;
  stash_key key = MakeKey(0x10, 0, {}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &key, stash_entry{&payload, 32, ReentrantRelease}), STASH_OK);

  // release_anchor: the callback reads the stats (already without the entry)
  // and keeps a replacement under another anchor.
  ASSERT_EQ(stash_release_anchor(reg.get(), 0x10, nullptr), STASH_OK);
  EXPECT_EQ(payload.releases, 1);
  EXPECT_EQ(payload.stats_status, STASH_OK);
  EXPECT_EQ(payload.seen.entries, 0u);
  EXPECT_EQ(payload.seen.released_unused, 1u);
  EXPECT_EQ(payload.keep_status, STASH_OK);
  EXPECT_EQ(Stats(reg.get()).entries, 1u);

  // release_if and clear re-enter as well.
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x30;
  auto all = [](const stash_key *, const stash_entry *, void *) { return 1; };
  ASSERT_EQ(stash_release_if(reg.get(), all, nullptr, nullptr), STASH_OK);
  EXPECT_EQ(payload.releases, 2);
  EXPECT_EQ(payload.keep_status, STASH_OK);
  ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  EXPECT_EQ(payload.releases, 3);
  EXPECT_EQ(payload.seen.released_unused, 3u);

  // Destroy clears too; an entry kept by a callback during destroy is released as well.
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x40;
  stash_key k2 = MakeKey(0x50, 0, {}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &k2, stash_entry{&payload, 8, ReentrantRelease}), STASH_OK);
  stash_registry_destroy(reg.r);
  reg.r = nullptr;
  EXPECT_EQ(payload.releases, 5);
}

// --- visit, stats, messages ------------------------------------------------------

TEST(StashRegistry, PeekSeesTheEntryUnderItsKeyAndLeavesItHeld) {
  Payload kept, other;
  Registry reg;
  stash_key key = MakeKey(0x7000, 3, {4, 5}, 1);
  stash_key other_slot = MakeKey(0x7000, 3, {4, 5}, 2);
  ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(kept)), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &other_slot, EntryFor(other)), STASH_OK);
  void *seen = nullptr;
  auto record = [](const stash_key *, const stash_entry *e, void *c) { *static_cast<void **>(c) = e->payload; };
  ASSERT_EQ(stash_peek(reg.get(), &key, record, &seen), STASH_OK);
  EXPECT_EQ(seen, &kept);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.takes, 0u);

  stash_key missing = MakeKey(0x7000, 4, {4, 5}, 1);  // another version
  seen = nullptr;
  EXPECT_EQ(stash_peek(reg.get(), &missing, record, &seen), STASH_ERR_MISSING);
  EXPECT_EQ(seen, nullptr);
  EXPECT_EQ(Stats(reg.get()).misses, 0u);  // a peek is no take
  stash_key bad = MakeKey(0x7000, 3, {4, 5}, 1);
  bad.rank = STASH_MAX_RANK + 1;
  EXPECT_EQ(stash_peek(reg.get(), &bad, record, &seen), STASH_ERR_RANK);
  EXPECT_EQ(stash_peek(nullptr, &key, record, &seen), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_peek(reg.get(), &key, nullptr, &seen), STASH_ERR_ARGUMENT);
}

TEST(StashRegistry, VisitSeesEveryHeldEntryOnceWithItsKeyAndEntry) {
  std::deque<Payload> payloads(40);
  Registry reg;
  int calls = 0;
  auto count = [](const stash_key *, const stash_entry *, void *c) { ++*static_cast<int *>(c); };
  ASSERT_EQ(stash_visit(reg.get(), count, &calls), STASH_OK);
  EXPECT_EQ(calls, 0);

  std::map<CanonKey, void *> expected;
  for (int i = 0; i < 40; ++i) {
    payloads[i].bytes = size_t(i);
    stash_key key = MakeKey(0x11000 + 8 * (i % 7), i % 2, {i, 2 * i}, i % 3);
    ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(payloads[i])), STASH_OK);
    expected[Canon(key)] = &payloads[i];
  }
  EXPECT_EQ(Contents(reg.get()), expected);

  // The entry seen by the visitor is the one kept (bytes and release too).
  struct Ctx {
    int bad = 0;
  } ctx;
  ASSERT_EQ(stash_visit(
                reg.get(),
                [](const stash_key *, const stash_entry *e, void *c) {
                  auto *p = static_cast<Payload *>(e->payload);
                  if (e->bytes != p->bytes || e->release != &CountRelease) {
                    static_cast<Ctx *>(c)->bad++;
                  }
                },
                &ctx),
            STASH_OK);
  EXPECT_EQ(ctx.bad, 0);
  for (auto &p : payloads) EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, StatsTrackEntriesBytesKeepsTakesAndPeak) {
  Payload a, b, c;
  Registry reg;
  a.bytes = 100;
  b.bytes = 50;
  c.bytes = 30;
  stash_key ka = MakeKey(1, 0, {}, 0), kb = MakeKey(2, 0, {}, 0), kc = MakeKey(3, 0, {}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &ka, EntryFor(a)), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &kb, EntryFor(b)), STASH_OK);
  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &ka, &out), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &kc, EntryFor(c)), STASH_OK);

  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.bytes, 80u);
  EXPECT_EQ(s.peak_bytes, 150u);  // a and b together, earlier
  EXPECT_EQ(s.keeps, 3u);
  EXPECT_EQ(s.takes, 1u);
  EXPECT_EQ(s.misses, 0u);
  EXPECT_EQ(s.released_unused, 0u);
}

TEST(StashRegistry, ResetPeakSetsPeakToTheBytesHeldNow) {
  Payload a, b;
  Registry reg;
  a.bytes = 100;
  b.bytes = 40;
  stash_key ka = MakeKey(1, 0, {}, 0), kb = MakeKey(2, 0, {}, 0);
  ASSERT_EQ(stash_keep(reg.get(), &ka, EntryFor(a)), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &kb, EntryFor(b)), STASH_OK);
  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &ka, &out), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).peak_bytes, 140u);

  ASSERT_EQ(stash_reset_peak(reg.get()), STASH_OK);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.peak_bytes, 40u);
  EXPECT_EQ(s.bytes, 40u);
  EXPECT_EQ(s.keeps, 2u);  // the other counters are untouched
  EXPECT_EQ(s.takes, 1u);

  // The peak climbs again from there, and a release does not lower it.
  ASSERT_EQ(stash_keep(reg.get(), &ka, EntryFor(a)), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).peak_bytes, 140u);
  ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).peak_bytes, 140u);
  ASSERT_EQ(stash_reset_peak(reg.get()), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).peak_bytes, 0u);
}

TEST(StashRegistry, StatusMessagesAreDistinctAndOutOfRangeIsUnknown) {
  std::set<std::string> seen;
  for (int s = STASH_OK; s <= STASH_ERR_NOMEM; ++s) {
    const char *msg = stash_status_message(static_cast<stash_status>(s));
    ASSERT_NE(msg, nullptr);
    EXPECT_STRNE(msg, "unknown status") << s;
    EXPECT_GT(std::strlen(msg), 0u);
    seen.insert(msg);
  }
  EXPECT_EQ(seen.size(), 6u);
  // Only values the C++ enum can represent (0..7): anything else is UB on this side.
  EXPECT_STREQ(stash_status_message(static_cast<stash_status>(6)), "unknown status");
  EXPECT_STREQ(stash_status_message(static_cast<stash_status>(7)), "unknown status");
  // Static strings: the same pointer every time.
  EXPECT_EQ(stash_status_message(STASH_ERR_RANK), stash_status_message(STASH_ERR_RANK));
}

// --- growth ------------------------------------------------------------------

TEST(StashRegistry, GrowsThroughThousandsOfEntriesAndGivesThemAllBack) {
  const int n = 20000;
  std::deque<Payload> payloads(n);
  Registry reg;
  std::vector<stash_key> keys;
  keys.reserve(n);
  for (int i = 0; i < n; ++i) {
    payloads[i].id = i;
    payloads[i].bytes = size_t(i % 97);
    // Mostly distinct anchors, plus a run of 625 sharing one anchor (one long chain).
    uintptr_t anchor = i % 32 == 0 ? 0x7f0000001000 : 0x7f0000100000 + 256 * uintptr_t(i);
    keys.push_back(MakeKey(anchor, i % 3, {i, 64}, i));
    ASSERT_EQ(stash_keep(reg.get(), &keys[i], EntryFor(payloads[i])), STASH_OK) << i;
  }
  size_t total = 0;
  for (auto &p : payloads) total += p.bytes;
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.entries, size_t(n));
  EXPECT_EQ(s.bytes, total);
  EXPECT_EQ(Contents(reg.get()).size(), size_t(n));

  // Every key is still found after the table grew under it.
  for (int i = 0; i < n; i += 2) {
    ASSERT_EQ(stash_keep(reg.get(), &keys[i], EntryFor(payloads[i])), STASH_ERR_DUPLICATE) << i;
  }
  for (int i = n; i-- > 0;) {
    stash_entry out{};
    ASSERT_EQ(stash_take(reg.get(), &keys[i], &out), STASH_OK) << i;
    ASSERT_EQ(out.payload, &payloads[i]) << i;
  }
  s = Stats(reg.get());
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.peak_bytes, total);
  EXPECT_EQ(s.takes, uint64_t(n));
  for (auto &p : payloads) EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, ReleaseAnchorAfterGrowthReleasesOnlyThatAnchor) {
  const int n = 5000;
  std::deque<Payload> payloads(n);
  Registry reg;
  for (int i = 0; i < n; ++i) {
    stash_key key = MakeKey(0x100000 + 64 * uintptr_t(i % 50), i, {}, 0);
    ASSERT_EQ(stash_keep(reg.get(), &key, EntryFor(payloads[i])), STASH_OK);
  }
  size_t released = 0;
  ASSERT_EQ(stash_release_anchor(reg.get(), 0x100000 + 64 * 7, &released), STASH_OK);
  EXPECT_EQ(released, size_t(n / 50));
  for (int i = 0; i < n; ++i) EXPECT_EQ(payloads[i].releases.load(), i % 50 == 7 ? 1 : 0) << i;
}

// --- a random run against a reference model --------------------------------------

// Every payload of the model test records its own release into this log.
struct LoggedPayload {
  int id;
  std::vector<int> *log;
};
void LogRelease(void *payload) {
  auto *p = static_cast<LoggedPayload *>(payload);
  p->log->push_back(p->id);
}

TEST(StashRegistry, RandomOperationsMatchAReferenceModel) {
  std::mt19937_64 rng(20240607);
  auto pick = [&](int n) { return int(rng() % uint64_t(n)); };

  struct Held {
    int id;
    size_t bytes;
  };
  std::map<CanonKey, Held> model;
  stash_stats expect{};
  std::deque<LoggedPayload> payloads;
  std::vector<int> release_log;
  uint64_t duplicates = 0;
  Registry reg;

  // A small key space so that duplicates, hits and shared anchors are common.
  auto random_key = [&]() {
    std::vector<int64_t> shape(size_t(pick(3)));
    for (auto &d : shape) d = 1 + pick(2);
    stash_key k = MakeKey(0x1000 + 0x40 * uintptr_t(pick(4)), pick(2), shape, pick(2));
    for (int i = k.rank; i < STASH_MAX_RANK; ++i) k.shape[i] = int64_t(rng());  // junk past rank
    return k;
  };
  // Drops the model entries that `drop` selects and returns their payload ids.
  auto model_release = [&](auto drop) {
    std::multiset<int> ids;
    for (auto it = model.begin(); it != model.end();) {
      if (drop(it->first)) {
        ids.insert(it->second.id);
        expect.entries--;
        expect.bytes -= it->second.bytes;
        expect.released_unused++;
        it = model.erase(it);
      } else {
        ++it;
      }
    }
    return ids;
  };

  const int steps = 10000;
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    release_log.clear();
    std::multiset<int> expected_released;
    int op = pick(1000);
    if (op < 500) {  // keep
      stash_key k = random_key();
      payloads.push_back(LoggedPayload{int(payloads.size()), &release_log});
      size_t bytes = size_t(pick(1000));
      stash_status st = stash_keep(reg.get(), &k, stash_entry{&payloads.back(), bytes, LogRelease});
      bool present = model.count(Canon(k)) != 0;
      ASSERT_EQ(st, present ? STASH_ERR_DUPLICATE : STASH_OK);
      duplicates += present;
      if (!present) {
        model[Canon(k)] = Held{payloads.back().id, bytes};
        expect.entries++;
        expect.bytes += bytes;
        expect.keeps++;
        if (expect.bytes > expect.peak_bytes) expect.peak_bytes = expect.bytes;
      }
    } else if (op < 800) {  // take: half of the time a key known to be held
      stash_key k = random_key();
      if (!model.empty() && pick(2) == 0) {
        auto it = std::next(model.begin(), pick(int(model.size())));
        k.anchor = std::get<0>(it->first);
        k.version = std::get<1>(it->first);
        k.rank = std::get<2>(it->first);
        for (int i = 0; i < k.rank; ++i) k.shape[i] = std::get<3>(it->first)[size_t(i)];
        k.slot = std::get<4>(it->first);
      }
      stash_entry out{};
      stash_status st = stash_take(reg.get(), &k, &out);
      auto it = model.find(Canon(k));
      if (it == model.end()) {
        ASSERT_EQ(st, STASH_ERR_MISSING);
        expect.misses++;
      } else {
        ASSERT_EQ(st, STASH_OK);
        ASSERT_EQ(static_cast<LoggedPayload *>(out.payload)->id, it->second.id);
        ASSERT_EQ(out.bytes, it->second.bytes);
        ASSERT_EQ(out.release, &LogRelease);
        expect.entries--;
        expect.bytes -= it->second.bytes;
        expect.takes++;
        model.erase(it);
      }
    } else if (op < 860) {  // release_anchor
      uintptr_t anchor = 0x1000 + 0x40 * uintptr_t(pick(5));  // the fifth is never used
      expected_released =
          model_release([&](const CanonKey &k) { return std::get<0>(k) == anchor; });
      size_t released = 99;
      ASSERT_EQ(stash_release_anchor(reg.get(), anchor, &released), STASH_OK);
      ASSERT_EQ(released, expected_released.size());
    } else if (op < 910) {  // release_if on version and slot
      int64_t ctx[2] = {pick(2), pick(2)};
      expected_released = model_release(
          [&](const CanonKey &k) { return std::get<1>(k) == ctx[0] && std::get<4>(k) == ctx[1]; });
      auto pred = [](const stash_key *k, const stash_entry *, void *c) {
        auto *want = static_cast<int64_t *>(c);
        return int(k->version == want[0] && k->slot == want[1]);
      };
      size_t released = 99;
      ASSERT_EQ(stash_release_if(reg.get(), pred, ctx, &released), STASH_OK);
      ASSERT_EQ(released, expected_released.size());
    } else if (op < 990) {  // reset_peak
      ASSERT_EQ(stash_reset_peak(reg.get()), STASH_OK);
      expect.peak_bytes = expect.bytes;
    } else {  // clear
      expected_released = model_release([](const CanonKey &) { return true; });
      size_t released = 99;
      ASSERT_EQ(stash_clear(reg.get(), &released), STASH_OK);
      ASSERT_EQ(released, expected_released.size());
    }

    // After every step: the same releases, contents and counters as the model.
    ASSERT_EQ(std::multiset<int>(release_log.begin(), release_log.end()), expected_released);
    std::map<CanonKey, void *> want;
    for (auto &kv : model) want[kv.first] = &payloads[size_t(kv.second.id)];
    ASSERT_EQ(Contents(reg.get()), want);
    stash_stats got = Stats(reg.get());
    ASSERT_EQ(got.entries, expect.entries);
    ASSERT_EQ(got.bytes, expect.bytes);
    ASSERT_EQ(got.peak_bytes, expect.peak_bytes);
    ASSERT_EQ(got.keeps, expect.keeps);
    ASSERT_EQ(got.takes, expect.takes);
    ASSERT_EQ(got.misses, expect.misses);
    ASSERT_EQ(got.released_unused, expect.released_unused);
  }
  // The run must have exercised every path.
  EXPECT_GT(expect.keeps, 2000u);
  EXPECT_GT(duplicates, 200u);
  EXPECT_GT(expect.takes, 800u);
  EXPECT_GT(expect.misses, 800u);
  EXPECT_GT(expect.released_unused, 1000u);

  // Destroy releases what the model still holds.
  release_log.clear();
  stash_registry_destroy(reg.r);
  reg.r = nullptr;
  EXPECT_EQ(release_log.size(), model.size());
}

// --- concurrency ---------------------------------------------------------------

TEST(StashRegistryConcurrency, ParallelKeepsTakesAndReleasesLoseNothingAndReleaseNothingTwice) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);

  const int workers = 8;
  const int iterations = 10000;
  const uintptr_t shared_anchor = 0xabc000;

  // Preallocated so that no payload moves while another thread holds its address.
  struct Worker {
    std::deque<Payload> payloads;
    std::vector<char> kept;  // kept[i]: payload i was accepted by stash_keep
    uint64_t keeps = 0, takes = 0, misses = 0, duplicates = 0, failures = 0;
  };
  std::vector<Worker> state(workers);
  for (auto &w : state) {
    w.payloads.resize(2 * iterations);
    w.kept.assign(2 * iterations, 0);
  }
  std::atomic<bool> stop{false};

  auto take = [&](Worker &w, const stash_key &key) {
    stash_entry out{};
    stash_status st = stash_take(reg, &key, &out);
    if (st == STASH_OK) {
      w.takes++;
      auto *p = static_cast<Payload *>(out.payload);
      p->takes.fetch_add(1);
      if (out.bytes != p->bytes) w.failures++;
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
    for (int i = 0; i < iterations; ++i) {
      // Own key: kept now, taken back below; nobody else touches this anchor.
      Payload &own = w.payloads[size_t(2 * i)];
      own.bytes = size_t(1 + i % 64);
      stash_key own_key = MakeKey(own_anchor, i % 5, {t, i}, 0);
      stash_status st = stash_keep(reg, &own_key, EntryFor(own));
      if (st != STASH_OK) {
        w.failures++;
      } else {
        w.kept[size_t(2 * i)] = 1;
        w.keeps++;
      }

      // Shared keys: a small space that every worker keeps into and takes from,
      // so duplicates, cross-thread takes and misses all happen.
      Payload &shared = w.payloads[size_t(2 * i + 1)];
      shared.bytes = 1000;
      stash_key shared_key = MakeKey(shared_anchor, 0, {4}, int64_t(rng() % 16));
      st = stash_keep(reg, &shared_key, EntryFor(shared));
      if (st == STASH_OK) {
        w.kept[size_t(2 * i + 1)] = 1;
        w.keeps++;
      } else if (st == STASH_ERR_DUPLICATE) {
        w.duplicates++;
      } else {
        w.failures++;
      }
      shared_key.slot = int64_t(rng() % 16);
      take(w, shared_key);

      // Leave some own entries for a while (so the table grows), then take them back.
      if (i % 4 == 3) {
        for (int j = i - 3; j <= i; ++j) take(w, MakeKey(own_anchor, j % 5, {t, j}, 0));
      }
    }
  };

  // The monitor reads stats, visits and drops the shared anchor while workers run.
  uint64_t monitor_released = 0, monitor_rounds = 0, monitor_failures = 0;
  auto monitor = [&]() {
    while (!stop.load()) {
      stash_stats s;
      if (stash_get_stats(reg, &s) != STASH_OK) monitor_failures++;
      // Under the lock the counters are consistent with each other at every instant.
      if (s.keeps != s.takes + s.released_unused + s.entries) monitor_failures++;
      if (s.bytes > s.peak_bytes) monitor_failures++;
      stash_visit(
          reg,
          [](const stash_key *, const stash_entry *e, void *failures) {
            auto *p = static_cast<Payload *>(e->payload);
            // A held payload was neither taken nor released yet.
            if (e->bytes != p->bytes || p->releases.load() != 0 || p->takes.load() != 0) {
              ++*static_cast<uint64_t *>(failures);
            }
          },
          &monitor_failures);
      size_t released = 0;
      if (stash_release_anchor(reg, shared_anchor, &released) != STASH_OK) monitor_failures++;
      monitor_released += released;
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

  uint64_t keeps = 0, takes = 0, misses = 0, duplicates = 0, failures = 0;
  for (auto &w : state) {
    keeps += w.keeps;
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
  EXPECT_EQ(s.keeps, keeps);
  EXPECT_EQ(s.takes, takes);
  EXPECT_EQ(s.misses, misses);
  EXPECT_EQ(s.keeps, s.takes + s.released_unused + s.entries);
  // Workers took all their own keys back; only shared ones may remain.
  EXPECT_EQ(s.entries, Contents(reg).size());
  EXPECT_LE(s.entries, 16u);
  EXPECT_EQ(s.bytes, 1000u * s.entries);
  EXPECT_EQ(s.released_unused, monitor_released);

  // Each accepted payload ends up taken or released exactly once (destroy
  // releases the rest); a payload that was never accepted is never touched.
  const uint64_t released_before_destroy = s.released_unused;
  stash_registry_destroy(reg);
  uint64_t total_releases = 0, bad = 0;
  for (auto &w : state) {
    for (size_t i = 0; i < w.payloads.size(); ++i) {
      int r = w.payloads[i].releases.load(), tk = w.payloads[i].takes.load();
      total_releases += uint64_t(r);
      if (w.kept[i] ? r + tk != 1 : r + tk != 0) bad++;
    }
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(total_releases, released_before_destroy + s.entries);
}

// Release callbacks that re-enter the registry while other threads hammer it.
std::atomic<stash_registry *> g_reentrant_registry{nullptr};
std::atomic<int> g_reentrant_releases{0};
void ReenterOnRelease(void *) {
  stash_stats s;
  stash_get_stats(g_reentrant_registry.load(), &s);
  stash_key key = MakeKey(0xfeed000, 0, {}, 0);
  stash_entry out{};
  stash_take(g_reentrant_registry.load(), &key, &out);
  g_reentrant_releases.fetch_add(1);
}

TEST(StashRegistryConcurrency, ReentrantReleaseCallbacksUnderContentionDoNotDeadlock) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);
  g_reentrant_registry.store(reg);
  g_reentrant_releases.store(0);
  const int threads_n = 4, iterations = 2000;
  std::vector<int> kept(threads_n, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < threads_n; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < iterations; ++i) {
        const uintptr_t anchor = 0x10000 * uintptr_t(t + 1) + 16 * uintptr_t(i % 8);
        stash_key key = MakeKey(anchor, i, {}, 0);
        if (stash_keep(reg, &key, stash_entry{nullptr, 1, ReenterOnRelease}) == STASH_OK) {
          kept[size_t(t)]++;
        }
        if (i % 3 == 0) stash_release_anchor(reg, anchor, nullptr);
        if (i % 97 == 0) {
          auto pred = [](const stash_key *k, const stash_entry *, void *) {
            return int(k->version % 2);
          };
          stash_release_if(reg, pred, nullptr, nullptr);
        }
      }
    });
  }
  for (auto &th : threads) th.join();
  stash_stats s = Stats(reg);
  stash_registry_destroy(reg);
  int total_kept = 0;
  for (int k : kept) total_kept += k;
  EXPECT_EQ(uint64_t(total_kept), s.keeps);
  EXPECT_EQ(uint64_t(g_reentrant_releases.load()), s.released_unused + s.entries);
  EXPECT_EQ(g_reentrant_releases.load(), total_kept);
}

}  // namespace
