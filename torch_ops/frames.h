// frames.h: the one way attention calls reach the stash.
//
// The installer opens a frame around each forward of a stashed layer, on the thread that runs
// it, and closes it when the forward returns or raises (attnstash/install/core.py, run_frame:
// one call, python_module.cpp's frame_run, opens the frame, runs the forward and closes it).
// While the innermost frame of a thread keeps, every call of
// aten::scaled_dot_product_attention that thread makes on CPU or CUDA tensors (F.sdpa by any
// name, torch._C._nn's, nn.MultiheadAttention's, a library's own entry around it) is
// attnstash::sdpa_fwd_keep on the frame's anchor at slot `slot_base + k`, k the call's index in
// the frame, in call order. Everything else, and every call outside a frame, is torch's own
// kernel (the op's CompositeImplicitAutograd one) unchanged: nothing outside a stashed layer's
// forward can observe a frame. The kernel is registered on the op's AutogradCPU, AutogradCUDA
// and AutogradNestedTensor keys (frames.cpp), which take precedence over its composite one.
//
// Calls the kernel passes through even inside a frame that keeps: those torch.compile traces
// (FakeTensor and FunctionalTensor inputs), and those the ops make themselves (F.sdpa's own
// checks and plain path).
//
// A stashed layer that torch.compile traces inside an eager checkpoint opens compiled frames
// instead, from its graph (attnstash/install/compiled.py): while a thread has any open, each of
// its calls goes first to the installer's `compiled_attention`, which returns what the call is
// traced or run as (attnstash::_sdpa_compiled) or nothing (the rules above then apply).
//
// A frame opens by the phase its forward starts in (keep_replay.h, FramePhase; `open`): that
// decides whether its calls keep (or replay), and whether the frame owns what they keep until
// it closes: a reentrant first forward's records are released by the frame itself if the forward
// is interrupted (an error, Ctrl-C: close(true)); any other record's owner is its anchor's
// (records.h: a token, a non-reentrant node, the layer input's storage).
//
// The frame also checks the random state before each call (RandomCheck) and lists what it
// kept, for the installer; it never raises a Python error itself: a call it refuses fails
// with a RuntimeError, and the frame says why (Failure), so that the installer can name the
// layer and raise its own error class (core.py, frame_error).
#pragma once

#include "keep_replay.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace attnstash {
namespace frames {

// What a frame checks of the random state before each call (attnstash/install/random_state.py
// says when each applies).
enum class RandomCheck : int64_t {
  none = 0,    // nothing: its checkpoint restores the state for the recompute
  note = 1,    // a first forward: a call made after a draw since the forward's start notes the
               // state it was made in on its record (the recompute must make it in that state)
  refuse = 2,  // a first forward whose checkpoint does not restore the state: such a call fails
  check = 3,   // a recompute: a call whose record noted a state must be made in that state
};

// Why a call in the frame failed.
enum class Failure : int64_t {
  none = 0,
  op = 1,            // the op refused it (its message, "attnstash...", is `message`)
  limit = 2,         // a recompute called attention more often than `limit`
  random_state = 3,  // RandomCheck::refuse or ::check found other random numbers drawn
};

struct Frame {
  // Set when it opens:
  at::Tensor anchor;      // what the ops anchor on (a token, or the layer input)
  int64_t slot_base = 0;  // its layer's first slot
  int64_t limit = -1;     // a recompute: the calls its first forward made (-1: no limit)
  bool keep = false;      // whether its calls go to the ops (else: torch's own kernel)
  bool owns = false;      // whether an interrupted forward's records are released as it closes
  bool owns_by_id = false;  // owns, on an anchor that is not a token: by the ids it lists
  bool collect = false;   // whether to list the ids of the records its calls keep (for the installer)
  RandomCheck random = RandomCheck::none;
  at::Tensor random_start;  // note, refuse: the generator's state when the forward started

  // What its calls did:
  int64_t calls = 0;         // calls that went to the ops
  int64_t kept = 0;          // those the op returned from
  std::vector<int64_t> ids;  // with `collect`, or `owns` on an anchor that is not a token: the records they keep
  bool noted = false;        // a call noted a random state on its record
  Failure failure = Failure::none;
  std::string message;       // the op's message, for Failure::op
  double dropout_p = 0.0;    // the failing call's, for the installer's message
};

// The state of the default generator of `device`: what torch.get_rng_state() (CPU) and
// torch.cuda.get_rng_state(device) return, a contiguous CPU byte tensor (checked: the frame
// compares two states by their bytes).
at::Tensor generator_state(const at::Device& device);

// Open a frame on this thread, inside those already open on it, as `frame` says.
void open(Frame frame);

// Open the frame of a stashed layer's forward that starts in `phase`: its `keep` and `owns` set
// by it, the rest as `frame` says. It keeps in a recompute whose first forward called attention
// (`limit` not 0) and in a first forward that a backward can reach; it owns what a reentrant
// first forward (with or without offloading's hooks) keeps. A frame that keeps and makes a note
// or refuse check takes its `random_start` from the generator of `random_input`'s device (the
// layer input's). Returns `keep`.
bool open(Frame frame, FramePhase phase, const at::Tensor& random_input);

// Close this thread's innermost frame and return it; fails if none is open. `interrupted`: its
// forward raised; what the frame owns is released.
Frame close(bool interrupted = false);

// How many frames are open on this thread.
size_t depth();

// Whether a frame whose layer's first slot is `slot_base` is open on this thread (at any depth):
// the installer asks it as a stashed layer's forward starts, to tell one that its own frame
// already runs (a Run's) from one that needs a frame (attnstash/install/core.py, _eager_forward).
bool is_open(int64_t slot_base);

// How many attention calls torch's own kernel has run in a backward with grad on, in this
// process: recomputes the stash did not serve (a layer not stashed, or a stashed one run as
// without the stash). A declined or demoted record's recompute runs its backend's forward, not
// this op (the registry counts it as declined), and a compiled graph's attention does not reach
// it: neither is counted.
int64_t recomputed();

// The installer's hook for compiled frames (above): the call's arguments in, the tensor it
// stands for out, or nothing.
using CompiledAttention = std::optional<at::Tensor> (*)(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& value,
                                                        const std::optional<at::Tensor>& attn_mask,
                                                        double dropout_p, bool is_causal,
                                                        std::optional<double> scale, bool enable_gqa);
void set_compiled_attention(CompiledAttention hook);

// How many compiled frames this thread has open (the installer counts them).
void set_compiled_frames(int64_t count);

}  // namespace frames
}  // namespace attnstash
