// test_registry_sharing.cpp: shared records of the C stash registry and their reference
// counts (stash_share, takes of a shared record, stash_read, stash_release_id), and declined records
// (stash_decline): what they hold and what taking, sharing and releasing them reports.

#include "registry_test_support.h"

namespace {

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
  want.records = 1;
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
  EXPECT_EQ(s.records, 1u);
  EXPECT_EQ(s.bytes, 70u);
  EXPECT_EQ(s.replays, 1u);

  // The last forward gets the registry's own reference: no retain, the record goes.
  Taken last = Take(reg.get(), key);
  ASSERT_EQ(last.status, STASH_OK);
  EXPECT_EQ(p.retains.load(), 1);
  s = Stats(reg.get());
  EXPECT_EQ(s.records, 0u);
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

// --- reading a record and leaving it held (stash_read) ------------------------------

TEST(StashRegistry, ReadHandsOutARetainedReferenceCountsAReplayAndLeavesEveryReferenceHeld) {
  Payload p;
  Registry reg;
  p.bytes = 60;
  stash_key key = MakeKey(0x9450, 0, {4}, 0);
  uint64_t id = Keep(reg.get(), key, EntryFor(p));
  for (int read = 1; read <= 2; ++read) {  // a recompute that may run again, and again
    stash_entry out{nullptr, 777, nullptr, nullptr};
    uint64_t got = 777;
    int declined = 777;
    ASSERT_EQ(stash_read(reg.get(), &key, id, &out, &got, &declined), STASH_OK);
    EXPECT_EQ(out.payload, &p);
    EXPECT_EQ(out.bytes, 60u);
    EXPECT_EQ(got, id);
    EXPECT_EQ(declined, 0);
    EXPECT_EQ(p.retains.load(), read);  // the reader's own reference, each time
    EXPECT_EQ(Peek(reg.get(), key), (Held{&p, 60, id, 1, false}));
    EXPECT_EQ(Stats(reg.get()).replays, static_cast<uint64_t>(read));
  }
  // The last recompute takes it: the registry's reference goes with the record.
  ASSERT_EQ(Take(reg.get(), key, id).status, STASH_OK);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.records, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.replays, 3u);
  EXPECT_EQ(s.released_unused, 0u);
  EXPECT_EQ(p.releases.load(), 0);
}

TEST(StashRegistry, ARecordReadAndThenReleasedWasNotUnusedButOneNeverReadWas) {
  Payload read, unread;
  Registry reg;
  stash_key kr = MakeKey(0x9470, 0, {}, 0), ku = MakeKey(0x9470, 0, {}, 1);
  uint64_t read_id = Keep(reg.get(), kr, EntryFor(read));
  Keep(reg.get(), ku, EntryFor(unread));
  stash_entry out{};
  ASSERT_EQ(stash_read(reg.get(), &kr, read_id, &out, nullptr, nullptr), STASH_OK);
  // Its forward's graph goes without another backward: its owner releases it.
  ASSERT_EQ(stash_release_id(reg.get(), read_id), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).released_unused, 0u);
  EXPECT_EQ(read.releases.load(), 1);
  ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).released_unused, 1u);  // the one never read
}

TEST(StashRegistry, ReadOfAMissingKeyCountsAMissAndOfAnUnshareableRecordIsAnArgumentError) {
  Payload p;
  Registry reg;
  stash_key key = MakeKey(0x9460, 0, {}, 0), other = MakeKey(0x9460, 0, {}, 1);
  uint64_t id = Keep(reg.get(), key, UnshareableEntryFor(p));
  stash_entry out{nullptr, 777, nullptr, nullptr};
  EXPECT_EQ(stash_read(reg.get(), &other, 0, &out, nullptr, nullptr), STASH_ERR_MISSING);
  EXPECT_EQ(stash_read(reg.get(), &key, id + 1, &out, nullptr, nullptr), STASH_ERR_MISSING);
  EXPECT_EQ(Stats(reg.get()).misses, 2u);
  stash_stats before = Stats(reg.get());
  // Without a retain callback no second reference can be handed out: nothing changes.
  EXPECT_EQ(stash_read(reg.get(), &key, id, &out, nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(out.payload, nullptr);
  EXPECT_EQ(Stats(reg.get()), before);
  EXPECT_EQ(Peek(reg.get(), key), (Held{&p, 0, id, 1, false}));
  EXPECT_EQ(stash_read(nullptr, &key, id, &out, nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_read(reg.get(), &key, id, nullptr, nullptr, nullptr), STASH_ERR_ARGUMENT);
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
  EXPECT_EQ(Stats(reg.get()).records, 11u);
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
  EXPECT_EQ(s.records, 0u);
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
  want.records = 1;
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

}  // namespace
