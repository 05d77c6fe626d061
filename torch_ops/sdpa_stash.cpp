// sdpa_stash.cpp: keeping a first forward and taking it back, for any device.
#include "sdpa_stash.h"

#include <ATen/SavedTensorHooks.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <sstream>

namespace attnstash {
namespace {

bool inside_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

void check_keepable(const SdpaCall& c, const char* op) {
  const char* names[] = {"query", "key", "value"};
  const at::Tensor* ts[] = {&c.query, &c.key, &c.value};
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK(ts[i]->dim() == 4, "attnstash::", op, ": ", names[i],
                " must be 4-D [batch, heads, seq, head_dim] to be kept, but it is ", ts[i]->dim(), "-D with shape ",
                ts[i]->sizes(), ". Transpose the projections to [batch, heads, seq, head_dim] as Hugging Face does.");
  TORCH_CHECK(c.dropout_p == 0.0, "attnstash::", op, ": attention dropout (dropout_p=", c.dropout_p,
              ") cannot be kept: the recompute could not reproduce its random mask. "
              "Set the model's attention dropout to 0.0, or do not stash this layer.");
  TORCH_CHECK(!(c.attn_mask.has_value() && c.attn_mask->requires_grad()), "attnstash::", op,
              ": the attn_mask requires grad, but the kept path gives masks no gradient (as PyTorch's flash and "
              "cuDNN derivatives do). Pass attn_mask.detach(), or do not stash this layer.");
}

std::string kept_names(c10::DeviceType device) {
  std::ostringstream s;
  const char* sep = "";
  for (const SdpaBackend* b : kept_backends())
    if (b->device == device) s << sep << b->name, sep = ", ";
  return s.str();
}

}  // namespace

Phase phase_of(const at::Tensor& anchor) {
  if (!anchor.requires_grad() || c10::InferenceMode::is_enabled()) return Phase::plain;
  bool grad = at::GradMode::is_enabled();
  if (inside_backward()) return grad ? Phase::recompute : Phase::plain;
  if (!grad) return Phase::first_forward;
  // Non-reentrant checkpointing pushes saved-tensor hooks around its first forward; an
  // ordinary differentiable call has none and stays exactly F.sdpa.
  bool hooks = !at::SavedTensorDefaultHooks::get_tls_state().stack.empty();
  return hooks ? Phase::graph_forward : Phase::plain;
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

at::Tensor keep_forward(const SdpaCall& c, const at::Tensor& anchor, int64_t slot, bool with_graph) {
  const char* op = "sdpa_fwd_keep";
  release_freed_entries();
  check_keepable(c, op);
  // Ask PyTorch which backend F.sdpa would run: this honours sdpa_kernel(...) contexts.
  int64_t choice = at::_fused_sdp_choice(c.query, c.key, c.value, c.attn_mask, c.dropout_p, c.is_causal, c.scale,
                                         c.enable_gqa);
  const SdpaBackend* backend = find_kept_backend(c.query.device().type(), choice);
  TORCH_CHECK(backend != nullptr, "attnstash::", op, ": PyTorch would run this attention with the ",
              sdpa_backend_name(choice), " backend (query ", TensorMeta::of(c.query).str(), ", key ",
              TensorMeta::of(c.key).str(), "), which attnstash cannot keep; on ", c.query.device().type(),
              " it keeps: ", kept_names(c.query.device().type()),
              ". Use inputs that backend accepts (e.g. bf16/fp16 and head_dim a multiple of 8 for cuDNN), or "
              "select it with torch.nn.attention.sdpa_kernel(...), or do not stash this layer.");

  auto entry = std::make_unique<KeptEntry>();
  std::optional<at::Tensor> mask = fused_attn_mask(c.attn_mask, c.query, *backend);
  entry->attention = backend->forward({c.query, c.key, c.value, mask, c.dropout_p, c.is_causal, c.scale, c.enable_gqa});
  entry->attention.backend = backend;
  entry->query = TensorMeta::of(c.query);
  entry->key = TensorMeta::of(c.key);
  entry->value = TensorMeta::of(c.value);
  if (c.attn_mask.has_value()) {
    entry->mask = TensorMeta::of(*c.attn_mask);
    entry->mask_impl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(c.attn_mask->getIntrusivePtr());
    entry->mask_version = static_cast<int64_t>(c.attn_mask->_version());
  }
  entry->dropout_p = c.dropout_p;
  entry->is_causal = c.is_causal;
  entry->scale = c.scale;
  entry->enable_gqa = c.enable_gqa;
  entry->with_graph = with_graph;
  at::Tensor output = entry->attention.output;
  entry->output_version = static_cast<int64_t>(output._version());
  keep_entry(anchor, slot, std::move(entry), op);
  return output;
}

namespace {

// Fails unless `c` repeats the call that kept `e`. `released`: what the error says became
// of the kept output.
void check_same_call(const SdpaCall& c, const KeptEntry* e, bool check_backend, const char* op,
                     const char* released) {
  auto mismatch = [&](const char* what, const std::string& kept, const std::string& now) {
    TORCH_CHECK(false, "attnstash::", op, ": the recompute's ", what, " (", now, ") differs from its first forward's (",
                kept, "), so the kept output cannot stand in for it. The recompute must repeat the first forward's "
                "attention call exactly; ", released, ".");
  };
  if (!(TensorMeta::of(c.query) == e->query)) mismatch("query", e->query.str(), TensorMeta::of(c.query).str());
  if (!(TensorMeta::of(c.key) == e->key)) mismatch("key", e->key.str(), TensorMeta::of(c.key).str());
  if (!(TensorMeta::of(c.value) == e->value)) mismatch("value", e->value.str(), TensorMeta::of(c.value).str());
  auto mask_str = [](const std::optional<TensorMeta>& m) { return m ? m->str() : std::string("None"); };
  std::optional<TensorMeta> mask_now;
  if (c.attn_mask.has_value()) mask_now = TensorMeta::of(*c.attn_mask);
  if (mask_now.has_value() != e->mask.has_value() || (mask_now && !(*mask_now == *e->mask)))
    mismatch("attn_mask", mask_str(e->mask), mask_str(mask_now));
  if (mask_now.has_value()) {
    if (auto first = e->mask_impl.lock()) {  // the first forward's mask still lives: compare
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
        TORCH_CHECK(version == e->mask_version, "attnstash::", op,
                    ": the attn_mask was modified in place between the first forward and its recompute (version ",
                    e->mask_version, " then, ", version, " now); ", released, ".");
      } else if (!at::equal(at::Tensor(std::move(first)), now)) {
        mismatch("attn_mask", "other values", "same shape and dtype, different values");
      }
    }
  }
  if (c.dropout_p != e->dropout_p || c.is_causal != e->is_causal || c.scale != e->scale ||
      c.enable_gqa != e->enable_gqa) {
    auto flags = [](double p, bool causal, std::optional<double> scale, bool gqa) {
      return c10::str("dropout_p=", p, ", is_causal=", causal, ", scale=", scale ? c10::str(*scale) : "None",
                      ", enable_gqa=", gqa);
    };
    mismatch("arguments", flags(e->dropout_p, e->is_causal, e->scale, e->enable_gqa),
             flags(c.dropout_p, c.is_causal, c.scale, c.enable_gqa));
  }
  if (check_backend) {
    int64_t choice = at::_fused_sdp_choice(c.query, c.key, c.value, c.attn_mask, c.dropout_p, c.is_causal, c.scale,
                                           c.enable_gqa);
    if (choice != e->attention.backend->id)
      mismatch("SDPA backend", sdpa_backend_name(e->attention.backend->id), sdpa_backend_name(choice));
  }
  TORCH_CHECK(e->attention.output._version() == e->output_version, "attnstash::", op,
              ": the attention output returned by the first forward was modified in place before its recompute, "
              "so it no longer is the attention of these inputs. Do not modify the output of "
              "attnstash::sdpa_fwd_keep in place (copy it first); ", released, ".");
}

}  // namespace

std::unique_ptr<KeptEntry> take_for_replay(const SdpaCall& c, const at::Tensor& anchor, int64_t slot,
                                           bool check_backend) {
  const char* op = "sdpa_replay";
  release_freed_entries();
  std::unique_ptr<KeptEntry> e = take_entry(anchor, slot, op);
  // The entry is ours now: a failed check releases it with the unique_ptr.
  check_same_call(c, e.get(), check_backend, op, "the kept output has been released");
  return e;
}

at::Tensor output_for_recompute(const SdpaCall& c, const at::Tensor& anchor, int64_t slot) {
  std::unique_ptr<KeptEntry> e;  // a copy, checked outside the registry's lock
  read_entry(anchor, slot, [&](const KeptEntry& kept) { e = std::make_unique<KeptEntry>(kept); });
  TORCH_CHECK(e && e->with_graph, "attnstash::sdpa_fwd_keep: the kept output for this anchor and slot ", slot,
              " disappeared during its recompute (was the stash cleared from another thread?).");
  check_same_call(c, e.get(), /*check_backend=*/true, "sdpa_fwd_keep", "the kept output is still held");
  // A detached alias: the recompute's node must not take over the first forward's output.
  return e->attention.output.detach();
}

bool kept_with_graph(const at::Tensor& anchor, int64_t slot) {
  bool with_graph = false;
  read_entry(anchor, slot, [&](const KeptEntry& kept) { with_graph = kept.with_graph; });
  return with_graph;
}

}  // namespace attnstash

namespace attnstash {
namespace {

at::Tensor sdpa_fwd_keep_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                                double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  if (phase_of(anchor) == Phase::first_forward) return keep_forward(call, anchor, slot, /*with_graph=*/false);
  return sdpa_plain(call);
}

// Without autograd a replay is only the take: the kept output, checked against this call.
at::Tensor sdpa_replay_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                              double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  return take_for_replay(call, anchor, slot)->attention.output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>> replay_take_kernel(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& anchor, int64_t slot,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
    bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  KeptAttention kept = std::move(take_for_replay(call, anchor, slot)->attention);
  // A Tensor[] cannot hold undefined tensors: stand in empty ones and record which.
  int64_t defined = 0;
  for (size_t i = 0; i < kept.extra.size(); ++i) {
    if (kept.extra[i].defined()) defined |= int64_t{1} << i;
    else kept.extra[i] = at::empty({0}, query.options().dtype(at::kByte));
  }
  at::Tensor info = at::tensor({kept.backend->id, kept.max_q, kept.max_k, defined}, at::kLong);
  return {kept.output, kept.logsumexp, info, kept.extra};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> replay_backward_kernel(
    const at::Tensor& grad, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& logsumexp,
    const at::Tensor& info, at::TensorList extra, double dropout_p, bool is_causal, std::optional<double> scale,
    bool enable_gqa) {
  TORCH_CHECK(info.device().is_cpu() && info.scalar_type() == at::kLong && info.numel() == 4,
              "attnstash::_replay_backward: info must be the CPU int64 [backend, max_q, max_k, defined extras] "
              "that _replay_take "
              "returned, got ", info.scalar_type(), info.sizes(), " on ", info.device());
  const int64_t* i = info.data_ptr<int64_t>();
  KeptAttention kept;
  kept.backend = find_kept_backend(query.device().type(), i[0]);
  TORCH_CHECK(kept.backend != nullptr, "attnstash::_replay_backward: no kept backend ", sdpa_backend_name(i[0]),
              " on ", query.device().type());
  kept.output = output;
  kept.logsumexp = logsumexp;
  kept.extra = extra.vec();
  for (size_t e = 0; e < kept.extra.size(); ++e)
    if (!(i[3] >> e & 1)) kept.extra[e] = at::Tensor();
  kept.max_q = i[1];
  kept.max_k = i[2];
  // (enable_gqa is no argument of any fused backward: K/V heads come from the shapes.)
  // The backward gets the mask as the kept forward got it (a boolean one made additive).
  std::optional<at::Tensor> mask = fused_attn_mask(attn_mask, query, *kept.backend);
  SdpaCall call{query, key, value, mask, dropout_p, is_causal, scale, enable_gqa};
  return kept.backend->backward(grad, call, kept);
}

}  // namespace

void register_device_kernels(torch::Library& m) {
  m.impl("sdpa_fwd_keep", &sdpa_fwd_keep_kernel);
  m.impl("sdpa_replay", &sdpa_replay_kernel);
  m.impl("_replay_take", &replay_take_kernel);
  m.impl("_replay_backward", &replay_backward_kernel);
}

}  // namespace attnstash
