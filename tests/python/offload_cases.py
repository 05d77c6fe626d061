"""The models the offload tests train (test_offload_hooks.py, test_offload_own.py): a tiny
transformers Llama (its layers reached through their checkpoint function) and a plain-PyTorch
GPT whose forward checkpoints each block (the module called), under either checkpointing mode."""
import collections

import torch

import tiny_torch_models as plain
from tiny_models import batch, loss_and_grads, tiny_model

MODES = {"reentrant": True, "non-reentrant": False}
KINDS = ["transformers", "plain PyTorch"]

# model; install_attention_stash's keywords for it; its stashed layers; forward(model) -> loss;
# step(model) -> (loss, grads), one forward and backward.
Case = collections.namedtuple("Case", "model install layers forward step")


def build(kind, mode):
    if kind == "transformers":
        model = tiny_model("llama")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": MODES[mode]})
        ids = batch()
        return Case(model, {}, model.model.layers, lambda m: m(input_ids=ids, labels=ids).loss,
                    lambda m: loss_and_grads(m, ids))
    model = plain.gpt(checkpointing=mode)
    return Case(model, {"layers": plain.Block}, model.blocks,
                lambda m: torch.nn.functional.cross_entropy(m(plain.ids()).flatten(0, 1), plain.ids().flatten()),
                lambda m: plain.loss_and_grads(m, plain.ids()))
