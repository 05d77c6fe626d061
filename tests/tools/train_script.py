"""A transformers Trainer script, for the launcher tests: trains the tiny assets' model
(tests/python/tiny_assets.py) for 3 steps with reentrant or non-reentrant checkpointing and
writes one JSON file per process, OUT/result-RANK.json (the ranks share one stdout, where their lines
can interleave): its rank, world size, logged losses and attnstash figures.

    accelerate launch --multi_gpu --num_processes 2 tests/tools/train_script.py ASSETS OUT MODE
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

assets, out, mode = sys.argv[1:4]
tokenizer = AutoTokenizer.from_pretrained(os.path.join(assets, "model"))
model = AutoModelForCausalLM.from_pretrained(os.path.join(assets, "model"), attn_implementation="sdpa")
data = load_dataset("json", data_files=os.path.join(assets, "text", "train.jsonl"))["train"]
data = data.map(lambda rows: tokenizer(rows["text"]), batched=True, remove_columns=["text"])
args = TrainingArguments(output_dir=out, use_cpu=True, max_steps=3, logging_steps=1, per_device_train_batch_size=2,
                         report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
                         gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
trainer = Trainer(model=model, args=args, train_dataset=data,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
logs = [h for h in trainer.state.log_history if "loss" in h]
params = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
rank = int(os.environ.get("RANK", 0))
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": dist.get_world_size() if dist.is_initialized() else 1,
               "losses": [h["loss"] for h in logs], "keeps": [h.get("attnstash/keeps") for h in logs],
               "replays": [h.get("attnstash/replays") for h in logs],
               "params": [params.sum().item(), params.abs().sum().item()]}, f)
if dist.is_initialized():  # (left to interpreter exit, gloo's threads can abort a rank: "terminate called ...")
    dist.barrier()
    dist.destroy_process_group()
