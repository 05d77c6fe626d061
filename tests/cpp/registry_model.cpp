// registry_model.cpp: the operations of ModelRun (registry_model.h), each applied to the
// registry and to the model, and the checks made after every step.

#include "registry_model.h"

void *ModelDemote(void *payload) {
  auto *p = static_cast<ModelPayload *>(payload);
  return p->run->StandInFor(*p);
}

void ModelRun::Step() {
  retained_.clear();
  released_.clear();
  demote_calls_.clear();
  made_.clear();
  want_retained_.clear();
  want_released_.clear();
  int op = Pick(1000);
  if (op < 300) {
    StoreOp(false);
  } else if (op < 380) {
    StoreOp(true);
  } else if (op < 480) {
    ShareOp();
  } else if (op < 700) {
    TakeOp();
  } else if (op < 800) {
    ReleaseIdOp();
  } else if (op < 840) {  // (the coin is drawn only with anchor_releases: other runs' draws stay as they were)
    if (anchor_releases_ && Pick(2) == 1) {
      ReleaseAnchorOp();
    } else {
      ReleaseIfOp();
    }
  } else if (op < 920) {  // a budget: none, some room above what is held, or under it
    int kind = Pick(4);
    uint64_t max = kind == 0   ? UINT64_MAX
                   : kind == 3 ? expect_.bytes / 2
                               : expect_.bytes + uint64_t(Pick(3000));
    ASSERT_EQ(stash_set_max_bytes(reg_, max), STASH_OK);
    expect_.max_bytes = max;
    coverage_.budget_changes++;
  } else if (op < 990) {
    ASSERT_EQ(stash_reset_peak(reg_), STASH_OK);
    expect_.peak_bytes = expect_.bytes;
  } else {
    size_t released = 99;
    ASSERT_EQ(stash_clear(reg_, &released), STASH_OK);
    ASSERT_EQ(released, model_.size());
    for (auto &kv : model_) {
      want_released_.insert(kv.second.payload);
      expect_.released_unused += kv.second.refs;
    }
    model_.clear();
    expect_.records = expect_.bytes = 0;
  }
  if (::testing::Test::HasFatalFailure()) return;
  CheckAfterStep();
}

void ModelRun::StoreOp(bool decline) {
  stash_key k = RandomKey();
  payloads_.push_back(ModelPayload{int(payloads_.size()), 1, &retained_, &released_, this});
  ModelPayload &p = payloads_.back();
  uint64_t bytes = uint64_t(Pick(1000));
  bool retain = Pick(4) != 0;
  bool demotable = demotion_ && Pick(3) != 0;
  stash_entry e{&p, bytes, retain ? ModelRetain : nullptr, ModelRelease, demotable ? ModelDemote : nullptr};

  // A keep over the budget demotes the oldest kept demotable records (by id), as many as
  // it takes to make room, or none at all if they all could not. The sums stay far below
  // 2^64 here: the overflow is pinned by its own test.
  const bool duplicate = model_.count(Canon(k)) != 0;
  using It = std::map<CanonKey, Rec>::iterator;
  std::map<uint64_t, It> candidates;  // by id
  for (auto it = model_.begin(); it != model_.end(); ++it) {
    if (!it->second.declined && it->second.demotable) candidates.emplace(it->second.id, it);
  }
  std::vector<It> victims;
  bool room = true, needs_room = false;
  if (!decline && !duplicate && expect_.bytes + bytes > expect_.max_bytes) {
    needs_room = true;
    room = false;
    if (bytes <= expect_.max_bytes) {
      const uint64_t need = expect_.bytes + bytes - expect_.max_bytes;
      uint64_t freed = 0;
      for (auto &kv : candidates) {
        if (freed >= need) break;
        victims.push_back(kv.second);
        freed += kv.second->second.bytes;
      }
      room = freed >= need;
    }
  }
  // Now and then one victim cannot be demoted (out of memory): the keep fails as a whole.
  ModelPayload *failing = nullptr;
  if (room && !victims.empty() && Pick(6) == 0) {
    failing = &payloads_[size_t(victims[size_t(Pick(int(victims.size())))]->second.payload)];
    failing->fail_demote = true;
  }
  uint64_t id = 0;
  stash_status st = decline ? stash_decline(reg_, &k, e, &id) : stash_keep(reg_, &k, e, &id);
  if (failing != nullptr) failing->fail_demote = false;

  stash_status want = duplicate ? STASH_ERR_DUPLICATE : !room || failing ? STASH_ERR_BUDGET : STASH_OK;
  ASSERT_EQ(st, want);
  // Each demote callback runs at most once, and only for a record that could be demoted.
  std::set<int> calls(demote_calls_.begin(), demote_calls_.end());
  ASSERT_EQ(calls.size(), demote_calls_.size()) << "a record was asked for two stand-ins";
  std::set<int> candidate_payloads;
  for (auto &kv : candidates) candidate_payloads.insert(kv.second->second.payload);
  for (int c : calls) ASSERT_EQ(candidate_payloads.count(c), 1u) << "demote called for payload " << c;
  ASSERT_EQ(made_.size() + (failing != nullptr && calls.count(failing->index) ? 1 : 0), calls.size());

  if (st != STASH_OK) {
    coverage_.duplicates += st == STASH_ERR_DUPLICATE;
    coverage_.over_budget += st == STASH_ERR_BUDGET;
    if (failing != nullptr) {
      ASSERT_EQ(calls.count(failing->index), 1u) << "the failing demote was never called";
      coverage_.failed_demotes++;
    } else if (needs_room && bytes <= expect_.max_bytes && !candidates.empty()) {
      coverage_.no_room++;
    }
    // Nothing changed; the stand-ins made in vain are released (exactly once, checked
    // after the step with every other callback).
    for (auto &m : made_) want_released_.insert(m.second);
    coverage_.stand_ins_made_in_vain += int(made_.size());
    p.refs--;  // the caller still owned it, and drops it
    return;
  }
  // Demoted: exactly the victims, each now holding its stand-in; the registry released
  // its reference to the old payload, and the record's forwards count as declined.
  std::set<int> victim_payloads;
  for (auto &v : victims) victim_payloads.insert(v->second.payload);
  ASSERT_EQ(calls, victim_payloads);
  for (auto &v : victims) {
    Rec &rec = v->second;
    auto made = std::find_if(made_.begin(), made_.end(),
                             [&](const std::pair<int, int> &m) { return m.first == rec.payload; });
    ASSERT_NE(made, made_.end());
    want_released_.insert(rec.payload);
    expect_.bytes -= rec.bytes;
    expect_.keeps -= rec.refs;
    expect_.declined += rec.refs;
    rec.payload = made->second;
    rec.bytes = 0;
    rec.declined = true;
    rec.stand_in = true;
    coverage_.demoted_records++;
    coverage_.shared_demoted += rec.refs > 1;
  }
  coverage_.demoting_keeps += !victims.empty();
  coverage_.multi_demotions += victims.size() > 1;

  ASSERT_GT(id, last_id_);
  last_id_ = id;
  uint64_t held = decline ? 0 : bytes;
  model_[Canon(k)] = Rec{p.index, held, id, 1, decline, retain, demotable, false};
  expect_.records++;
  expect_.bytes += held;
  if (expect_.bytes > expect_.peak_bytes) expect_.peak_bytes = expect_.bytes;
  (decline ? expect_.declined : expect_.keeps)++;
  (decline ? coverage_.declines : coverage_.keeps)++;
}

void ModelRun::ShareOp() {
  stash_key k;
  uint64_t id;
  if (!model_.empty() && Pick(4) != 0) {  // mostly a record known to be held
    auto it = RandomHeld();
    k = KeyOf(it->first);
    id = it->second.id;
  } else {
    k = RandomKey();
    id = RandomId();
  }
  stash_status st = stash_share(reg_, &k, id);
  auto it = model_.find(Canon(k));
  if (it == model_.end() || it->second.id != id) {
    ASSERT_EQ(st, STASH_ERR_MISSING);
    coverage_.shares_missing++;
  } else if (!it->second.retain) {
    ASSERT_EQ(st, STASH_ERR_ARGUMENT);
    coverage_.shares_without_retain++;
  } else {
    ASSERT_EQ(st, STASH_OK);
    it->second.refs++;
    (it->second.declined ? expect_.declined : expect_.keeps)++;
    coverage_.shares++;
  }
}

void ModelRun::TakeOp() {
  stash_key k = RandomKey();
  uint64_t id = 0;
  if (!model_.empty() && Pick(2) == 0) {  // half of the time a key known to be held
    auto it = RandomHeld();
    k = KeyOf(it->first);
    int mode = Pick(5);
    if (mode == 3) id = it->second.id;
    if (mode == 4) id = it->second.id + 1 + uint64_t(Pick(3));  // another record's, or none
  } else if (Pick(4) == 0) {
    id = RandomId();
  }
  stash_entry out{};
  uint64_t got_id = 0;
  int got_declined = -1;
  stash_status st = stash_take(reg_, &k, id, &out, &got_id, &got_declined);

  auto it = model_.find(Canon(k));
  if (it == model_.end() || (id != 0 && it->second.id != id)) {
    ASSERT_EQ(st, STASH_ERR_MISSING);
    expect_.misses++;
    coverage_.misses++;
    coverage_.wrong_id_misses += it != model_.end();
    return;
  }
  ASSERT_EQ(st, STASH_OK);
  Rec &rec = it->second;
  ModelPayload &p = payloads_[size_t(rec.payload)];
  ASSERT_EQ(out.payload, &p);
  ASSERT_EQ(out.bytes, rec.bytes);
  ASSERT_EQ(out.retain, rec.retain ? &ModelRetain : nullptr);
  ASSERT_EQ(out.release, &ModelRelease);
  ASSERT_EQ(out.demote, rec.demotable ? &ModelDemote : nullptr);
  ASSERT_EQ(got_id, rec.id);
  ASSERT_EQ(got_declined != 0, rec.declined);
  coverage_.stand_in_takes += rec.stand_in;
  if (rec.declined) {
    declined_takes_++;
  } else {
    expect_.replays++;
    coverage_.replays++;
  }
  if (rec.refs > 1) {  // others still share it: the taker gets a retained reference
    want_retained_.insert(rec.payload);
    rec.refs--;
    coverage_.shared_takes++;
  } else {
    Unlink(it);
  }
  p.refs--;  // the taker is done with its reference
}

void ModelRun::ReleaseIdOp() {
  uint64_t id = !model_.empty() && Pick(4) != 0 ? RandomHeld()->second.id : RandomId();
  stash_status st = stash_release_id(reg_, id);
  auto it = FindId(id);
  if (it == model_.end()) {
    ASSERT_EQ(st, STASH_ERR_MISSING);
    coverage_.missing_release_ids++;
    return;
  }
  ASSERT_EQ(st, STASH_OK);
  expect_.released_unused++;
  if (it->second.refs > 1) {
    it->second.refs--;
    coverage_.partial_release_ids++;
  } else {
    want_released_.insert(it->second.payload);
    coverage_.stand_ins_dropped += it->second.stand_in;
    Unlink(it);
    coverage_.last_release_ids++;
  }
}

void ModelRun::ReleaseIfOp() {
  // Select by version and slot, or the shared records, or the declined ones.
  struct Select {
    int by;
    int64_t version, slot;
    bool operator()(const CanonKey &k, uint32_t refs, bool declined) const {
      if (by == 0) return std::get<1>(k) == version && std::get<4>(k) == slot;
      return by == 1 ? refs > 1 : declined;
    }
  } select{Pick(3), Pick(2), Pick(2)};
  auto pred = [](const stash_record *r, void *c) {
    return int((*static_cast<Select *>(c))(Canon(*r->key), r->refs, r->declined != 0));
  };
  size_t released = 99;
  ASSERT_EQ(stash_release_if(reg_, pred, &select, &released), STASH_OK);

  size_t want = 0;
  for (auto it = model_.begin(); it != model_.end();) {
    auto next = std::next(it);
    if (select(it->first, it->second.refs, it->second.declined)) {
      want++;
      want_released_.insert(it->second.payload);
      expect_.released_unused += it->second.refs;
      coverage_.shared_records_released_if += it->second.refs > 1;
      coverage_.stand_ins_dropped += it->second.stand_in;
      Unlink(it);
    }
    it = next;
  }
  ASSERT_EQ(released, want);
}

void ModelRun::ReleaseAnchorOp() {
  // One of RandomKey's anchors: all its records, or those of one slot.
  const uintptr_t anchor = RandomKey().anchor;
  const int64_t slot = Pick(3) - 1;  // -1: no predicate
  auto in_slot = [](const stash_record *r, void *c) { return int(r->key->slot == *static_cast<int64_t *>(c)); };
  size_t released = 99;
  ASSERT_EQ(stash_release_anchor(reg_, anchor, slot < 0 ? nullptr : +in_slot, (void *)&slot, &released), STASH_OK);

  size_t want = 0;
  for (auto it = model_.begin(); it != model_.end();) {
    auto next = std::next(it);
    if (std::get<0>(it->first) == anchor && (slot < 0 || std::get<4>(it->first) == slot)) {
      want++;
      want_released_.insert(it->second.payload);
      expect_.released_unused += it->second.refs;
      coverage_.stand_ins_dropped += it->second.stand_in;
      Unlink(it);
    }
    it = next;
  }
  coverage_.anchor_releases += want > 0;
  ASSERT_EQ(released, want);
}

void ModelRun::CheckAfterStep() {
  ASSERT_EQ(std::multiset<int>(released_.begin(), released_.end()), want_released_);
  ASSERT_EQ(std::multiset<int>(retained_.begin(), retained_.end()), want_retained_);
  std::map<CanonKey, Held> want;
  for (auto &kv : model_) {
    const Rec &r = kv.second;
    want[kv.first] = Held{&payloads_[size_t(r.payload)], r.bytes, r.id, r.refs, r.declined};
  }
  ASSERT_EQ(Contents(reg_), want);
  ASSERT_EQ(Stats(reg_), expect_);
  // The registry owns exactly one reference per record, however many forwards share it,
  // and a payload whose record went is no longer referenced at all.
  for (auto &kv : model_) ASSERT_EQ(payloads_[size_t(kv.second.payload)].refs, 1);
  for (int index : want_released_) ASSERT_EQ(payloads_[size_t(index)].refs, 0);
}
