// test_frames.cpp: the frames of torch_ops/frames.h, as C++ sees them: inside a frame that
// keeps, aten::scaled_dot_product_attention is attnstash::sdpa_fwd_keep at the frame's slots;
// outside every frame, and in a frame that does not keep, it is torch's own; what a frame
// refuses it says (Failure), and a frame is its thread's alone.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <thread>

#include "frames.h"
#include "keep_replay.h"
#include "records.h"

namespace {

using attnstash::frames::Failure;
using attnstash::frames::Frame;
using attnstash::frames::RandomCheck;

using SdpaOpSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                             const std::optional<at::Tensor>&, double, bool, std::optional<double>, bool);

int64_t Stat(const char* name) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnstash::stash_stats", "")
                       .typed<c10::Dict<std::string, int64_t>()>();
  return op.call().at(name);
}

at::Tensor Replay(const at::Tensor& q, const at::Tensor& anchor, int64_t slot) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("attnstash::sdpa_replay", "").typed<SdpaOpSig>();
  return op.call(q, q, q, anchor, slot, std::nullopt, 0.0, false, std::nullopt, false);
}

at::Tensor Sdpa(const at::Tensor& q, double dropout_p = 0.0) {
  return at::scaled_dot_product_attention(q, q, q, std::nullopt, dropout_p);
}

class Frames : public ::testing::Test {
 protected:
  void SetUp() override {
    attnstash::records::clear();
    keeps_before = Stat("keeps");
  }
  int64_t Keeps() const { return Stat("keeps") - keeps_before; }  // (the counters run for the process)
  int64_t keeps_before = 0;
  void TearDown() override {
    while (attnstash::frames::depth() > 0) attnstash::frames::close();
    EXPECT_EQ(attnstash::records::clear(), 0) << "a test left records held";
  }
  // A reentrant first forward's frame: grad off, on an anchor that requires grad.
  static Frame Keeping(const at::Tensor& anchor, int64_t base) {
    Frame frame;
    frame.anchor = anchor;
    frame.slot_base = base;
    frame.keep = true;
    frame.collect = true;
    return frame;
  }
  at::Tensor q = at::randn({1, 2, 8, 16});
  at::Tensor anchor = at::randn({1, 8, 32}).requires_grad_(true);
};

TEST_F(Frames, OutsideEveryFrameAttentionIsTorchsOwnAndKeepsNothing) {
  at::NoGradGuard no_grad;
  at::Tensor out = Sdpa(q);
  EXPECT_TRUE(at::equal(out, std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, q, q))));
  EXPECT_EQ(Keeps(), 0);
  EXPECT_EQ(Stat("records"), 0);
}

TEST_F(Frames, InsideAKeepingFrameEachCallKeepsAtTheNextSlotAndTheReplayTakesIt) {
  at::Tensor plain = Sdpa(q);
  at::Tensor first, second;
  {
    at::NoGradGuard no_grad;
    attnstash::frames::open(Keeping(anchor, 1 << 16));
    first = Sdpa(q);
    second = Sdpa(q * 2);
  }
  Frame closed = attnstash::frames::close();
  EXPECT_EQ(closed.calls, 2);
  EXPECT_EQ(closed.failure, Failure::none);
  ASSERT_EQ(closed.ids.size(), 2u);
  EXPECT_EQ(Keeps(), 2);
  EXPECT_TRUE(at::equal(first, plain));
  EXPECT_NE(attnstash::records::record_id(anchor, (1 << 16) + 1), 0);
  EXPECT_TRUE(at::equal(Replay(q * 2, anchor, (1 << 16) + 1), second));
  EXPECT_TRUE(at::equal(Replay(q, anchor, 1 << 16), first));
  EXPECT_EQ(Stat("records"), 0);
}

TEST_F(Frames, AFrameThatDoesNotKeepAndTheInnermostFrameDecide) {
  at::NoGradGuard no_grad;
  attnstash::frames::open(Keeping(anchor, 1 << 16));
  Frame quiet = Keeping(anchor, 2 << 16);
  quiet.keep = false;
  attnstash::frames::open(quiet);
  Sdpa(q);
  EXPECT_EQ(attnstash::frames::close().calls, 0);
  EXPECT_EQ(Keeps(), 0);
  Sdpa(q);  // the outer frame's again
  EXPECT_EQ(attnstash::frames::close().calls, 1);
  EXPECT_EQ(Keeps(), 1);
  attnstash::records::clear();
}

TEST_F(Frames, ARecomputePastItsLimitAndACallTheOpRefusesFailAndSayWhy) {
  at::NoGradGuard no_grad;
  Frame limited = Keeping(anchor, 1 << 16);
  limited.limit = 1;
  attnstash::frames::open(limited);
  Sdpa(q);
  EXPECT_THROW(Sdpa(q), c10::Error);
  Frame closed = attnstash::frames::close();
  EXPECT_EQ(closed.failure, Failure::limit);
  EXPECT_EQ(closed.calls, 2);
  attnstash::records::clear();

  attnstash::frames::open(Keeping(anchor, 1 << 16));
  EXPECT_THROW(Sdpa(q, 0.25), c10::Error);  // attention dropout cannot be kept
  closed = attnstash::frames::close();
  EXPECT_EQ(closed.failure, Failure::op);
  EXPECT_EQ(closed.message.rfind("attnstash", 0), 0u) << closed.message;
  EXPECT_EQ(closed.dropout_p, 0.25);
  EXPECT_EQ(Stat("records"), 0);
}

TEST_F(Frames, AForwardMayCallAttentionAsOftenAsItsRangeHasSlotsAndNoMore) {
  const int64_t base = attnstash::records::new_slot_base();
  const int64_t next = attnstash::records::new_slot_base();
  EXPECT_GE(next - base, STASH_SLOTS_PER_RANGE);
  at::NoGradGuard no_grad;
  Frame frame = Keeping(anchor, base);
  frame.calls = STASH_SLOTS_PER_RANGE - 2;  // (as if it had made all but its last two calls)
  attnstash::frames::open(frame);
  Sdpa(q);
  Sdpa(q);
  EXPECT_NE(attnstash::records::record_id(anchor, base + STASH_SLOTS_PER_RANGE - 1), 0);  // its range's last slot
  EXPECT_THROW(Sdpa(q), c10::Error);  // the next call's slot would be the next range's first
  Frame closed = attnstash::frames::close();
  EXPECT_EQ(closed.failure, Failure::op);
  EXPECT_EQ(closed.message.rfind("attnstash", 0), 0u) << closed.message;
  EXPECT_NE(closed.message.find("STASH_SLOTS_PER_RANGE"), std::string::npos) << closed.message;
  EXPECT_EQ(attnstash::records::record_id(anchor, base + STASH_SLOTS_PER_RANGE), 0);
  EXPECT_EQ(attnstash::records::clear(), 2);
}

TEST_F(Frames, RandomNumbersDrawnBeforeACallAreNotedOrRefused) {
  at::NoGradGuard no_grad;
  Frame noting = Keeping(anchor, 1 << 16);
  noting.random = RandomCheck::note;
  noting.random_start = attnstash::frames::generator_state(q.device());
  attnstash::frames::open(noting);
  Sdpa(q);  // nothing drawn since the start: nothing noted
  at::randn({4});
  Sdpa(q);
  Frame closed = attnstash::frames::close();
  EXPECT_TRUE(closed.noted);
  EXPECT_FALSE(attnstash::records::noted_rng(anchor, 1 << 16).has_value());
  std::optional<at::Tensor> noted = attnstash::records::noted_rng(anchor, (1 << 16) + 1);
  ASSERT_TRUE(noted.has_value());
  EXPECT_TRUE(at::equal(*noted, attnstash::frames::generator_state(q.device())));
  attnstash::records::clear();

  Frame refusing = noting;
  refusing.random = RandomCheck::refuse;
  refusing.random_start = attnstash::frames::generator_state(q.device());
  attnstash::frames::open(refusing);
  at::randn({4});
  EXPECT_THROW(Sdpa(q), c10::Error);
  EXPECT_EQ(attnstash::frames::close().failure, Failure::random_state);
  EXPECT_EQ(Stat("records"), 0);
}

TEST_F(Frames, AFrameIsItsThreadsAlone) {
  at::NoGradGuard no_grad;
  attnstash::frames::open(Keeping(anchor, 1 << 16));
  size_t depth_there = 1;
  std::thread other([&] {
    at::NoGradGuard no_grad_there;
    depth_there = attnstash::frames::depth();
    Sdpa(q);
  });
  other.join();
  EXPECT_EQ(depth_there, 0u);
  EXPECT_EQ(attnstash::frames::close().calls, 0);
  EXPECT_EQ(Keeps(), 0);
}

}  // namespace

// A frame opened by its forward's phase keeps, and owns what it keeps, as frames.h says; closed
// as interrupted, it releases what it owns, on a token (by slot) and on a layer input (by id),
// and only that: a record an earlier forward shares stays held for it.
TEST_F(Frames, AFrameOpenedByItsPhaseKeepsAndOwnsWhatFramesHSays) {
  using attnstash::FramePhase;
  struct Case {
    FramePhase phase;
    int64_t limit;
    bool keep, owns;
  };
  for (const Case& c : {Case{FramePhase::recompute, -1, true, false}, Case{FramePhase::recompute, 0, false, false},
                        Case{FramePhase::recompute_without_grad, -1, false, false},
                        Case{FramePhase::reentrant_first, -1, true, true},
                        Case{FramePhase::reentrant_first_hooked, -1, true, true},
                        Case{FramePhase::non_reentrant_first, -1, true, false},
                        Case{FramePhase::unreachable, -1, false, false},
                        Case{FramePhase::outside_checkpoint, -1, false, false}}) {
    Frame frame;
    frame.anchor = anchor;
    frame.limit = c.limit;
    frame.random = RandomCheck::note;  // (dropped where the frame keeps nothing)
    EXPECT_EQ(attnstash::frames::open(frame, c.phase, anchor), c.keep) << static_cast<int>(c.phase);
    Frame closed = attnstash::frames::close();
    EXPECT_EQ(closed.keep, c.keep);
    EXPECT_EQ(closed.owns, c.owns) << static_cast<int>(c.phase);
    EXPECT_EQ(closed.random, c.keep ? RandomCheck::note : RandomCheck::none);
  }
}

TEST_F(Frames, AnInterruptedReentrantFirstForwardReleasesWhatItKeptAndNothingElse) {
  at::NoGradGuard no_grad;
  at::Tensor token = attnstash::records::new_token();
  for (const at::Tensor* on : {&token, &anchor}) {
    Frame frame;
    frame.anchor = *on;
    frame.slot_base = 1 << 16;
    attnstash::frames::open(frame, attnstash::FramePhase::reentrant_first, at::Tensor());
    Sdpa(q);
    Sdpa(q * 2);
    EXPECT_EQ(Stat("records"), 2);
    EXPECT_EQ(attnstash::frames::close(/*interrupted=*/true).kept, 2);
    EXPECT_EQ(Stat("records"), 0);
  }
  // An earlier forward on the same input, closed normally, shares its record with a later one
  // that repeats it: the later one, interrupted, releases its own share only.
  Frame frame;
  frame.anchor = anchor;
  frame.slot_base = 1 << 16;
  attnstash::frames::open(frame, attnstash::FramePhase::reentrant_first, at::Tensor());
  at::Tensor kept = Sdpa(q);
  attnstash::frames::close();
  attnstash::frames::open(frame, attnstash::FramePhase::reentrant_first, at::Tensor());
  Sdpa(q);
  attnstash::frames::close(/*interrupted=*/true);
  EXPECT_EQ(Stat("records"), 1);
  at::AutoGradMode grad(true);
  EXPECT_TRUE(at::equal(Replay(q, anchor, 1 << 16), kept));
  EXPECT_EQ(Stat("records"), 0);
}

namespace {

// The phase a stashed forward starts in (keep_replay.h, FramePhase), where C++ alone can set
// the state: grad mode, inference mode, outer_grad. (Backward passes and saved-tensor
// hooks: tests/python/test_sdpa_ops_phases.py.)
TEST(FramePhase, GradModeInferenceModeAndTheOuterGradModeDecideOutsideBackward) {
  using attnstash::FramePhase;
  using attnstash::frame_phase;
  {
    at::AutoGradMode grad(true);
    for (int outer : {-1, 0, 1}) EXPECT_EQ(frame_phase(outer), FramePhase::outside_checkpoint);
  }
  {
    at::AutoGradMode no_grad(false);
    EXPECT_EQ(frame_phase(-1), FramePhase::reentrant_first);
    EXPECT_EQ(frame_phase(1), FramePhase::reentrant_first);
    EXPECT_EQ(frame_phase(0), FramePhase::unreachable);
  }
  {
    c10::InferenceMode inference;
    for (int outer : {-1, 0, 1}) EXPECT_EQ(frame_phase(outer), FramePhase::unreachable);
  }
}

}  // namespace
