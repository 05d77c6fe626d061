// test_registry_model.cpp: random runs of the C stash registry against a std::map
// reference model (registry_model.h), with and without demotable entries and anchor releases: after every
// step the statuses, outputs, callbacks, records and counters match the model, and every
// forward is replayed, taken, released or still held.

#include "registry_model.h"

namespace {

TEST(StashRegistry, RandomOperationsMatchAReferenceModel) {
  ModelRun run(20240607);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
  }
  // The run must have exercised every path.
  const ModelRun::Coverage &c = run.coverage();
  EXPECT_GT(c.keeps, 800);
  EXPECT_GT(c.declines, 350);
  EXPECT_GT(c.duplicates, 120);
  EXPECT_GT(c.over_budget, 450);
  EXPECT_GT(c.shares, 250);
  EXPECT_GT(c.shares_without_retain, 70);
  EXPECT_GT(c.shares_missing, 140);
  EXPECT_GT(c.replays, 300);
  EXPECT_GT(run.declined_takes(), 90u);
  EXPECT_GT(c.shared_takes, 50);
  EXPECT_GT(c.wrong_id_misses, 90);
  EXPECT_GT(c.misses, 600);
  EXPECT_GT(c.partial_release_ids, 45);
  EXPECT_GT(c.last_release_ids, 250);
  EXPECT_GT(c.missing_release_ids, 140);
  EXPECT_GT(c.shared_records_released_if, 60);
  EXPECT_GT(c.budget_changes, 380);

  // Destroy releases what the model still holds.
  run.CheckDestroy();
}

TEST(StashRegistry, RandomOperationsWithAnchorReleasesMatchAReferenceModel) {
  ModelRun run(20261205, true, true);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
  }
  const ModelRun::Coverage &c = run.coverage();
  EXPECT_GT(c.anchor_releases, 100);
  EXPECT_GT(c.shared_records_released_if, 90);
  EXPECT_GT(c.stand_ins_dropped, 220);
  run.CheckDestroy();
}

TEST(StashRegistryDemotion, RandomOperationsWithDemotableEntriesMatchAReferenceModel) {
  ModelRun run(20240611, true);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
  }
  // Demotion happened often, in every form.
  const ModelRun::Coverage &c = run.coverage();
  EXPECT_GT(c.keeps, 1400);
  EXPECT_GT(c.replays, 400);
  EXPECT_GT(c.over_budget, 400);
  EXPECT_GT(c.demoting_keeps, 230);
  EXPECT_GT(c.demoted_records, 380);
  EXPECT_GT(c.multi_demotions, 80);
  EXPECT_GT(c.shared_demoted, 40);
  EXPECT_GT(c.no_room, 120);
  EXPECT_GT(c.failed_demotes, 40);
  EXPECT_GT(c.stand_ins_made_in_vain, 10);
  EXPECT_GT(c.stand_in_takes, 90);
  EXPECT_GT(c.stand_ins_dropped, 220);
  // Destroy releases what the model still holds, stand-ins included.
  run.CheckDestroy();
}

TEST(StashRegistryDemotion, EveryForwardIsReplayedTakenReleasedOrStillHeldThroughoutARandomRunWithDemotion) {
  ModelRun run(11, true);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
    stash_stats s = Stats(run.registry());
    ASSERT_EQ(s.keeps + s.declined,
              s.replays + run.declined_takes() + s.released_unused + LiveRefs(run.registry()));
  }
  const ModelRun::Coverage &c = run.coverage();
  EXPECT_GT(c.demoted_records, 330);
  EXPECT_GT(c.shared_demoted, 30);
  EXPECT_GT(c.stand_in_takes, 80);
  EXPECT_GT(Stats(run.registry()).declined, 1000u);
}

TEST(StashRegistry, EveryForwardIsReplayedTakenReleasedOrStillHeldThroughoutARandomRun) {
  ModelRun run(7);
  for (int step = 0; step < 10000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(run.Step());
    // From the registry alone (and the declined takes, which no counter records).
    stash_stats s = Stats(run.registry());
    ASSERT_EQ(s.keeps + s.declined,
              s.replays + run.declined_takes() + s.released_unused + LiveRefs(run.registry()));
  }
  EXPECT_GT(Stats(run.registry()).declined, 300u);
  EXPECT_GT(run.declined_takes(), 50u);
}

}  // namespace
