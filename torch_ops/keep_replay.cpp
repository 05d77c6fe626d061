// keep_replay.cpp: keeping a first forward and taking it back, for any device.
#include "keep_replay.h"

#include <ATen/SavedTensorHooks.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cmath>
#include <sstream>

namespace attnstash {

bool inside_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

bool backward_keeps_graph() { return inside_backward() && torch::autograd::get_current_graph_task_keep_graph(); }

bool saved_tensor_hooks_pushed() { return saved_tensor_hooks_depth() != 0; }

size_t saved_tensor_hooks_depth() { return at::SavedTensorDefaultHooks::get_tls_state().stack.size(); }

namespace {

bool any_requires_grad(const SdpaCall& c) {
  return c.query.requires_grad() || c.key.requires_grad() || c.value.requires_grad();
}

const char* const kTensorNames[] = {"query", "key", "value"};

void check_keepable(const SdpaCall& c, const char* op) {
  const at::Tensor* ts[] = {&c.query, &c.key, &c.value};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(!ts[i]->is_nested(), "attnstash::", op, ": ", kTensorNames[i],
                " is a nested tensor, which attnstash cannot keep: it keeps dense [batch, heads, seq, "
                "head_dim] attention. Pad the batch into a dense tensor with an attention mask, or do not stash "
                "this layer.");
    TORCH_CHECK(ts[i]->dim() == 4, "attnstash::", op, ": ", kTensorNames[i],
                " must be 4-D [batch, heads, seq, head_dim] to be kept, but it is ", ts[i]->dim(), "-D with shape ",
                ts[i]->sizes(), ". Transpose the projections to [batch, heads, seq, head_dim] as Hugging Face does.");
  }
  TORCH_CHECK(c.dropout_p == 0.0, "attnstash::", op, ": attention dropout (dropout_p=", c.dropout_p,
              ") cannot be kept: the recompute could not reproduce its random mask. "
              "Set the model's attention dropout to 0.0, or do not stash this layer.");
  TORCH_CHECK(!(c.attn_mask.has_value() && c.attn_mask->requires_grad()), "attnstash::", op,
              ": the attn_mask requires grad, but the kept path gives masks no gradient (as PyTorch's flash and "
              "cuDNN derivatives do). Pass attn_mask.detach(), or do not stash this layer.");
}

// What F.sdpa checks of every call before it picks a backend, cheaply: dtypes, devices and the
// mask's shape (broadcastable to [batch, heads, seq_q, seq_k]).
bool plainly_valid(const SdpaCall& c) {
  bool same = at::isFloatingType(c.query.scalar_type()) && c.key.scalar_type() == c.query.scalar_type() &&
              c.value.scalar_type() == c.query.scalar_type() && c.key.device() == c.query.device() &&
              c.value.device() == c.query.device();
  if (c.attn_mask.has_value()) {
    const at::Tensor& mask = *c.attn_mask;
    at::ScalarType m = mask.scalar_type();
    same = same && mask.device() == c.query.device() && (m == at::kBool || m == at::kFloat || m == c.query.scalar_type());
    int64_t target[4] = {c.query.size(0), c.query.size(1), c.query.size(2), c.key.size(2)};
    same = same && mask.dim() <= 4;
    for (int64_t d = 1; same && d <= mask.dim(); ++d) {
      int64_t size = mask.size(mask.dim() - d);
      same = size == 1 || size == target[4 - d];
    }
  }
  return same;
}

// Raises the error F.scaled_dot_product_attention itself gives for inputs it refuses (dtypes that
// differ or are not floating point, heads that do not divide, a mask of the wrong shape or dtype,
// ...): F.sdpa on meta tensors of the same sizes, strides and dtypes finds them without computing
// anything; then F.sdpa itself runs, so that its own message is the one raised.
void validate_as_sdpa(const SdpaCall& c) {
  auto meta = [](const at::Tensor& t) {
    return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
  };
  std::optional<at::Tensor> mask;
  if (c.attn_mask.has_value()) mask = meta(*c.attn_mask);
  try {
    at::scaled_dot_product_attention(meta(c.query), meta(c.key), meta(c.value), mask, c.dropout_p, c.is_causal,
                                     c.scale, c.enable_gqa);
  } catch (...) {  // (a meta kernel written in Python throws a Python error, not a c10::Error)
    sdpa_plain(c);  // F.sdpa's own error (and if it runs after all, the meta check's)
    throw;
  }
  // Some releases' meta kernels pass what F.sdpa itself refuses (torch 2.11: integer query,
  // key and value): inputs outside what F.sdpa checks run it, for its own error.
  if (!plainly_valid(c)) sdpa_plain(c);
}

std::string kept_names(c10::DeviceType device) {
  std::ostringstream s;
  const char* sep = "";
  for (const SdpaBackend* b : kept_backends())
    if (b->device == device) s << sep << b->name, sep = ", ";
  return s.str();
}

// The kept backend F.sdpa would run for this call (the choice honours sdpa_kernel(...)
// contexts). Inputs F.sdpa itself refuses get PyTorch's own error.
const SdpaBackend& backend_for_keep(const SdpaCall& c, const char* op) {
  int64_t choice = at::_fused_sdp_choice(c.query, c.key, c.value, c.attn_mask, c.dropout_p, c.is_causal, c.scale,
                                         c.enable_gqa);
  const SdpaBackend* backend = find_kept_backend(c.query.device().type(), choice);
  if (backend == nullptr || !plainly_valid(c)) validate_as_sdpa(c);
  TORCH_CHECK(backend != nullptr, "attnstash::", op, ": PyTorch would run this attention with the ",
              sdpa_backend_name(choice), " backend (query ", TensorMeta::of(c.query).str(), ", key ",
              TensorMeta::of(c.key).str(), "), which attnstash cannot keep; on ", c.query.device().type(),
              " it keeps: ", kept_names(c.query.device().type()),
              ". Use inputs that backend accepts (e.g. bf16/fp16 and head_dim a multiple of 8 for cuDNN), or "
              "select it with torch.nn.attention.sdpa_kernel(...), or do not stash this layer.");
  return *backend;
}

bool same_scale(std::optional<double> a, std::optional<double> b) {
  if (a.has_value() != b.has_value()) return false;
  return !a.has_value() || *a == *b || (std::isnan(*a) && std::isnan(*b));
}

// Why `c` is not the call that kept `e`, or nothing if it is.
std::optional<std::string> call_difference(const SdpaCall& c, const Payload& record, bool check_backend) {
  const CallSignature& e = record.call;
  auto differs = [](const char* what, const std::string& kept, const std::string& now) {
    return c10::str("the recompute's ", what, " (", now, ") differs from its first forward's (", kept, ")");
  };
  const at::Tensor* ts[] = {&c.query, &c.key, &c.value};
  const TensorMeta* metas[] = {&e.query, &e.key, &e.value};
  for (int i = 0; i < 3; ++i)
    if (!(TensorMeta::of(*ts[i]) == *metas[i])) return differs(kTensorNames[i], metas[i]->str(), TensorMeta::of(*ts[i]).str());
  auto mask_str = [](const std::optional<TensorMeta>& m) { return m ? m->str() : std::string("None"); };
  std::optional<TensorMeta> mask_now;
  if (c.attn_mask.has_value()) mask_now = TensorMeta::of(*c.attn_mask);
  if (mask_now.has_value() != e.mask.has_value() || (mask_now && !(*mask_now == *e.mask)))
    return differs("attn_mask", mask_str(e.mask), mask_str(mask_now));
  // A mask made from parameters (a learned position bias folded into it, say) requires grad
  // only in a reentrant recompute: its first forward ran under no_grad.
  if (mask_now.has_value() && c.attn_mask->requires_grad())
    return std::string(
        "the recompute's attn_mask requires grad (it is computed from parameters, which a reentrant first "
        "forward under no_grad does not show), but the kept path gives masks no gradient, as PyTorch's flash and "
        "cuDNN derivatives do. Do not stash this layer, or compute the mask without gradient (detach it)");
  if (mask_now.has_value()) {
    if (auto first = e.mask_impl.lock()) {  // the first forward's mask still lives: compare
      const at::Tensor& now = *c.attn_mask;
      // The same memory (the same tensor, or an alias with the same layout: a reentrant
      // checkpoint hands its recompute detached aliases): reading it cannot tell a change,
      // the first mask's version counter can (views and detached aliases share it; .data
      // aliases do not, and go unseen, as they do by autograd). It also spares the read,
      // which on CUDA would synchronise with the device once per layer. Else: the values.
      // (Sizes and dtype are equal: checked above.)
      bool same_memory = first.get() == now.unsafeGetTensorImpl() ||
                         (first->has_storage() && now.has_storage() && first->storage().is_alias_of(now.storage()) &&
                          first->storage_offset() == now.storage_offset() && first->strides() == now.strides());
      if (same_memory) {
        int64_t version = static_cast<int64_t>(first->version_counter().current_version());
        if (version != e.mask_version)
          return c10::str("the attn_mask was modified in place between the first forward and its recompute (version ",
                          e.mask_version, " then, ", version, " now)");
      } else if (!at::equal(at::Tensor(std::move(first)), now)) {
        return differs("attn_mask", "other values", "same shape and dtype, different values");
      }
    }
  }
  if (c.dropout_p != e.dropout_p || c.is_causal != e.is_causal || !same_scale(c.scale, e.scale) ||
      c.enable_gqa != e.enable_gqa) {
    auto flags = [](double p, bool causal, std::optional<double> scale, bool gqa) {
      return c10::str("dropout_p=", p, ", is_causal=", causal, ", scale=", scale ? c10::str(*scale) : "None",
                      ", enable_gqa=", gqa);
    };
    return differs("arguments", flags(e.dropout_p, e.is_causal, e.scale, e.enable_gqa),
                   flags(c.dropout_p, c.is_causal, c.scale, c.enable_gqa));
  }
  if (check_backend) {
    int64_t choice = at::_fused_sdp_choice(c.query, c.key, c.value, c.attn_mask, c.dropout_p, c.is_causal, c.scale,
                                           c.enable_gqa);
    int64_t kept = static_cast<int64_t>(e.backend->id);
    if (choice != kept) return differs("SDPA backend", sdpa_backend_name(kept), sdpa_backend_name(choice));
  }
  const Kept* kept = record.kept();
  if (kept != nullptr && kept->moved)
    return std::string(
        "its kept output was moved off the device (offloading) and not fetched back before its recompute: the "
        "recompute reached the op without its layer's frame (attnstash/install/offload.py fetches it there)");
  if (kept != nullptr && kept->attention.output._version() != kept->output_version)
    return std::string(
        "the attention output returned by the first forward was modified in place before its recompute, so it no "
        "longer is the attention of these inputs. Do not modify the output of attnstash::sdpa_fwd_keep in place "
        "(copy it first)");
  return std::nullopt;
}

// Fails unless `c` repeats the call that kept `e`. `released`: what became of the record.
void check_same_call(const SdpaCall& c, const Payload& e, bool check_backend, const char* op, const char* released) {
  if (auto why = call_difference(c, e, check_backend))
    TORCH_CHECK(false, "attnstash::", op, ": ", *why, ", so the kept output cannot stand in for it. The recompute "
                "must repeat the first forward's attention call exactly; ", released, ".");
}

// Whether a forward that computed `fresh` (a kept record) for call `c` can share the record
// `held`: the same call, and bitwise the same attention (a declined or demoted record holds
// none: its recomputes each run their own forward).
bool interchangeable(const SdpaCall& c, const Payload& fresh, const Payload& held) {
  if (fresh.call.non_reentrant != held.call.non_reentrant || fresh.call.backend != held.call.backend) return false;
  if (call_difference(c, held, /*check_backend=*/false)) return false;
  const Kept* b = held.kept();
  if (b == nullptr) return true;
  const KeptAttention& a = fresh.kept()->attention;
  return at::equal(a.output, b->attention.output) && at::equal(a.logsumexp, b->attention.logsumexp);
}

std::string anchor_str(const at::Tensor& anchor) {
  return c10::str("shape ", anchor.sizes(), ", version ", anchor._version());
}

}  // namespace

// (sym_numel: under torch.compile the sizes may be symbolic.)
bool is_empty(const SdpaCall& c) {
  for (const at::Tensor* t : {&c.query, &c.key, &c.value})
    if (!t->is_nested() && t->sym_numel() == 0) return true;
  return false;
}

Phase phase_of(const SdpaCall& call, const at::Tensor& anchor) {
  if (is_empty(call) || c10::InferenceMode::is_enabled()) return Phase::plain;
  bool grad = at::GradMode::is_enabled();
  if (inside_backward()) return grad && any_requires_grad(call) ? Phase::recompute : Phase::plain;
  // Non-reentrant checkpointing pushes saved-tensor hooks around its first forward; an
  // ordinary differentiable call has none. Grad off under such hooks is no reentrant first
  // forward either (a non-reentrant checkpoint under no_grad, or offloading around a
  // reentrant one, whose recompute would get a copy of the anchor): nothing to keep, but for
  // a token anchor (0-dim), which the caller holds for the recompute itself.
  bool hooks = saved_tensor_hooks_pushed();
  if (!grad)
    return (!hooks || anchor.dim() == 0) && anchor.requires_grad() ? Phase::reentrant_first_forward : Phase::plain;
  return hooks && any_requires_grad(call) ? Phase::non_reentrant_first_forward : Phase::plain;
}

FramePhase frame_phase(int outer_grad) {
  const bool grad = at::GradMode::is_enabled();
  if (inside_backward()) return grad ? FramePhase::recompute : FramePhase::recompute_without_grad;
  const bool hooks = saved_tensor_hooks_pushed();
  if (grad) return hooks ? FramePhase::non_reentrant_first : FramePhase::outside_checkpoint;
  if (outer_grad == 0 || c10::InferenceMode::is_enabled()) return FramePhase::unreachable;
  return hooks ? FramePhase::reentrant_first_hooked : FramePhase::reentrant_first;
}

Phase compiled_phase_of(const SdpaCall& call, const at::Tensor& anchor) {
  if (is_empty(call) || c10::InferenceMode::is_enabled()) return Phase::plain;
  if (inside_backward()) return Phase::recompute;
  if (saved_tensor_hooks_pushed()) return Phase::non_reentrant_first_forward;
  return anchor.requires_grad() ? Phase::reentrant_first_forward : Phase::plain;
}

std::optional<at::Tensor> fused_attn_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query,
                                          const SdpaBackend& backend) {
  if (!mask.has_value() || mask->scalar_type() != at::kBool) return mask;
  // As F.sdpa writes it: where(mask, 0, scalar_tensor(masked_out, query dtype)).
  return at::where(*mask, 0.0, at::scalar_tensor(backend.masked_out,
                                                 at::TensorOptions().dtype(query.scalar_type()).device(mask->device())));
}

at::Tensor sdpa_plain(const SdpaCall& c) {
  return at::scaled_dot_product_attention(c.query, c.key, c.value, c.attn_mask, c.dropout_p, c.is_causal, c.scale,
                                          c.enable_gqa);
}

KeptAttention run_forward(const SdpaBackend& backend, const SdpaCall& c) {
  std::optional<at::Tensor> mask = fused_attn_mask(c.attn_mask, c.query, backend);
  KeptAttention kept = backend.forward({c.query, c.key, c.value, mask, c.dropout_p, c.is_causal, c.scale, c.enable_gqa});
  kept.backend = &backend;
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const at::Tensor& grad, const SdpaCall& c,
                                                            const KeptAttention& kept) {
  std::optional<at::Tensor> mask = fused_attn_mask(c.attn_mask, c.query, *kept.backend);
  return kept.backend->backward(grad, {c.query, c.key, c.value, mask, c.dropout_p, c.is_causal, c.scale, c.enable_gqa},
                                kept);
}

KeptAttention run_kept_backend(const SdpaCall& c, const char* op) {
  check_keepable(c, op);
  return run_forward(backend_for_keep(c, op), c);
}

KeptForward keep_forward(const SdpaCall& c, const at::Tensor& anchor, int64_t slot, bool non_reentrant) {
  const char* op = "sdpa_fwd_keep";
  records::release_freed();
  check_keepable(c, op);
  const SdpaBackend& backend = backend_for_keep(c, op);

  auto record = c10::make_intrusive<Payload>();
  CallSignature& call = record->call;
  call.backend = &backend;
  call.query = TensorMeta::of(c.query);
  call.key = TensorMeta::of(c.key);
  call.value = TensorMeta::of(c.value);
  if (c.attn_mask.has_value()) {
    call.mask = TensorMeta::of(*c.attn_mask);
    call.mask_impl = WeakTensor(c.attn_mask->getIntrusivePtr());
    call.mask_version = static_cast<int64_t>(c.attn_mask->_version());
  }
  call.dropout_p = c.dropout_p;
  call.is_causal = c.is_causal;
  call.scale = c.scale;
  call.enable_gqa = c.enable_gqa;
  call.anchor_storage = c10::weak_intrusive_ptr<c10::StorageImpl>(anchor.storage().getWeakStorageImpl());
  call.on_token = records::is_token(anchor);
  call.non_reentrant = non_reentrant;
  KeptAttention attention = run_forward(backend, c);
  record->state = Kept{attention, static_cast<int64_t>(attention.output._version())};

  KeptForward kept{attention, key_of(anchor, slot, op), 0, false};
  records::Stored stored = records::store(kept.key, record);
  if (stored.duplicate) {
    // The same anchor through this attention again before the first one's recompute: the
    // two recomputes cannot be told apart, so they may share one record only if either
    // could take it. A record left by a freed anchor at this address is dropped instead.
    records::Taken held = records::peek(kept.key);
    if (held.payload && !kept_for(*held.payload, anchor)) {
      records::release_stale(kept.key);
      stored = records::store(kept.key, record);
    } else if (held.payload && interchangeable(c, *record, *held.payload) && records::share(kept.key, held.id)) {
      // (Sharing a demoted record: this forward's node saves what one kept would.)
      stored = records::Stored{held.id, node_saves_output(*held.payload), false};
    }
    TORCH_CHECK(!stored.duplicate, "attnstash::", op, ": this anchor (", anchor_str(anchor), ") already went through "
                "this attention (slot ", slot, ") in a forward whose recompute has not come yet, with a different "
                "result (other position ids, another mask, other weights, or randomness): a recompute could not "
                "tell the two forwards apart. Give each forward its own input tensor (e.g. inputs_embeds.clone()), "
                "or run the first forward's backward before the second forward. If the earlier forward will never "
                "get a backward (it ran under torch.no_grad(), or its graph is gone while you still hold its input, "
                "the anchor), its record stays until that input is freed: attnstash.stash_clear() releases it.");
  }
  kept.id = stored.id;
  kept.declined = stored.declined;
  return kept;
}

// What a refused check says of the record it took (`leave`: read by a backward that keeps its
// graph, backward_keeps_graph).
static const char* after_the_take(bool leave) {
  return leave ? "the kept output stays held until this forward's graph is freed" : "the kept output has been released";
}

PayloadPtr take_for_replay(const SdpaCall& c, const at::Tensor& anchor, int64_t slot, bool check_backend) {
  const char* op = "sdpa_replay";
  records::release_freed();
  stash_key key = key_of(anchor, slot, op);
  const bool leave = backward_keeps_graph();
  PayloadPtr e = records::take(key, 0, leave).payload;  // taken: a failed check releases it with e
  TORCH_CHECK(!e || kept_for(*e, anchor), "attnstash::", op, ": nothing is kept for this anchor (",
              anchor_str(anchor), ", slot ", slot, "): the output kept at its address belonged to an earlier tensor "
              "that has been freed. The recompute must receive the same anchor tensor (or a detached alias of it) "
              "as its first forward.");
  if (e) {
    check_same_call(c, *e, check_backend, op, after_the_take(leave));
    return e;
  }
  // A miss. Records of this anchor and slot under another version or shape explain it.
  auto stale = records::release_stale(key);
  if (!stale.empty()) {
    const auto& [version, shape] = stale.front();
    TORCH_CHECK(version == key.version, "attnstash::", op, ": the anchor was modified in place between the first "
                "forward and its recompute (its version was ", version, " when the output was kept and is ",
                key.version, " now), so the kept output may not match this input. Do not modify the layer input in "
                "place before backward; the kept output has been released.");
    TORCH_CHECK(false, "attnstash::", op, ": the anchor's shape changed between the first forward and its recompute (",
                shape, " when kept, ", anchor.sizes(), " now); the kept output has been released.");
  }
  TORCH_CHECK(false, "attnstash::", op, ": no attention output is kept for this anchor (", anchor_str(anchor),
              ") and slot ", slot, ". A recompute can only replay what its first forward kept, and a first forward "
              "keeps only inside an activation checkpoint (reentrant: grad off, no saved-tensor hooks, an anchor "
              "that requires grad; non-reentrant: under its saved-tensor hooks). A cleared stash "
              "(attnstash.stash_clear()), a first forward that ran before the stash was installed, or a backward "
              "through a forward whose graph an earlier backward freed (retain_graph=False) leave nothing to "
              "replay either. Offloading (saved-tensor hooks around the "
              "checkpoint that move its inputs: save_on_cpu on a GPU, transformers' offload=True) hands the "
              "recompute a copy of the layer input: anchor on a 0-dim token held for the forward instead. The "
              "installer does so for every layer that runs eagerly, not for a layer compiled on its own inside an "
              "eager checkpoint (block.compile(), diffusers' compile_repeated_blocks), whose graph anchors on its "
              "input: turn offloading off for those, compile the whole model instead, or do not stash them.");
}

PayloadPtr take_owned(const SdpaCall& c, RecordOwner& owner) {
  const char* op = "sdpa_fwd_keep";
  const bool leave = backward_keeps_graph();
  PayloadPtr e = records::take(owner.key, owner.id, leave).payload;
  TORCH_CHECK(e, "attnstash::", op, ": the output this forward kept (slot ", owner.key.slot, ") is gone: the stash "
              "was cleared (attnstash.stash_clear()), or an earlier backward through this forward took it without "
              "keeping the graph (retain_graph=False).");
  owner.taken = !leave;
  // The backend is this forward's own, whatever sdpa_kernel context the backward runs in.
  check_same_call(c, *e, /*check_backend=*/false, op, after_the_take(leave));
  return e;
}

bool node_saves_output(const Payload& record) { return std::holds_alternative<Declined>(record.state); }

bool held_by_non_reentrant(const at::Tensor& anchor, int64_t slot) {
  records::Taken held = records::peek(key_of(anchor, slot, "sdpa_fwd_keep"));
  return held.payload && held.payload->call.non_reentrant && kept_for(*held.payload, anchor);
}

PayloadPtr peek_for_recompute(const SdpaCall& c, const at::Tensor& anchor, int64_t slot) {
  records::Taken held = records::peek(key_of(anchor, slot, "sdpa_fwd_keep"));
  if (!held.payload || !held.payload->call.non_reentrant || !kept_for(*held.payload, anchor)) return PayloadPtr();
  check_same_call(c, *held.payload, /*check_backend=*/true, "sdpa_fwd_keep", "the kept output is still held");
  return held.payload;
}

}  // namespace attnstash
