// test_registry_demotion.cpp: a keep over the budget demotes the oldest kept demotable
// records of the C stash registry into declined stand-ins, whatever their keys, only as
// many as it needs and never twice; a take of a demoted record hands out its stand-in; a
// shared record moves all its references; every payload and stand-in is released once.

#include "registry_test_support.h"

namespace {

// --- budget demotion ---------------------------------------------------------

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
  want.records = 2;
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
  EXPECT_EQ(s.records, 2u);
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
    EXPECT_EQ(s.records, 2u);  // 5 and big, for destroy
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

}  // namespace
