// test_registry_release.cpp: releasing records of the C stash registry: stash_release_if
// by anchor or by predicate, stash_release_anchor, stash_clear, destroy, references handed out (never released),
// null release callbacks, and release callbacks that call back into the registry.

#include "registry_test_support.h"

namespace {

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
  EXPECT_EQ(s.records, other_keys.size());
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
  EXPECT_EQ(s.records, 20 - expected);
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
  EXPECT_EQ(Stats(reg.get()).records, 3u);
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
  EXPECT_EQ(s.records, 1u);
  EXPECT_EQ(s.bytes, 16u);
}

TEST(StashRegistry, ReleaseAnchorReleasesThatAnchorsRecordsLookingAtNoOther) {
  const uintptr_t target = 0xc400;
  std::vector<stash_key> target_keys = {MakeKey(target, 0, {1, 2}, 0), MakeKey(target, 1, {1, 2}, 0),
                                        MakeKey(target, 0, {1, 2}, 1), MakeKey(target, 0, {4}, 0),
                                        MakeKey(target, 7, {}, 3)};
  std::deque<Payload> tp(target_keys.size()), op(600);  // enough others for the table to grow
  Registry reg;
  for (size_t i = 0; i < target_keys.size(); ++i) Keep(reg.get(), target_keys[i], EntryFor(tp[i]));
  for (size_t i = 0; i < op.size(); ++i) {
    op[i].bytes = 1;
    Keep(reg.get(), MakeKey(target + 16 * (i + 1), 0, {1, 2}, int64_t(i % 4)), EntryFor(op[i]));
  }

  struct Ctx {
    int64_t slot;
    int calls;
  } ctx{0, 0};
  auto in_slot = [](const stash_record *r, void *c) {
    auto *ctx = static_cast<Ctx *>(c);
    ctx->calls++;
    EXPECT_EQ(r->key->anchor, 0xc400u);
    return int(r->key->slot == ctx->slot);
  };
  size_t released = 99;
  ASSERT_EQ(stash_release_anchor(reg.get(), target, in_slot, &ctx, &released), STASH_OK);
  EXPECT_EQ(ctx.calls, int(target_keys.size()));  // the anchor's records only
  EXPECT_EQ(released, 3u);
  for (size_t i = 0; i < tp.size(); ++i) EXPECT_EQ(tp[i].releases.load(), target_keys[i].slot == 0 ? 1 : 0) << i;

  ASSERT_EQ(stash_release_anchor(reg.get(), target, nullptr, nullptr, &released), STASH_OK);  // the rest of it
  EXPECT_EQ(released, 2u);
  for (auto &p : tp) EXPECT_EQ(p.releases.load(), 1);
  for (auto &p : op) EXPECT_EQ(p.releases.load(), 0);
  EXPECT_EQ(Stats(reg.get()).records, op.size());
  EXPECT_EQ(Stats(reg.get()).released_unused, target_keys.size());

  ASSERT_EQ(stash_release_anchor(reg.get(), target, nullptr, nullptr, &released), STASH_OK);
  EXPECT_EQ(released, 0u);  // nothing left under it
  ASSERT_EQ(stash_release_anchor(reg.get(), target + 16, nullptr, nullptr, nullptr), STASH_OK);
  EXPECT_EQ(op[0].releases.load(), 1);
  EXPECT_EQ(op[1].releases.load(), 0);
  EXPECT_EQ(stash_release_anchor(nullptr, target, nullptr, nullptr, &released), STASH_ERR_ARGUMENT);
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
  EXPECT_EQ(s.records, 0u);
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
  EXPECT_EQ(payload.seen.records, 1u);
  EXPECT_EQ(payload.seen.released_unused, 1u);
  EXPECT_EQ(payload.chained_status, STASH_OK);
  EXPECT_EQ(chained.releases.load(), 1);
  EXPECT_EQ(payload.keep_status, STASH_OK);
  EXPECT_EQ(Stats(reg.get()).records, 1u);

  // release_if, release_anchor and clear re-enter as well.
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x30;
  auto all = [](const stash_record *, void *) { return 1; };
  ASSERT_EQ(stash_release_if(reg.get(), all, nullptr, nullptr), STASH_OK);
  EXPECT_EQ(payload.releases, 2);
  EXPECT_EQ(payload.keep_status, STASH_OK);
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x38;
  size_t released = 0;
  ASSERT_EQ(stash_release_anchor(reg.get(), 0x30, nullptr, nullptr, &released), STASH_OK);
  EXPECT_EQ(released, 1u);
  EXPECT_EQ(payload.releases, 3);
  EXPECT_EQ(payload.keep_status, STASH_OK);
  ASSERT_EQ(stash_clear(reg.get(), nullptr), STASH_OK);
  EXPECT_EQ(payload.releases, 4);
  EXPECT_EQ(payload.seen.released_unused, 5u);

  // Destroy clears too; a record kept by a callback during destroy is released as well.
  payload.keep_replacement = true;
  payload.replacement_anchor = 0x40;
  Keep(reg.get(), MakeKey(0x50, 0, {}, 0), stash_entry{&payload, 8, nullptr, ReentrantRelease});
  reg.Destroy();
  EXPECT_EQ(payload.releases, 6);
}

}  // namespace
