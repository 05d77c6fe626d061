// test_ops.cpp: pins the behaviour of the attnstash torch ops as C++ sees them,
// called through the dispatcher (no Python): their registration (CPU, Autograd and
// Autocast kernels), the phase rules of sdpa_fwd_keep as far as C++ reaches them (a
// reentrant first forward keeps: grad off, anchor requiring grad; an ordinary
// differentiable call keeps nothing), the keep -> replay round trip through the stash,
// and the stash's budget set from C++.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

// --- the ops, through the dispatcher -------------------------------------------

// The shared schema of sdpa_fwd_keep and sdpa_replay (torch_ops/schemas.cpp).
using SdpaOpSig = at::Tensor(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                             double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa);

c10::OperatorHandle Op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

c10::TypedOperatorHandle<SdpaOpSig> FwdKeepOp() {
  static auto op = Op("attnstash::sdpa_fwd_keep").typed<SdpaOpSig>();
  return op;
}
c10::TypedOperatorHandle<SdpaOpSig> ReplayOp() {
  static auto op = Op("attnstash::sdpa_replay").typed<SdpaOpSig>();
  return op;
}

// The stash's counters by name (csrc/stash_registry.h's STASH_STATS_FIELDS).
c10::Dict<std::string, int64_t> StashStats() {
  static auto op = Op("attnstash::stash_stats").typed<c10::Dict<std::string, int64_t>()>();
  return op.call();
}
int64_t StashClear() {
  static auto op = Op("attnstash::stash_clear").typed<int64_t()>();
  return op.call();
}

// One attention call's arguments.
struct Attn {
  at::Tensor query, key, value;
  bool is_causal = false;
  bool enable_gqa = false;
};

at::Tensor FwdKeep(const Attn& a, const at::Tensor& anchor, int64_t slot) {
  return FwdKeepOp().call(a.query, a.key, a.value, anchor, slot, std::nullopt, 0.0, a.is_causal, std::nullopt,
                          a.enable_gqa);
}
at::Tensor Replay(const Attn& a, const at::Tensor& anchor, int64_t slot) {
  return ReplayOp().call(a.query, a.key, a.value, anchor, slot, std::nullopt, 0.0, a.is_causal, std::nullopt,
                         a.enable_gqa);
}
at::Tensor PlainSdpa(const Attn& a) {
  return at::scaled_dot_product_attention(a.query, a.key, a.value, std::nullopt, 0.0, a.is_causal, std::nullopt,
                                          a.enable_gqa);
}

// float32 [batch, heads, seq, head_dim] query, key and value.
Attn MakeAttn(int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t seq, int64_t head_dim, bool is_causal,
              bool enable_gqa) {
  auto opts = at::TensorOptions().dtype(at::kFloat);
  return {at::randn({batch, q_heads, seq, head_dim}, opts), at::randn({batch, kv_heads, seq, head_dim}, opts),
          at::randn({batch, kv_heads, seq, head_dim}, opts), is_causal, enable_gqa};
}

// A decoder layer's input, as a reentrant checkpoint passes it: requires grad.
// (at:: factories ignore TensorOptions::requires_grad, hence requires_grad_.)
at::Tensor MakeAnchor() { return at::randn({2, 32, 256}, at::TensorOptions().dtype(at::kFloat)).requires_grad_(true); }

// --- the fixture ---------------------------------------------------------------

// Every test starts and must end with an empty stash. The stats counters are
// process-wide and cumulative, so tests compare against the counts at SetUp.
class AttnstashOps : public ::testing::Test {
 protected:
  void SetUp() override {
    at::manual_seed(0);
    StashClear();
    before_ = StashStats();
    ASSERT_EQ(before_.at("records"), 0);
  }
  void TearDown() override { EXPECT_EQ(StashClear(), 0) << "the test left kept attention outputs in the stash"; }

  // How much a counter has grown since SetUp (records/bytes: the value now).
  int64_t Delta(const char* name) const { return StashStats().at(name) - before_.at(name); }

  // Runs a first forward (grad off, anchor requires grad), checks that it kept its
  // output and that this output is bitwise F.sdpa's, then releases the kept entry.
  void ExpectFirstForwardKeepsExactlySdpa(const Attn& a) {
    at::Tensor anchor = MakeAnchor();
    at::Tensor kept, expected;
    {
      at::NoGradGuard no_grad;
      kept = FwdKeep(a, anchor, /*slot=*/3);
      expected = PlainSdpa(a);
    }
    EXPECT_EQ(Delta("keeps"), 1) << "the first forward kept nothing";
    EXPECT_EQ(Delta("records"), 1);
    ASSERT_EQ(kept.sizes(), expected.sizes());
    EXPECT_EQ(kept.scalar_type(), expected.scalar_type());
    EXPECT_TRUE(at::equal(kept, expected)) << "max |diff| = " << (kept - expected).abs().max().item<float>();
    EXPECT_EQ(StashClear(), 1);  // the one kept entry, so TearDown finds the stash empty
  }

  c10::Dict<std::string, int64_t> before_;
};

// --- registration --------------------------------------------------------------

TEST_F(AttnstashOps, OpsAreRegisteredWithCpuAndAutogradKernelsAndCallableFromCpp) {
  for (const char* name : {"attnstash::sdpa_fwd_keep", "attnstash::sdpa_replay"}) {
    SCOPED_TRACE(name);
    auto op = Op(name);
    EXPECT_EQ(op.schema().arguments().size(), 10u);
    EXPECT_EQ(op.schema().returns().size(), 1u);
    EXPECT_TRUE(op.hasKernelForDispatchKey(c10::DispatchKey::CPU));
    // Registered for the Autograd alias key, which the dispatch table resolves per backend.
    EXPECT_TRUE(op.hasComputedKernelForDispatchKey(c10::DispatchKey::AutogradCPU));
  }
  for (const char* name : {"attnstash::stash_stats", "attnstash::stash_stats_meanings", "attnstash::stash_clear",
                           "attnstash::stash_reset_peak", "attnstash::stash_set_max_bytes",
                           "attnstash::stash_held_by_slot", "attnstash::stash_record_id", "attnstash::stash_release",
                           "attnstash::stash_kept_backends", "attnstash::_record_move_out",
                           "attnstash::_record_move_in", "attnstash::_record_note_rng",
                           "attnstash::_record_noted_rng", "attnstash::_release_slots"}) {
    SCOPED_TRACE(name);
    EXPECT_NO_THROW(Op(name));
  }

  // Callable: the utilities answer, and the attention op runs.
  EXPECT_EQ(StashStats().size(), 10u);
  EXPECT_EQ(StashClear(), 0);
  Attn a = MakeAttn(1, 2, 2, 8, 16, /*is_causal=*/false, /*enable_gqa=*/false);
  at::Tensor out = FwdKeep(a, MakeAnchor(), /*slot=*/0);
  EXPECT_EQ(out.sizes(), a.query.sizes());
  EXPECT_EQ(Delta("keeps"), 0);
}

// --- the first forward -----------------------------------------------------------

TEST_F(AttnstashOps, FirstForwardOutputIsBitwiseSdpaForCausalFloat32) {
  Attn a = MakeAttn(2, 4, 4, 32, 64, /*is_causal=*/true, /*enable_gqa=*/false);
  ExpectFirstForwardKeepsExactlySdpa(a);
}

TEST_F(AttnstashOps, FirstForwardOutputIsBitwiseSdpaForGroupedKeyValueHeads) {
  Attn a = MakeAttn(2, /*q_heads=*/8, /*kv_heads=*/2, 32, 64, /*is_causal=*/true, /*enable_gqa=*/true);
  ExpectFirstForwardKeepsExactlySdpa(a);
}

// --- keep, then replay -------------------------------------------------------------

TEST_F(AttnstashOps, ReplayReturnsTheKeptOutputAndEmptiesTheStash) {
  Attn a = MakeAttn(2, 4, 4, 32, 64, /*is_causal=*/true, /*enable_gqa=*/false);
  at::Tensor anchor = MakeAnchor();
  at::Tensor kept, replayed;
  {
    at::NoGradGuard no_grad;
    kept = FwdKeep(a, anchor, /*slot=*/0);
  }
  ASSERT_EQ(Delta("records"), 1);
  {
    at::NoGradGuard no_grad;
    replayed = Replay(a, anchor, /*slot=*/0);
  }
  EXPECT_EQ(replayed.data_ptr(), kept.data_ptr()) << "the replay did not return the kept output";
  EXPECT_TRUE(at::equal(replayed, kept));
  EXPECT_EQ(Delta("records"), 0);
  EXPECT_EQ(Delta("bytes"), 0);
  EXPECT_EQ(Delta("keeps"), 1);
  EXPECT_EQ(Delta("replays"), 1);
  EXPECT_EQ(Delta("misses"), 0);
}

TEST_F(AttnstashOps, ReplayWithNothingKeptThrowsNoAttentionOutputIsKept) {
  Attn a = MakeAttn(1, 2, 2, 8, 16, /*is_causal=*/false, /*enable_gqa=*/false);
  at::Tensor anchor = MakeAnchor();
  at::NoGradGuard no_grad;
  try {
    Replay(a, anchor, /*slot=*/0);
    FAIL() << "sdpa_replay returned although nothing was kept";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("no attention output is kept"), std::string::npos) << message;
  }
  EXPECT_EQ(Delta("records"), 0);
  EXPECT_EQ(Delta("replays"), 0);
  EXPECT_EQ(Delta("misses"), 1);
}

// --- an ordinary call ----------------------------------------------------------------

TEST_F(AttnstashOps, WithGradModeOnKeepsNothingAndEqualsSdpa) {
  ASSERT_TRUE(at::GradMode::is_enabled());
  Attn a = MakeAttn(2, 4, 4, 32, 64, /*is_causal=*/true, /*enable_gqa=*/false);
  a.query.requires_grad_(true);
  at::Tensor anchor = MakeAnchor();
  at::Tensor out = FwdKeep(a, anchor, /*slot=*/0);
  at::Tensor expected = PlainSdpa(a);
  EXPECT_EQ(Delta("keeps"), 0);
  EXPECT_EQ(Delta("records"), 0);
  ASSERT_EQ(out.sizes(), expected.sizes());
  EXPECT_TRUE(at::equal(out, expected));
  EXPECT_TRUE(out.requires_grad()) << "an ordinary call must stay differentiable";
}

// --- autocast and the budget, from C++ --------------------------------------------

TEST_F(AttnstashOps, BothOpsHaveAutocastKernelsForCpuAndCuda) {
  for (const char* name : {"attnstash::sdpa_fwd_keep", "attnstash::sdpa_replay"}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(Op(name).hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU));
    EXPECT_TRUE(Op(name).hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA));
  }
}

TEST_F(AttnstashOps, UnderCpuAutocastTheKeptOutputIsInTheAutocastDtypeAndBitwiseSdpa) {
  Attn a = MakeAttn(2, 4, 4, 32, 64, /*is_causal=*/true, /*enable_gqa=*/false);
  at::Tensor anchor = MakeAnchor();
  at::Tensor kept, expected;
  {
    at::NoGradGuard no_grad;
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    kept = FwdKeep(a, anchor, /*slot=*/0);
    expected = PlainSdpa(a);  // F.sdpa under autocast: every input cast to bf16
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
  EXPECT_EQ(kept.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(kept, expected));
  EXPECT_EQ(Delta("keeps"), 1);
  EXPECT_EQ(StashClear(), 1);
}

TEST_F(AttnstashOps, ABudgetSetFromCppDeclinesWhatDoesNotFit) {
  static auto set_max_bytes = Op("attnstash::stash_set_max_bytes").typed<void(int64_t)>();
  Attn a = MakeAttn(1, 2, 2, 8, 16, /*is_causal=*/false, /*enable_gqa=*/false);
  at::Tensor anchor = MakeAnchor();
  set_max_bytes.call(0);
  EXPECT_EQ(StashStats().at("max_bytes"), 0);
  {
    at::NoGradGuard no_grad;
    at::Tensor out = FwdKeep(a, anchor, /*slot=*/0);
    EXPECT_TRUE(at::equal(out, PlainSdpa(a)));
    at::Tensor replayed = Replay(a, anchor, /*slot=*/0);  // a declined record: the forward runs now
    EXPECT_TRUE(at::equal(replayed, out));
  }
  set_max_bytes.call(-1);
  EXPECT_EQ(StashStats().at("max_bytes"), -1);
  EXPECT_EQ(Delta("declined"), 1);
  EXPECT_EQ(Delta("keeps"), 0);
  EXPECT_EQ(Delta("records"), 0);
}

}  // namespace
