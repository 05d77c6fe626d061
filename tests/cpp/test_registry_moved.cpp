// test_registry_moved.cpp: records moved off the device (stash_set_moved): their bytes counted
// in moved_bytes instead of bytes, outside the budget and never demoted, and uncounted from
// wherever they count when the record goes.

#include "registry_test_support.h"

namespace {

TEST(StashRegistry, AMovedRecordCountsInMovedBytesAndBackInBytes) {
  Payload a, b;
  Registry reg;
  a.bytes = 30;
  b.bytes = 50;
  uint64_t ia = 0, ib = 0;
  stash_key ka = MakeKey(0xd000, 0, {}, 0), kb = MakeKey(0xd000, 0, {}, 1);
  ASSERT_EQ(stash_keep(reg.get(), &ka, EntryFor(a), &ia), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &kb, EntryFor(b), &ib), STASH_OK);
  ASSERT_EQ(stash_set_moved(reg.get(), ia, 1), STASH_OK);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 50u);
  EXPECT_EQ(s.moved_bytes, 30u);
  EXPECT_EQ(s.peak_bytes, 80u);
  ASSERT_EQ(stash_set_moved(reg.get(), ia, 1), STASH_OK);  // the state it has: nothing changes
  EXPECT_EQ(Stats(reg.get()), s);
  ASSERT_EQ(stash_set_moved(reg.get(), ia, 0), STASH_OK);
  s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 80u);
  EXPECT_EQ(s.moved_bytes, 0u);
  EXPECT_EQ(s.records, 2u);
}

TEST(StashRegistry, MovedBytesLeaveTheBudgetAndAMovedRecordIsNeverDemoted) {
  Payload a, b, a_stand_in, b_stand_in;
  Registry reg;
  a.bytes = 60;
  b.bytes = 60;
  uint64_t ia = 0;
  stash_key ka = MakeKey(0xd100, 0, {}, 0), kb = MakeKey(0xd100, 0, {}, 1);
  ASSERT_EQ(stash_set_max_bytes(reg.get(), 100), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &ka, DemotableEntryFor(a, &a_stand_in), &ia), STASH_OK);
  ASSERT_EQ(stash_set_moved(reg.get(), ia, 1), STASH_OK);
  // 60 moved + 60 on the device: within a budget of 100 on the device, nothing demoted.
  ASSERT_EQ(stash_keep(reg.get(), &kb, DemotableEntryFor(b, &b_stand_in), nullptr), STASH_OK);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 60u);
  EXPECT_EQ(s.moved_bytes, 60u);
  EXPECT_EQ(s.keeps, 2u);
  EXPECT_EQ(s.declined, 0u);
  EXPECT_EQ(a.releases.load(), 0);
  // Moving it back is never refused, even past the budget; the peak counts it.
  ASSERT_EQ(stash_set_moved(reg.get(), ia, 0), STASH_OK);
  s = Stats(reg.get());
  EXPECT_EQ(s.bytes, 120u);
  EXPECT_EQ(s.peak_bytes, 120u);
}

TEST(StashRegistry, AMovedRecordIsUncountedFromMovedBytesWhenTakenReleasedOrCleared) {
  Payload a, b, c;
  Registry reg;
  a.bytes = b.bytes = c.bytes = 10;
  uint64_t ia = 0, ib = 0, ic = 0;
  stash_key ka = MakeKey(0xd200, 0, {}, 0), kb = MakeKey(0xd200, 0, {}, 1), kc = MakeKey(0xd200, 0, {}, 2);
  ASSERT_EQ(stash_keep(reg.get(), &ka, EntryFor(a), &ia), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &kb, EntryFor(b), &ib), STASH_OK);
  ASSERT_EQ(stash_keep(reg.get(), &kc, EntryFor(c), &ic), STASH_OK);
  for (uint64_t id : {ia, ib, ic}) ASSERT_EQ(stash_set_moved(reg.get(), id, 1), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).moved_bytes, 30u);
  stash_entry out{};
  ASSERT_EQ(stash_take(reg.get(), &ka, 0, &out, nullptr, nullptr), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).moved_bytes, 20u);
  ASSERT_EQ(stash_release_id(reg.get(), ib), STASH_OK);
  EXPECT_EQ(Stats(reg.get()).moved_bytes, 10u);
  ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  stash_stats s = Stats(reg.get());
  EXPECT_EQ(s.moved_bytes, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.records, 0u);
  EXPECT_EQ(a.releases.load(), 0);  // taken: the caller's
  EXPECT_EQ(b.releases.load() + c.releases.load(), 2);
}

TEST(StashRegistry, SetMovedChecksItsArguments) {
  Payload a;
  Registry reg;
  uint64_t id = 0;
  stash_key k = MakeKey(0xd300, 0, {}, 0);
  ASSERT_EQ(stash_decline(reg.get(), &k, EntryFor(a), &id), STASH_OK);
  EXPECT_EQ(stash_set_moved(reg.get(), id, 1), STASH_ERR_ARGUMENT);  // declined: nothing to move
  EXPECT_EQ(stash_set_moved(reg.get(), id + 1, 1), STASH_ERR_MISSING);
  EXPECT_EQ(stash_set_moved(reg.get(), 0, 1), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_set_moved(nullptr, id, 1), STASH_ERR_ARGUMENT);
  EXPECT_EQ(Stats(reg.get()).moved_bytes, 0u);
  ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
}

}  // namespace
