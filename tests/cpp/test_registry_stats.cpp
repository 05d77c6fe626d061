// test_registry_stats.cpp: reading the C stash registry: stash_peek, stash_visit, the
// stats and their peak, the status messages; and growth through thousands of records.

#include "registry_test_support.h"

namespace {

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
  EXPECT_EQ(s.records, 2u);
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
  want.records = 2;
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
  EXPECT_EQ(s.records, size_t(n));
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
  EXPECT_EQ(s.records, 0u);
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

}  // namespace
