// frames.cpp: the frames of stashed layers' forwards, and the kernel of
// aten::scaled_dot_product_attention that sends the calls made inside them to the ops
// (frames.h states the rule).
#include "frames.h"

#include "records.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/scaled_dot_product_attention_compositeimplicitautograd_dispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>

namespace attnstash {
namespace frames {
namespace {

// This thread's open frames, innermost last (a deque: a frame stays where it is while frames
// open and close inside it).
thread_local std::deque<Frame> open_frames;

thread_local int64_t compiled_frames = 0;

// Whether this thread runs the op a call was sent to (the op's own F.sdpa calls pass through).
thread_local bool inside_op = false;

// inside_op for as long as it lives.
struct InsideOp {
  InsideOp() { inside_op = true; }
  ~InsideOp() { inside_op = false; }
};
std::atomic<CompiledAttention> compiled_attention{nullptr};

// Attention calls torch's own kernel ran in a backward with grad on (frames.h, recomputed).
std::atomic<int64_t> recomputed_calls{0};

// A call torch.compile traces: functionalized, or a FakeTensor under its mode (a tensor subclass
// in eager, such as a jagged nested tensor, is not: the ops refuse it with their own message).
bool compile_traces(const at::Tensor& query) {
  const c10::DispatchKeySet keys = query.key_set();
  return keys.has(c10::DispatchKey::Functionalize) ||
         (keys.has(c10::DispatchKey::Python) && c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python));
}

// Torch's own kernel, the one a frame does not take the call from; a call in a backward with
// grad on counts as recomputed (frames.h).
at::Tensor torch_sdpa(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                      std::optional<double> scale, bool enable_gqa) {
  if (at::GradMode::is_enabled() && torch::autograd::get_current_graph_task_id() != -1 && !compile_traces(query))
    recomputed_calls.fetch_add(1, std::memory_order_relaxed);
  return at::compositeimplicitautograd::scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                                                     is_causal, scale, enable_gqa);
}

[[noreturn]] void fail(Frame& frame, Failure why, const std::string& message) {
  frame.failure = why;
  frame.message = message;
  TORCH_CHECK(false, message);
}

// Whether two generator states (generator_state's) are the same bytes: a comparison of memory,
// where at::equal would run a tensor iteration over the CPU generator's 5,056 bytes before each
// attention call of a first forward whose checkpoint cannot be seen (RandomCheck::note).
bool same_state(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.const_data_ptr(), b.const_data_ptr(), a.nbytes()) == 0;
}

// The state to note on the call's record (undefined: none), after checking it (RandomCheck).
at::Tensor check_random(Frame& frame, int64_t slot, const at::Device& device) {
  if (frame.random == RandomCheck::check) {
    std::optional<at::Tensor> want = records::noted_rng(frame.anchor, slot);
    if (want.has_value() && !same_state(generator_state(device), *want))
      fail(frame, Failure::random_state,
           "attnstash: a recompute draws other random numbers before its attention than its first forward did, "
           "so its query, key and value differ from the ones the kept output belongs to");
    return at::Tensor();
  }
  at::Tensor now = generator_state(device);
  if (same_state(now, frame.random_start)) return at::Tensor();
  if (frame.random == RandomCheck::refuse)
    fail(frame, Failure::random_state,
         "attnstash: a first forward draws random numbers before its attention, and its checkpoint does not "
         "restore the random state for the recompute (preserve_rng_state=False)");
  return now;
}

using KeepOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                          const std::optional<at::Tensor>&, double, bool, std::optional<double>, bool);

// aten::scaled_dot_product_attention on the keys frames.h names.
at::Tensor sdpa_entry(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                      std::optional<double> scale, bool enable_gqa) {
  if (inside_op) return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  if (compiled_frames > 0) {
    const CompiledAttention hook = compiled_attention.load();
    std::optional<at::Tensor> out;
    if (hook != nullptr) {
      InsideOp inside;
      out = hook(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
    }
    if (out.has_value()) return *out;
  }
  if (open_frames.empty()) return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  Frame& frame = open_frames.back();
  if (!frame.keep || compile_traces(query))
    return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  const int64_t index = frame.calls++;
  if (frame.limit >= 0 && index >= frame.limit)
    fail(frame, Failure::limit,
         "attnstash: a recompute calls attention more often than its first forward did (" +
             std::to_string(frame.limit) + " times)");
  if (index >= STASH_SLOTS_PER_RANGE)
    fail(frame, Failure::op,
         "attnstash: its forward calls attention more than " + std::to_string(STASH_SLOTS_PER_RANGE) +
             " times, the most one stashed layer's forward may make (csrc/stash_registry.h, "
             "STASH_SLOTS_PER_RANGE); stash smaller modules, each making fewer calls (layers= or filter_fn=)");
  const int64_t slot = frame.slot_base + index;
  const at::Tensor noted =
      frame.random == RandomCheck::none ? at::Tensor() : check_random(frame, slot, query.device());
  static const auto keep = c10::Dispatcher::singleton().findSchemaOrThrow("attnstash::sdpa_fwd_keep", "").typed<KeepOp>();
  at::Tensor out;
  try {
    InsideOp inside;
    out = keep.call(query, key, value, frame.anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  } catch (const c10::Error& e) {
    const char* message = e.what_without_backtrace();
    if (std::strncmp(message, "attnstash", 9) == 0) {
      frame.failure = Failure::op;
      frame.message = message;
      frame.dropout_p = dropout_p;
    }
    throw;
  }
  ++frame.kept;
  if (frame.collect || frame.owns_by_id || noted.defined()) {
    const int64_t id = records::record_id(frame.anchor, slot);
    if (id != 0 && (frame.collect || frame.owns_by_id)) frame.ids.push_back(id);
    if (id != 0 && noted.defined()) frame.noted = records::note_rng(id, noted) || frame.noted;
  }
  return out;
}

}  // namespace

at::Tensor generator_state(const at::Device& device) {
  at::Generator generator =
      device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    state = generator.get_state();
  }
  // (same_state compares the bytes: torch documents the state as a CPU byte tensor.)
  TORCH_CHECK(state.is_cpu() && state.scalar_type() == at::kByte && state.is_contiguous(),
              "attnstash: the random state of ", device, " is expected to be a contiguous CPU byte tensor, as "
              "torch.get_rng_state() documents, but this torch release gives a ", state.scalar_type(), " tensor on ",
              state.device(), (state.is_contiguous() ? "" : ", not contiguous"),
              ". attnstash cannot check a stashed layer's random numbers with it: install a torch release README.md "
              "lists (Compatibility), or report it.");
  return state;
}

void open(Frame frame) { open_frames.push_back(std::move(frame)); }

bool open(Frame frame, FramePhase phase, const at::Tensor& random_input) {
  const bool first = phase != FramePhase::recompute && phase != FramePhase::recompute_without_grad;
  frame.keep = first ? phase != FramePhase::unreachable && phase != FramePhase::outside_checkpoint
                     : phase == FramePhase::recompute && frame.limit != 0;
  frame.owns = frame.keep && (phase == FramePhase::reentrant_first || phase == FramePhase::reentrant_first_hooked);
  // A token names its records by slot; another anchor may share them with an earlier forward.
  frame.owns_by_id = frame.owns && !records::is_token(frame.anchor);
  if (!frame.keep) {
    frame.random = RandomCheck::none;
  } else if (frame.random == RandomCheck::note || frame.random == RandomCheck::refuse) {
    TORCH_CHECK(random_input.defined(), "attnstash: a frame's note or refuse check needs the layer input");
    frame.random_start = generator_state(random_input.device());
  }
  const bool keep = frame.keep;
  open(std::move(frame));
  return keep;
}

Frame close(bool interrupted) {
  TORCH_CHECK(!open_frames.empty(), "attnstash: a frame was closed on a thread that has none open");
  Frame frame = std::move(open_frames.back());
  open_frames.pop_back();
  if (interrupted && frame.owns) {
    if (frame.owns_by_id) {
      for (int64_t id : frame.ids) records::release(id);
    } else {
      for (int64_t k = 0; k < frame.kept; ++k) {
        const int64_t id = records::record_id(frame.anchor, frame.slot_base + k);
        if (id != 0) records::release(id);
      }
    }
  }
  return frame;
}

size_t depth() { return open_frames.size(); }

bool is_open(int64_t slot_base) {
  for (const Frame& frame : open_frames)
    if (frame.slot_base == slot_base) return true;
  return false;
}

int64_t recomputed() { return recomputed_calls.load(std::memory_order_relaxed); }

void set_compiled_attention(CompiledAttention hook) { compiled_attention.store(hook); }

void set_compiled_frames(int64_t count) { compiled_frames = count; }

}  // namespace frames
}  // namespace attnstash

// Direct registrations on the op's autograd keys take precedence over its
// CompositeImplicitAutograd kernel, which sdpa_entry calls outside the frames.
TORCH_LIBRARY_IMPL(aten, AutogradCPU, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(attnstash::frames::sdpa_entry));
}
TORCH_LIBRARY_IMPL(aten, AutogradCUDA, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(attnstash::frames::sdpa_entry));
}
TORCH_LIBRARY_IMPL(aten, AutogradNestedTensor, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(attnstash::frames::sdpa_entry));
}
