// test_registry_threads.cpp: the C stash registry used from several threads at once:
// parallel keeps, shares, takes and releases lose nothing and release nothing twice, and
// release callbacks that re-enter the registry under contention do not deadlock.

#include "registry_test_support.h"

namespace {

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
      if (s.keeps < s.replays + s.released_unused + s.records) monitor_failures++;
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
  EXPECT_EQ(s.records, Contents(reg).size());
  EXPECT_LE(s.records, 16u);
  EXPECT_EQ(s.bytes, 1000u * s.records);

  // Each accepted payload's references (the registry's, plus one per retain) end up
  // taken or released, and the registry releases each at most once; a payload that
  // was never accepted is never touched.
  const uint64_t held_before_destroy = s.records;
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

// --- slot ranges ---------------------------------------------------------------

TEST(StashRegistryConcurrency, SlotRangesHandedOutOnManyThreadsNeverOverlap) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);
  EXPECT_EQ(stash_new_slot_range(nullptr, nullptr), STASH_ERR_ARGUMENT);
  EXPECT_EQ(stash_new_slot_range(reg, nullptr), STASH_ERR_ARGUMENT);
  const int workers = 8, per_worker = 2000;
  std::vector<std::vector<int64_t>> firsts(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      for (int i = 0; i < per_worker; ++i) {
        int64_t first = -1;
        if (stash_new_slot_range(reg, &first) == STASH_OK) firsts[w].push_back(first);
      }
    });
  }
  for (auto &t : threads) t.join();
  std::set<int64_t> all;
  for (const auto &f : firsts) {
    EXPECT_EQ(f.size(), static_cast<size_t>(per_worker));
    for (int64_t first : f) {
      EXPECT_GT(first, 0);  // slot 0 is no range's: a base of 0 would mean "no layer"
      EXPECT_EQ(first % STASH_SLOTS_PER_RANGE, 0);
      all.insert(first);
    }
  }
  // Distinct multiples of the range size: no range overlaps another.
  EXPECT_EQ(all.size(), static_cast<size_t>(workers * per_worker));
  EXPECT_EQ(*all.rbegin(), static_cast<int64_t>(workers * per_worker) * STASH_SLOTS_PER_RANGE);
  stash_registry_destroy(reg);
}

}  // namespace
