// registry_model.h: a reference model of the C stash registry for random runs
// (test_registry_model.cpp): ModelRun applies random operations to a registry and checks
// each against a std::map model; its operations are in registry_model.cpp.
#pragma once

#include "registry_test_support.h"

// --- a random run against a reference model --------------------------------------

// Each payload of the random runs counts its references: one made by the test
// (handed to the registry by a keep) or by a demote callback (a stand-in, handed to
// the registry), one per retain; each release, and each drop by the test of a
// reference it took or failed to store, removes one. The registry's callbacks are
// also logged, to be checked after every step.
class ModelRun;
struct ModelPayload {
  int index;
  int refs;
  std::vector<int> *retained;
  std::vector<int> *released;
  ModelRun *run = nullptr;   // makes the stand-ins of demotable entries
  bool fail_demote = false;  // the demote callback returns NULL (set for one keep)
};
void *ModelDemote(void *payload);
inline void ModelRetain(void *payload) {
  auto *p = static_cast<ModelPayload *>(payload);
  p->refs++;
  p->retained->push_back(p->index);
}
inline void ModelRelease(void *payload) {
  auto *p = static_cast<ModelPayload *>(payload);
  p->refs--;
  p->released->push_back(p->index);
}

// Random operations on a registry, each checked against a std::map model: its
// status and outputs, the callbacks it made, the records held and every counter.
class ModelRun {
 public:
  // How often each path was taken, to check that the run exercised them all.
  struct Coverage {
    int keeps = 0, declines = 0, duplicates = 0, over_budget = 0;
    int shares = 0, shares_without_retain = 0, shares_missing = 0;
    int replays = 0, shared_takes = 0, wrong_id_misses = 0, misses = 0;
    int partial_release_ids = 0, last_release_ids = 0, missing_release_ids = 0;
    int shared_records_released_if = 0, anchor_releases = 0, budget_changes = 0;
    // With demotion: keeps that demoted, records demoted (shared ones among them), keeps
    // refused as demoting everything possible could not make room, keeps refused as a
    // demote callback failed (stand-ins made in vain), takes and drops of stand-ins.
    int demoting_keeps = 0, demoted_records = 0, shared_demoted = 0, multi_demotions = 0;
    int no_room = 0, failed_demotes = 0, stand_ins_made_in_vain = 0;
    int stand_in_takes = 0, stand_ins_dropped = 0;
  };

  // With `demotion`, two thirds of the entries are demotable; without it none is (their demote
  // is NULL) and no random number is drawn for it.
  // With `anchor_releases`, half the release_if steps are stash_release_anchor steps instead.
  explicit ModelRun(uint64_t seed, bool demotion = false, bool anchor_releases = false)
      : rng_(seed), demotion_(demotion), anchor_releases_(anchor_releases) {
    EXPECT_EQ(stash_registry_create(&reg_), STASH_OK);
  }
  ~ModelRun() { Destroy(); }
  ModelRun(const ModelRun &) = delete;
  ModelRun &operator=(const ModelRun &) = delete;

  stash_registry *registry() const { return reg_; }
  const Coverage &coverage() const { return coverage_; }
  uint64_t declined_takes() const { return declined_takes_; }

  void Step();

  // The demote callback of payload `p`: a new payload, the stand-in, with one reference
  // for the registry (or NULL when the test made it fail). Runs under the registry's lock.
  void *StandInFor(ModelPayload &p) {
    demote_calls_.push_back(p.index);
    if (p.fail_demote) return nullptr;
    payloads_.push_back(ModelPayload{int(payloads_.size()), 1, &retained_, &released_, this});
    made_.emplace_back(p.index, payloads_.back().index);
    return &payloads_.back();
  }

  // Destroys the registry, which must release exactly what the model holds; every
  // reference ever made is then gone.
  void CheckDestroy() {
    std::multiset<int> want;
    for (auto &kv : model_) want.insert(kv.second.payload);
    released_.clear();
    Destroy();
    EXPECT_EQ(std::multiset<int>(released_.begin(), released_.end()), want);
    for (auto &p : payloads_) ASSERT_EQ(p.refs, 0) << "payload " << p.index;
  }

 private:
  struct Rec {
    int payload;
    uint64_t bytes;
    uint64_t id;
    uint32_t refs;
    bool declined;
    bool retain;
    bool demotable;
    bool stand_in;  // demoted: payload is the stand-in
  };

  void Destroy() {
    stash_registry_destroy(reg_);
    reg_ = nullptr;
  }
  int Pick(int n) { return int(rng_() % uint64_t(n)); }
  uint64_t RandomId() { return 1 + uint64_t(Pick(int(last_id_) + 2)); }
  // A small key space so that duplicates, hits and shared anchors are common.
  stash_key RandomKey() {
    std::vector<int64_t> shape(size_t(Pick(3)));
    for (auto &d : shape) d = 1 + Pick(2);
    return WithJunk(MakeKey(0x1000 + 0x40 * uintptr_t(Pick(4)), Pick(2), shape, Pick(2)));
  }
  stash_key WithJunk(stash_key k) {
    for (int i = k.rank; i < STASH_MAX_RANK; ++i) k.shape[i] = int64_t(rng_());
    return k;
  }
  stash_key KeyOf(const CanonKey &c) {
    stash_key k = MakeKey(std::get<0>(c), std::get<1>(c), std::get<3>(c), std::get<4>(c));
    return WithJunk(k);
  }
  std::map<CanonKey, Rec>::iterator RandomHeld() {
    return std::next(model_.begin(), Pick(int(model_.size())));
  }
  std::map<CanonKey, Rec>::iterator FindId(uint64_t id) {
    for (auto it = model_.begin(); it != model_.end(); ++it) {
      if (it->second.id == id) return it;
    }
    return model_.end();
  }
  // Unlinks a record from the model, as the registry does with its last reference.
  void Unlink(std::map<CanonKey, Rec>::iterator it) {
    expect_.records--;
    expect_.bytes -= it->second.bytes;
    model_.erase(it);
  }
  void StoreOp(bool decline);
  void ShareOp();
  void TakeOp();
  void ReleaseIdOp();
  void ReleaseIfOp();
  void ReleaseAnchorOp();
  void CheckAfterStep();

  std::mt19937_64 rng_;
  std::deque<ModelPayload> payloads_;
  std::vector<int> retained_, released_;
  std::vector<int> demote_calls_;              // this step: the payloads demote was called for
  std::vector<std::pair<int, int>> made_;      // this step: (payload, its stand-in)
  std::multiset<int> want_retained_, want_released_;
  std::map<CanonKey, Rec> model_;
  stash_stats expect_ = FreshStats();
  uint64_t last_id_ = 0;
  uint64_t declined_takes_ = 0;
  Coverage coverage_;
  bool demotion_ = false;
  bool anchor_releases_ = false;
  stash_registry *reg_ = nullptr;
};
