"""A tiny model, tokenizer and datasets in a folder, for the tests that run fine-tuning tools'
command lines: a LlamaForCausalLM saved with save_pretrained, a byte-level BPE tokenizer trained
here with the `tokenizers` library (ChatML chat template), and JSON-lines datasets (chat, text,
alpaca). Nothing is downloaded.

    python tests/python/tiny_assets.py OUT      writes OUT/model, OUT/chat/train.jsonl, ...
"""
import json
import sys
from pathlib import Path

SENTENCES = ["hello world", "the cat sat on the mat", "a dog ran in the park", "what is two plus two",
             "two plus two is four", "the sky is blue", "tell me a joke", "why did the chicken cross the road",
             "to get to the other side"]
PAIRS = [("what is two plus two", "two plus two is four"), ("tell me a joke", "why did the chicken cross the road"),
         ("what color is the sky", "the sky is blue"), ("say hello", "hello world")]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write(out):
    """Writes the assets under `out`; returns {name: path}."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=256, special_tokens=specials,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="<|im_end|>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = CHATML
    model_dir = out / "model"
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    rows = {"chat": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                     for q, a in PAIRS * 8],
            "text": [{"text": s} for s in SENTENCES * 4],
            "alpaca": [{"instruction": q, "input": "", "output": a} for q, a in PAIRS * 8]}
    paths = {"model": model_dir}
    for name, data in rows.items():
        path = out / name / "train.jsonl"  # a folder each: `trl sft --dataset_name` takes a folder
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in data))
        paths[name] = path
    return paths


if __name__ == "__main__":
    print(write(sys.argv[1]))
