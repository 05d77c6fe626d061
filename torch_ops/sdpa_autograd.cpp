// The Autograd dispatch key: where the phase of an attention call is decided, and the
// two nodes whose backward is exactly PyTorch's derivative of the kept forward: one for
// a reentrant recompute, one for a non-reentrant checkpoint's first forward.
#include "keep_replay.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace attnstash {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// FakeTensor and FunctionalTensor (torch.compile's tracing) have no data to look up.
bool traced(const at::Tensor& t) {
  return t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// The call's flags travel to backward in saved_data; the tensors in saved variables.
void save_flags(AutogradContext* ctx, double dropout_p, bool is_causal, std::optional<double> scale,
                bool enable_gqa) {
  ctx->saved_data["dropout_p"] = dropout_p;
  ctx->saved_data["is_causal"] = is_causal;
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["enable_gqa"] = enable_gqa;
}

SdpaCall saved_call(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const std::optional<at::Tensor>& attn_mask) {
  return SdpaCall{query, key, value, attn_mask, ctx->saved_data["dropout_p"].toDouble(),
                  ctx->saved_data["is_causal"].toBool(), ctx->saved_data["scale"].toOptional<double>(),
                  ctx->saved_data["enable_gqa"].toBool()};
}

std::optional<at::Tensor> optional_mask(const at::Tensor& saved) {
  return saved.defined() ? std::optional<at::Tensor>(saved) : std::nullopt;
}

c10::OperatorHandle op_named(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

using TakeOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
    const std::optional<at::Tensor>&, double, bool, std::optional<double>, bool);

// Reentrant checkpointing: the recompute's own nodes run backward. This one returns the
// kept output as a node of the recompute's graph: its forward never runs attention (it
// takes from the stash, _replay_take; a declined record runs the kept backend's forward, as
// the normal recompute would), its backward calls the kept backend's backward with the
// recompute's query/key/value and the kept output and log-sum-exp, as PyTorch's derivative
// does. Both halves are ops, so torch.compile can trace the node. With `decided_at_run_time`
// its forward is _keep_or_take instead (_sdpa_compiled: a graph that keeps in its first
// forward and takes in its recompute, where the compiled backward is this node's).
struct ReentrantReplayFunction : public torch::autograd::Function<ReentrantReplayFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& anchor, int64_t slot,
                            const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                            std::optional<double> scale, bool enable_gqa, bool decided_at_run_time) {
    static auto take = op_named("attnstash::_replay_take").typed<TakeOp>();
    static auto keep_or_take = op_named("attnstash::_keep_or_take").typed<TakeOp>();
    at::Tensor output, logsumexp, info;
    std::vector<at::Tensor> extra;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(output, logsumexp, info, extra) = (decided_at_run_time ? keep_or_take : take)
          .call(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa);
    }
    // The caller's mask, as it came: _replay_backward makes it what the kept backend got.
    // (Saving the additive one would hold a new [B, 1, Sq, Sk] tensor until backward.)
    variable_list saved = {query, key, value, attn_mask.value_or(at::Tensor()), output, logsumexp, info};
    saved.insert(saved.end(), extra.begin(), extra.end());
    ctx->save_for_backward(saved);
    save_flags(ctx, dropout_p, is_causal, scale, enable_gqa);
    ctx->set_materialize_grads(false);
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op =
        op_named("attnstash::_replay_backward")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                at::TensorList, double, bool, std::optional<double>, bool)>();
    variable_list grad_inputs(11);  // one per forward argument; only query, key and value get one
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return grad_inputs;  // the fused backwards do not check this themselves
    variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> extra(saved.begin() + 7, saved.end());
    SdpaCall c = saved_call(ctx, saved[0], saved[1], saved[2], optional_mask(saved[3]));
    std::tie(grad_inputs[0], grad_inputs[1], grad_inputs[2]) =
        backward_op.call(grad, c.query, c.key, c.value, c.attn_mask, saved[4], saved[5], saved[6], extra, c.dropout_p,
                         c.is_causal, c.scale, c.enable_gqa);
    return grad_inputs;
  }
};

// Non-reentrant checkpointing: the first forward's own node is the one whose backward
// runs, and the recompute only refills the tensors it saved. So the first forward keeps
// output and log-sum-exp in the stash (out of the checkpoint's reach), owned by this node
// (a graph dropped without a backward releases them with it), and saves only query, key,
// value and mask, which the checkpoint frees and refills; the recompute runs the same node
// over the kept output, saving the same tensors, without running attention; and the first
// forward's backward takes the entry and calls the kept backend's backward. A declined
// keep saves output, log-sum-exp and extras as F.sdpa's own node would: the checkpoint
// frees them, and the recompute runs the forward again to refill them.
struct NonReentrantKeepFunction : public torch::autograd::Function<NonReentrantKeepFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& anchor, int64_t slot,
                            const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                            std::optional<double> scale, bool enable_gqa, bool recompute) {
    SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
    KeptAttention attention;
    bool fresh = false;        // the attention was computed here, not taken from the stash
    bool saves_output = false;
    if (recompute) {
      PayloadPtr held = peek_for_recompute(call, anchor, slot);
      TORCH_CHECK(held, "attnstash::sdpa_fwd_keep: the output kept for this anchor and slot ", slot,
                  " disappeared during its recompute (was the stash cleared from another thread?).");
      saves_output = node_saves_output(*held);
      const Kept* kept = held->kept();
      fresh = kept == nullptr;
      attention = fresh ? run_forward(*held->call.backend, call) : kept->attention;
      if (auto* demoted = std::get_if<Demoted>(&held->state)) {  // for the first forward's node's backward
        std::lock_guard<std::mutex> lock(demoted->refill->mutex);
        demoted->refill->attention = attention;
      }
    } else {
      KeptForward kept = keep_forward(call, anchor, slot, /*non_reentrant=*/true);
      attention = kept.attention;
      fresh = saves_output = kept.declined;
      // Only the first forward's node owns the record: the recompute's graph is discarded.
      ctx->saved_data["owner"] = c10::IValue::make_capsule(c10::make_intrusive<RecordOwner>(kept.key, kept.id));
    }
    // A detached alias of a kept output: the node must not take over the stash's tensor.
    at::Tensor output = fresh ? attention.output : attention.output.detach();
    variable_list saved = {query, key, value, attn_mask.value_or(at::Tensor())};
    if (saves_output) {
      saved.push_back(output);
      saved.push_back(attention.logsumexp);
      saved.insert(saved.end(), attention.extra.begin(), attention.extra.end());
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["max_q"] = attention.max_q;
    ctx->saved_data["max_k"] = attention.max_k;
    save_flags(ctx, dropout_p, is_causal, scale, enable_gqa);
    ctx->set_materialize_grads(false);
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list grad_inputs(11);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return grad_inputs;
    variable_list saved = ctx->get_saved_variables();
    SdpaCall call = saved_call(ctx, saved[0], saved[1], saved[2], optional_mask(saved[3]));
    auto owner = c10::static_intrusive_pointer_cast<RecordOwner>(ctx->saved_data["owner"].toCapsule());
    PayloadPtr record = take_owned(call, *owner);
    KeptAttention kept;
    if (const Kept* k = record->kept()) {
      kept = k->attention;
    } else if (std::holds_alternative<Declined>(record->state)) {  // what the recompute refilled the node with
      kept.backend = record->call.backend;
      kept.output = saved[4];
      kept.logsumexp = saved[5];
      kept.extra.assign(saved.begin() + 6, saved.end());
      kept.max_q = ctx->saved_data["max_q"].toInt();
      kept.max_k = ctx->saved_data["max_k"].toInt();
    } else {  // Demoted after it was kept: what the recompute left in the record
      auto& refill = *std::get<Demoted>(record->state).refill;
      std::unique_lock<std::mutex> lock(refill.mutex);
      std::optional<KeptAttention> refilled = std::move(refill.attention);
      lock.unlock();
      // (Demoted between the refill and now: the forward runs again, as the refill did.)
      kept = refilled ? *refilled : run_forward(*record->call.backend, call);
    }
    // Checked against the caller's mask; the backend gets it as the fused op got it.
    std::tie(grad_inputs[0], grad_inputs[1], grad_inputs[2]) = run_backward(grad, call, kept);
    return grad_inputs;
  }
};

at::Tensor sdpa_replay_autograd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                                double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  if (is_empty(call)) return sdpa_plain(call);  // never kept, so never replayed: F.sdpa's own graph
  return ReentrantReplayFunction::apply(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale,
                                        enable_gqa, /*decided_at_run_time=*/false);
}

// A layer compiled inside an eager checkpoint (attnstash/install/compiled.py): traced with
// grad on, one node whose forward keeps or takes when the graph runs; with grad off (a
// reentrant checkpoint's first forward), no node.
at::Tensor sdpa_compiled_autograd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                                  double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  if (is_empty(call)) return sdpa_plain(call);
  if (at::GradMode::is_enabled() && (query.requires_grad() || key.requires_grad() || value.requires_grad()))
    return ReentrantReplayFunction::apply(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale,
                                          enable_gqa, /*decided_at_run_time=*/true);
  static auto op = op_named("attnstash::_sdpa_compiled").typed<decltype(sdpa_compiled_autograd)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

at::Tensor sdpa_fwd_keep_autograd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                                  double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  switch (phase_of(call, anchor)) {
    case Phase::recompute:
      // Traced (torch.compile), the reentrant replay is the one that can be: both its
      // halves are ops. A non-reentrant first forward under torch.compile is refused below.
      if (!traced(anchor) && held_by_non_reentrant(anchor, slot))  // non-reentrant: refill, keep holding
        return NonReentrantKeepFunction::apply(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal,
                                               scale, enable_gqa, /*recompute=*/true);
      return sdpa_replay_autograd(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale,
                                  enable_gqa);
    case Phase::non_reentrant_first_forward:
      TORCH_CHECK(!traced(query) && !traced(anchor),
                  "attnstash::sdpa_fwd_keep: torch.compile is tracing the activation checkpoint itself (it turns "
                  "torch.utils.checkpoint, reentrant or not, into its own recomputation), where nothing can be "
                  "kept. Compile the checkpointed function and checkpoint the compiled one: "
                  "checkpoint(torch.compile(block), x, use_reentrant=True).");
      return NonReentrantKeepFunction::apply(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale,
                                             enable_gqa, /*recompute=*/false);
    case Phase::plain:
      if (at::GradMode::is_enabled()) {  // an ordinary differentiable call: F.sdpa's own graph
        // Traced so, with an anchor that requires grad: some torch versions (2.11) trace an
        // activation checkpoint around it without a sign of it, where 2.13 shows hooks
        // (above). The graph then has plain attention: gradients right, nothing kept.
        if (anchor.requires_grad() && (traced(query) || traced(anchor)))
          TORCH_WARN("attnstash::sdpa_fwd_keep: torch.compile traces this call as an ordinary differentiable one "
                     "(grad mode on, outside backward, no activation checkpoint seen), so the compiled graph runs "
                     "plain attention and nothing is kept. If torch.compile is tracing an activation checkpoint "
                     "around it, compile the checkpointed function and checkpoint the compiled one instead: "
                     "checkpoint(torch.compile(block), x, use_reentrant=True).");
        return sdpa_plain(call);
      }
      break;
    case Phase::reentrant_first_forward:
      break;
  }
  // No graph to record: the device kernel decides between keeping and a plain call.
  static auto op = op_named("attnstash::sdpa_fwd_keep").typed<decltype(sdpa_fwd_keep_autograd)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnstash, Autograd, m) {
  m.impl("sdpa_fwd_keep", &sdpa_fwd_keep_autograd);
  m.impl("sdpa_replay", &sdpa_replay_autograd);
  m.impl("_sdpa_compiled", &sdpa_compiled_autograd);
}

}  // namespace attnstash
