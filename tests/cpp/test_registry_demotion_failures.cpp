// test_registry_demotion_failures.cpp: demotion in the C stash registry when it cannot or
// need not happen: an entry without a release callback, a keep no demotion could make
// room for, a demote callback failing part-way, errors, declines and shares (which demote
// nothing), a lowered budget, and payloads released only after the registry unlocks.

#include "registry_test_support.h"

namespace {

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
  EXPECT_EQ(a.seen.records, 2u);
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

}  // namespace
