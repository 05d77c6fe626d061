// The Autograd dispatch key: where the phase of an attention call is decided, and
// the replay node whose backward is exactly PyTorch's derivative of the kept forward.
#include "sdpa_stash.h"

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

c10::OperatorHandle op_named(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Returns the kept output as a node of the recompute's graph. Its forward never runs
// attention (it takes from the stash); its backward calls the kept backend's backward
// with the recompute's query/key/value and the kept output and log-sum-exp, as
// PyTorch's derivative does. Both halves are ops, so torch.compile can trace the node.
struct ReplayFunction : public torch::autograd::Function<ReplayFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& anchor, int64_t slot,
                            const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                            std::optional<double> scale, bool enable_gqa) {
    static auto take = op_named("attnstash::_replay_take")
                           .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>>(
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                               const std::optional<at::Tensor>&, double, bool, std::optional<double>, bool)>();
    at::Tensor output, logsumexp, info;
    std::vector<at::Tensor> extra;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(output, logsumexp, info, extra) =
          take.call(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa);
    }
    // The caller's mask, as it came: _replay_backward makes it what the kept backend got.
    // (Saving the additive one would hold a new [B, 1, Sq, Sk] tensor until backward.)
    at::Tensor mask = attn_mask.value_or(at::Tensor());
    variable_list saved = {query, key, value, mask, output, logsumexp, info};
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
    variable_list grad_inputs(10);  // one per forward argument; anchor and mask get none
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return grad_inputs;  // the fused backwards do not check this themselves
    variable_list saved = ctx->get_saved_variables();
    std::optional<at::Tensor> mask;
    if (saved[3].defined()) mask = saved[3];
    std::vector<at::Tensor> extra(saved.begin() + 7, saved.end());
    SdpaCall c = saved_call(ctx, saved[0], saved[1], saved[2], mask);
    std::tie(grad_inputs[0], grad_inputs[1], grad_inputs[2]) =
        backward_op.call(grad, c.query, c.key, c.value, c.attn_mask, saved[4], saved[5], saved[6], extra, c.dropout_p,
                         c.is_causal, c.scale, c.enable_gqa);
    return grad_inputs;
  }
};

// Non-reentrant checkpointing: the first forward's own node is the one whose backward
// runs, and the recompute only refills the tensors it saved. So the first forward keeps
// output and log-sum-exp in the stash (out of the checkpoint's reach) and saves only
// query, key, value and mask, which the checkpoint frees and refills; the recompute runs
// the same node over the kept output, saving the same tensors, without running attention;
// and the first forward's backward takes the entry and calls the kept backend's backward.
struct KeptGraphFunction : public torch::autograd::Function<KeptGraphFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& anchor, int64_t slot,
                            const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                            std::optional<double> scale, bool enable_gqa, bool recompute) {
    SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
    at::Tensor output = recompute ? output_for_recompute(call, anchor, slot)
                                  : keep_forward(call, anchor, slot, /*with_graph=*/true);
    ctx->save_for_backward({query, key, value, attn_mask.value_or(at::Tensor())});
    ctx->saved_data["anchor"] = anchor.detach();  // the key to take in backward (not checkpointed)
    ctx->saved_data["slot"] = slot;
    save_flags(ctx, dropout_p, is_causal, scale, enable_gqa);
    ctx->set_materialize_grads(false);
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list grad_inputs(11);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return grad_inputs;
    variable_list saved = ctx->get_saved_variables();
    std::optional<at::Tensor> mask;
    if (saved[3].defined()) mask = saved[3];
    SdpaCall call = saved_call(ctx, saved[0], saved[1], saved[2], mask);
    // Checked against the caller's mask; the backend gets it as the fused op got it. The
    // backend is this forward's own, whatever sdpa_kernel context the backward runs in.
    std::unique_ptr<KeptEntry> entry = take_for_replay(call, ctx->saved_data["anchor"].toTensor(),
                                                       ctx->saved_data["slot"].toInt(), /*check_backend=*/false);
    const KeptAttention& kept = entry->attention;
    std::optional<at::Tensor> fused = fused_attn_mask(mask, call.query, *kept.backend);
    SdpaCall fused_call{call.query, call.key, call.value, fused, call.dropout_p, call.is_causal, call.scale,
                        call.enable_gqa};
    std::tie(grad_inputs[0], grad_inputs[1], grad_inputs[2]) = kept.backend->backward(grad, fused_call, kept);
    return grad_inputs;
  }
};

at::Tensor sdpa_replay_autograd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                                double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  return ReplayFunction::apply(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

at::Tensor sdpa_fwd_keep_autograd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& anchor, int64_t slot, const std::optional<at::Tensor>& attn_mask,
                                  double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  switch (phase_of(anchor)) {
    case Phase::recompute:
      // Traced (torch.compile), the reentrant replay is the one that can be: both its
      // halves are ops. A non-reentrant recompute under torch.compile is refused below.
      if (!traced(anchor) && kept_with_graph(anchor, slot))  // non-reentrant: refill, keep holding
        return KeptGraphFunction::apply(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale,
                                        enable_gqa, /*recompute=*/true);
      return sdpa_replay_autograd(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale,
                                  enable_gqa);
    case Phase::graph_forward:
      TORCH_CHECK(!traced(query) && !traced(anchor),
                  "attnstash::sdpa_fwd_keep: torch.compile is tracing the activation checkpoint itself (it turns "
                  "torch.utils.checkpoint, reentrant or not, into its own recomputation), where nothing can be "
                  "kept. Compile the checkpointed function and checkpoint the compiled one: "
                  "checkpoint(torch.compile(block), x, use_reentrant=True).");
      return KeptGraphFunction::apply(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale,
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
        return sdpa_plain({query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa});
      }
      break;
    case Phase::first_forward:
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
}

}  // namespace attnstash
