"""``python -m demo.train --quick`` makes a loadable HF-format pair whose loss goes down."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from demo.train import main


def test_quick_training_makes_loadable_pair(tmp_path):
    report = main(["--quick", "--out", str(tmp_path), "--threads", "1"])
    for name, arch in (("demo-moe", "MixtralForCausalLM"), ("demo-draft", "LlamaForCausalLM")):
        folder = tmp_path / name
        assert (folder / "model.safetensors").exists()
        model = AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert type(model).__name__ == arch
        assert model.config.vocab_size >= len(tokenizer)
        end_id = tokenizer.convert_tokens_to_ids("<|end|>")
        assert GenerationConfig.from_pretrained(folder).eos_token_id == [end_id, tokenizer.eos_token_id]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            assert model(input_ids=ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)

    for part in ("target", "draft"):
        losses = report[part]["train"]["losses"]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, part
    assert report["compute_ratio"] > 1
    saved = json.loads((tmp_path / "training_report.json").read_text())
    assert saved["target"]["params"]["total"] > saved["draft"]["params"]["total"]
    assert report["answering"]["replies"] == 8 and 0 <= report["answering"]["fact_recall"] <= 1
    assert "Answering, greedy" in (tmp_path / "TRAINING.md").read_text()
