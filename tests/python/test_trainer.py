"""The Hugging Face training stack: transformers.Trainer with reentrant gradient
checkpointing and the stash installed, with and without a PEFT LoRA adapter, trains to
the same losses and weights as without the stash, and ends with the stash empty."""
import pytest
import torch
import transformers

import attnstash
from tiny_models import VOCAB, tiny_model

peft = pytest.importorskip("peft")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows=12, seq=24):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (rows, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(tmp_path, lora, stash, reentrant=True):
    model = tiny_model("qwen3_moe", seed=0)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    if stash:
        attnstash.install_attention_stash(model, 3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    keeps = attnstash.stash_stats()["keeps"]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    kept = attnstash.stash_stats()["keeps"] - keeps
    if stash:
        attnstash.uninstall_attention_stash(model)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, weights, kept


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_trainer_with_the_stash_trains_like_without(tmp_path, lora, reentrant):
    losses, weights, _ = train(tmp_path / "plain", lora, stash=False, reentrant=reentrant)
    stashed_losses, stashed_weights, kept = train(tmp_path / "stash", lora, stash=True, reentrant=reentrant)
    assert len(losses) == 4 and stashed_losses == losses
    assert weights.keys() == stashed_weights.keys()
    assert all(torch.equal(weights[n], stashed_weights[n]) for n in weights)
    assert kept == 3 * 4  # every stashed layer kept (and replayed) once per step
    assert attnstash.stash_stats()["entries"] == 0 and attnstash.stash_stats()["bytes"] == 0
