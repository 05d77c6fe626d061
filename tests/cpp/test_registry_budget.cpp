// test_registry_budget.cpp: the byte budget of the C stash registry (stash_set_max_bytes):
// the keeps it refuses, a comparison that cannot overflow, and a budget lowered below
// what is held.

#include "registry_test_support.h"

namespace {

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
  want.records = 2;
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
  EXPECT_EQ(s.records, 2u);
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

}  // namespace
