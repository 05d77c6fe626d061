// test_registry_keys.cpp: the C stash registry (csrc/stash_registry.h) keeping, declining
// and taking records under their keys: what a take hands back, duplicate keys, the ids
// records get, which fields of a key tell records apart, and the checks of every argument.

#include "registry_test_support.h"

namespace {

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
  EXPECT_EQ(s.records, 0u);
}

TEST(StashRegistry, TakeWithTheIdOfAnotherKeysRecordMisses) {
  Payload a, b;
  Registry reg;
  stash_key ka = MakeKey(0x1300, 0, {}, 0), kb = MakeKey(0x1300, 0, {}, 1);
  Keep(reg.get(), ka, EntryFor(a));
  uint64_t idb = Keep(reg.get(), kb, EntryFor(b));
  EXPECT_EQ(Take(reg.get(), ka, idb).status, STASH_ERR_MISSING);
  EXPECT_EQ(Stats(reg.get()).records, 2u);
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
  EXPECT_EQ(Stats(reg.get()).records, keys.size());
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

}  // namespace
