// test_registry_threads_budget.cpp: the budget of the C stash registry under concurrent use:
// the bytes held never pass it, with concurrent keeps and takes, and while concurrent
// keeps demote older records.

#include "registry_test_support.h"

namespace {

TEST(StashRegistryConcurrency, BytesHeldNeverPassTheBudgetUnderConcurrentKeepsAndTakes) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);
  const uint64_t budget = 16000;
  ASSERT_EQ(stash_set_max_bytes(reg, budget), STASH_OK);

  const int workers = 6;
  const int iterations = 5000;
  const int window = 4;  // records each worker holds at once: ~6 * 4 * 1000 bytes, over budget
  struct Worker {
    std::deque<Payload> payloads;
    std::vector<char> declined;
    uint64_t keeps = 0, declines = 0, replays = 0, declined_takes = 0, failures = 0;
  };
  std::vector<Worker> state(workers);
  for (auto &w : state) {
    w.payloads.resize(iterations);
    w.declined.assign(iterations, 0);
  }
  std::atomic<bool> stop{false};

  auto worker = [&](int t) {
    Worker &w = state[size_t(t)];
    std::mt19937 rng(unsigned(99 + t));
    auto key = [&](int i) { return MakeKey(0x200000 * uintptr_t(t + 1), i, {t}, 0); };
    for (int i = 0; i < iterations; ++i) {
      Payload &p = w.payloads[size_t(i)];
      p.bytes = 1 + rng() % 2000;
      stash_key k = key(i);
      stash_status st = stash_keep(reg, &k, EntryFor(p), nullptr);
      if (st == STASH_OK) {
        w.keeps++;
      } else if (st == STASH_ERR_BUDGET) {
        // What the torch layer does: remember the forward as declined.
        if (stash_decline(reg, &k, EntryFor(p), nullptr) != STASH_OK) w.failures++;
        w.declined[size_t(i)] = 1;
        w.declines++;
      } else {
        w.failures++;
      }
      if (i >= window - 1) {
        int j = i - (window - 1);
        stash_entry out{};
        int declined = -1;
        stash_key kj = key(j);
        if (stash_take(reg, &kj, 0, &out, nullptr, &declined) != STASH_OK ||
            (declined != 0) != (w.declined[size_t(j)] != 0) || out.payload != &w.payloads[size_t(j)]) {
          w.failures++;
        }
        (declined ? w.declined_takes : w.replays)++;
      }
    }
  };

  // The checker reads the stats and the records held, each under one lock.
  uint64_t checks = 0, check_failures = 0;
  auto checker = [&]() {
    while (!stop.load()) {
      stash_stats s = Stats(reg);
      if (s.bytes > budget || s.peak_bytes > budget || s.max_bytes != budget) check_failures++;
      uint64_t held = 0;
      stash_visit(
          reg, [](const stash_record *r, void *c) { *static_cast<uint64_t *>(c) += r->entry->bytes; },
          &held);
      if (held > budget) check_failures++;
      checks++;
      std::this_thread::yield();
    }
  };

  std::thread check(checker);
  std::vector<std::thread> threads;
  for (int t = 0; t < workers; ++t) threads.emplace_back(worker, t);
  for (auto &th : threads) th.join();
  stop.store(true);
  check.join();

  uint64_t keeps = 0, declines = 0, replays = 0, declined_takes = 0, failures = 0;
  for (auto &w : state) {
    keeps += w.keeps;
    declines += w.declines;
    replays += w.replays;
    declined_takes += w.declined_takes;
    failures += w.failures;
  }
  EXPECT_EQ(failures, 0u);
  EXPECT_EQ(check_failures, 0u);
  EXPECT_GT(checks, 0u);
  EXPECT_GT(keeps, 0u);
  EXPECT_GT(declines, 0u);  // the budget really was contended

  stash_stats s = Stats(reg);
  EXPECT_LE(s.peak_bytes, budget);
  EXPECT_GT(s.peak_bytes, budget / 2);
  EXPECT_EQ(s.keeps, keeps);
  EXPECT_EQ(s.declined, declines);
  EXPECT_EQ(s.replays, replays);
  EXPECT_EQ(s.released_unused, 0u);
  EXPECT_EQ(s.records, uint64_t(workers * (window - 1)));
  EXPECT_EQ(s.keeps + s.declined, s.replays + declined_takes + s.released_unused + LiveRefs(reg));
  stash_registry_destroy(reg);
  uint64_t releases = 0;
  for (auto &w : state) {
    for (auto &p : w.payloads) releases += uint64_t(p.releases.load());
  }
  EXPECT_EQ(releases, s.records);
}

TEST(StashRegistryConcurrency, BytesHeldNeverPassTheBudgetWhileConcurrentKeepsDemoteOlderRecords) {
  stash_registry *reg = nullptr;
  ASSERT_EQ(stash_registry_create(&reg), STASH_OK);
  const uint64_t budget = 16000;
  ASSERT_EQ(stash_set_max_bytes(reg, budget), STASH_OK);

  const int workers = 6;
  const int iterations = 4000;
  // Records each worker holds at once: ~20 * 1700 bytes, over the budget even for one
  // worker alone, so that demotion happens however the threads are scheduled.
  const int window = 20;
  const int left = 3;  // records each worker leaves for destroy
  // Payload i of a worker: demotable unless i % 4 == 0 (those, held by all workers at once,
  // fill about the budget on their own, so that some keeps are refused); its demote fails
  // if i % 101 == 0; shared by a second forward if i % 5 == 0. Stand-ins have negative ids.
  auto demotable = [](int i) { return i % 4 != 0; };
  auto demote_fails = [](int i) { return i % 101 == 0; };
  struct Worker {
    std::deque<Payload> payloads, stand_ins;
    std::vector<char> declined;  // refused by the budget, stored declined by the worker
    std::vector<int> forwards;   // forwards that hold payload i's record
    uint64_t keeps = 0, declines = 0, shares = 0, replays = 0, declined_takes = 0, stand_in_takes = 0;
    uint64_t failures = 0;
  };
  std::vector<Worker> state(workers);
  for (auto &w : state) {
    w.payloads.resize(iterations);
    w.stand_ins.resize(iterations);
    w.declined.assign(iterations, 0);
    w.forwards.assign(iterations, 0);
  }
  std::atomic<bool> stop{false}, go{false};
  std::atomic<int> finished{0};

  auto key = [](int t, int i) {
    return MakeKey(0x300000 * uintptr_t(t + 1) + 0x40 * uintptr_t(i % 3), i, {t}, i % 2);
  };
  // Takes back every forward of worker t's record j, checking what comes back.
  auto take_back = [&](int t, int j) {
    Worker &w = state[size_t(t)];
    stash_key kj = key(t, j);
    for (int f = 0; f < w.forwards[size_t(j)]; ++f) {
      stash_entry out{};
      int declined = -1;
      if (stash_take(reg, &kj, 0, &out, nullptr, &declined) != STASH_OK) {
        w.failures++;
        continue;
      }
      auto *got = static_cast<Payload *>(out.payload);
      if (got == &w.payloads[size_t(j)]) {  // kept (and replayed), or declined by the worker
        if ((declined != 0) != (w.declined[size_t(j)] != 0) || out.bytes != (declined ? 0 : got->bytes)) {
          w.failures++;
        }
      } else if (got == &w.stand_ins[size_t(j)]) {  // demoted by some worker's keep
        if (declined != 1 || out.bytes != 0 || w.declined[size_t(j)] || !demotable(j) || demote_fails(j)) {
          w.failures++;
        }
        w.stand_in_takes++;
      } else {
        w.failures++;
        continue;
      }
      got->takes.fetch_add(1);
      (declined ? w.declined_takes : w.replays)++;
    }
  };

  auto worker = [&](int t) {
    Worker &w = state[size_t(t)];
    std::mt19937 rng(unsigned(4242 + t));
    while (!go.load()) std::this_thread::yield();  // all together, for contention
    for (int i = 0; i < iterations; ++i) {
      Payload &p = w.payloads[size_t(i)];
      p.id = i;
      w.stand_ins[size_t(i)].id = -1 - i;
      p.bytes = 1 + rng() % (demotable(i) ? 2000 : 1200);
      stash_entry e = demotable(i) ? DemotableEntryFor(p, demote_fails(i) ? nullptr : &w.stand_ins[size_t(i)])
                                   : EntryFor(p);
      stash_key k = key(t, i);
      uint64_t id = 0;
      stash_status st = stash_keep(reg, &k, e, &id);
      if (st == STASH_OK) {
        w.keeps++;
      } else if (st == STASH_ERR_BUDGET) {
        if (stash_decline(reg, &k, e, &id) != STASH_OK) w.failures++;
        w.declined[size_t(i)] = 1;
        w.declines++;
      } else {
        w.failures++;
      }
      w.forwards[size_t(i)] = 1;
      if (i % 5 == 0) {  // kept or demoted by now, or declined: a share counts as the record is
        if (stash_share(reg, &k, id) == STASH_OK) {
          w.forwards[size_t(i)] = 2;
          w.shares++;
        } else {
          w.failures++;
        }
      }
      if (i >= window - 1) take_back(t, i - (window - 1));
    }
    // Once every worker is done keeping, take back all but the last `left` records (a
    // worker's leftovers must not crowd out those that still run: they hold bytes).
    finished.fetch_add(1);
    while (finished.load() < workers) std::this_thread::yield();
    for (int j = iterations - (window - 1); j < iterations - left; ++j) take_back(t, j);
  };

  // The checker reads the stats and the records held, each under one lock.
  uint64_t checks = 0, check_failures = 0;
  auto checker = [&]() {
    while (!stop.load()) {
      stash_stats s = Stats(reg);
      if (s.bytes > budget || s.peak_bytes > budget || s.max_bytes != budget) check_failures++;
      struct Seen {
        uint64_t held = 0, bad = 0;
      } seen;
      stash_visit(
          reg,
          [](const stash_record *r, void *c) {
            auto *seen = static_cast<Seen *>(c);
            auto *p = static_cast<Payload *>(r->entry->payload);
            seen->held += r->entry->bytes;
            // A kept record holds its own payload, unreleased, and its bytes; a declined
            // one (a stand-in among them) holds none.
            if (r->declined ? r->entry->bytes != 0
                            : p->id < 0 || r->entry->bytes != p->bytes || p->releases.load() != 0) {
              seen->bad++;
            }
            if (p->id < 0 && !r->declined) seen->bad++;
          },
          &seen);
      if (seen.held > budget || seen.bad != 0) check_failures++;
      checks++;
      std::this_thread::yield();
    }
  };

  std::thread check(checker);
  std::vector<std::thread> threads;
  for (int t = 0; t < workers; ++t) threads.emplace_back(worker, t);
  go.store(true);
  for (auto &th : threads) th.join();
  stop.store(true);
  check.join();

  uint64_t keeps = 0, declines = 0, shares = 0, replays = 0, declined_takes = 0, stand_in_takes = 0, failures = 0;
  for (auto &w : state) {
    keeps += w.keeps;
    declines += w.declines;
    shares += w.shares;
    replays += w.replays;
    declined_takes += w.declined_takes;
    stand_in_takes += w.stand_in_takes;
    failures += w.failures;
  }
  EXPECT_EQ(failures, 0u);
  EXPECT_EQ(check_failures, 0u);
  EXPECT_GT(checks, 0u);
  EXPECT_GT(keeps, 0u);
  EXPECT_GT(declines, 0u);  // the budget really was contended, past what demotion could do
  EXPECT_GT(stand_in_takes, 0u);

  stash_stats s = Stats(reg);
  EXPECT_LE(s.peak_bytes, budget);
  EXPECT_GT(s.peak_bytes, budget / 2);
  // Demotion moves forwards from keeps to declined, never adds or loses one.
  EXPECT_EQ(s.keeps + s.declined, keeps + declines + shares);
  EXPECT_GT(s.declined, declines);
  EXPECT_EQ(s.replays, replays);
  EXPECT_EQ(s.misses, 0u);
  EXPECT_EQ(s.released_unused, 0u);
  EXPECT_EQ(s.records, uint64_t(workers * left));
  EXPECT_EQ(s.keeps + s.declined, s.replays + declined_takes + s.released_unused + LiveRefs(reg));

  // Before destroy only demotions released anything: the old payloads, and the stand-ins
  // made in vain when a demote failed.
  uint64_t demoted = 0;
  for (auto &w : state) {
    for (int i = 0; i < iterations; ++i) {
      const Payload &p = w.payloads[size_t(i)];
      demoted += uint64_t(p.releases.load());
      if (p.releases.load() > (demotable(i) && !demote_fails(i) ? 1 : 0)) failures++;
    }
  }
  EXPECT_GT(demoted, 0u);
  stash_registry_destroy(reg);
  // Every reference ends up taken or released exactly once: the registry's own (one per
  // stored payload, one per stand-in made) and one per retain.
  uint64_t bad = 0;
  for (auto &w : state) {
    for (int i = 0; i < iterations; ++i) {
      const Payload &p = w.payloads[size_t(i)], &sp = w.stand_ins[size_t(i)];
      const int made = demotable(i) && !demote_fails(i) ? p.demotes.load() : 0;
      if (p.releases.load() + p.takes.load() != 1 + p.retains.load() || p.releases.load() > 1) bad++;
      if (sp.releases.load() + sp.takes.load() != made + sp.retains.load()) bad++;
      if (!demotable(i) && p.demotes.load() != 0) bad++;
    }
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(failures, 0u);
}

}  // namespace
