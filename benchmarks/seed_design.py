"""A prototype of the design the seed pull request describes, for measurement only: what
attnstash's host cost is compared with (`python -m benchmarks --mode instructions`). Never part
of the package. Reentrant checkpointing of a transformers decoder on CPU, no mask, no dropout:

  - transformers' "sdpa" entry in ALL_ATTENTION_FUNCTIONS is wrapped; attention modules outside
    a stashed layer call the original function;
  - a forward pre-hook on each stashed layer records its input's key (data pointer, version,
    shape);
  - the first forward (grad off, the layer input requires grad) calls the fused forward op that
    F.sdpa dispatches to, with its log-sum-exp, and keeps both in a dict under that key; the
    entry is released with that input (weakref.finalize);
  - the recompute (grad on, inside a backward) returns the kept output from an autograd.Function
    whose backward is the fused op's backward, called with the arguments of PyTorch's derivative.
"""
import weakref

import torch

_aten = torch.ops.aten


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, output, logsumexp, is_causal, scale):
        ctx.save_for_backward(query, key, value, output, logsumexp)
        ctx.is_causal, ctx.scale = is_causal, scale
        return output

    @staticmethod
    def backward(ctx, grad):
        query, key, value, output, logsumexp = ctx.saved_tensors
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), query, key, value, output, logsumexp, 0.0, ctx.is_causal, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


class SeedStash:
    """The stash on a transformers decoder's last `num_layers` layers (None: all)."""

    def __init__(self, model, num_layers=None):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        self.table, self.kept, self.key_of_layer = ALL_ATTENTION_FUNCTIONS, {}, {}
        self.original = self.table["sdpa"]
        layers = list(model.model.layers)
        chosen = layers if num_layers is None else layers[len(layers) - num_layers:]
        self.stashed = {}
        for layer in chosen:
            self.stashed[id(layer.self_attn)] = layer
            layer.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        self.table["sdpa"] = self._attention

    def uninstall(self):
        self.table["sdpa"] = self.original

    def _pre_hook(self, layer, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.key_of_layer[id(layer)] = (hidden, (hidden.data_ptr(), hidden._version, tuple(hidden.shape)))

    def _attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                   **kwargs):
        layer = self.stashed.get(id(module))
        if layer is None or not module.training:
            return self.original(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        if attention_mask is not None or dropout:
            raise RuntimeError("the seed's design keeps no masked or dropout attention")
        hidden, entry = self.key_of_layer[id(layer)]
        is_causal = True if is_causal is None else is_causal
        in_backward = torch._C._current_graph_task_id() != -1
        if not torch.is_grad_enabled() and hidden.requires_grad and not in_backward:
            output, logsumexp = _aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                                  scale=scaling)
            self.kept[entry] = (output, logsumexp)
            weakref.finalize(hidden, self.kept.pop, entry, None)
        elif torch.is_grad_enabled() and in_backward:
            kept = self.kept.pop(entry, None)
            if kept is None:
                raise RuntimeError("a recompute with no kept output")
            output = _Replay.apply(query, key, value, kept[0], kept[1], is_causal, scaling)
        else:
            raise RuntimeError("a training forward of a stashed layer outside a reentrant checkpoint")
        return output.transpose(1, 2).contiguous(), None
