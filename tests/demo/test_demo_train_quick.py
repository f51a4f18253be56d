"""``python -m demo.train --quick`` makes a loadable HF-format pair whose loss goes down."""

import json

import pytest
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


def test_training_continues_from_a_saved_pair(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    main(["--quick", "--out", str(first), "--threads", "1"])
    report = main(["--quick", "--out", str(second), "--threads", "1", "--init-from", str(first)])
    # same tokenizer, and the weights start where the first run ended: its first loss is the first run's last
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (second / "demo-moe" / name).read_text() == (first / "demo-moe" / name).read_text()
    before = json.loads((first / "training_report.json").read_text())
    for part in ("target", "draft"):
        assert report[part]["train"]["loss_first"] < before[part]["train"]["loss_first"] - 0.1, part
    assert report["continued_from"] == [{"target": {"steps": 30, "tokens_per_step": 256},
                                         "draft": {"steps": 30, "tokens_per_step": 256}, "seq_len": 64,
                                         "reply_weight": 4.0}]
    assert "Continued from an earlier run" in (second / "TRAINING.md").read_text()

    # --fresh-target: the same tokenizer and the draft continue, the target starts again from random weights
    third = tmp_path / "third"
    fresh = main(["--quick", "--out", str(third), "--threads", "1", "--init-from", str(first), "--fresh-target"])
    assert (third / "demo-moe" / "tokenizer.json").read_text() == (first / "demo-moe" / "tokenizer.json").read_text()
    # the same seed: the target starts from the first run's random weights, not where that run ended
    assert fresh["target"]["train"]["loss_first"] == pytest.approx(before["target"]["train"]["loss_first"], abs=0.05)
    assert fresh["draft"]["train"]["loss_first"] < before["draft"]["train"]["loss_first"] - 0.1
    assert fresh["fresh_target"] and "target trained from random weights" in (third / "TRAINING.md").read_text()


def test_token_weights_mark_reply_tokens_and_their_end():
    from demo.train import token_weights

    markers = {"system": 1, "user": 2, "assistant": 3, "end": 4}
    #                     sys  a  end  user b  end  asst c  d  end  eos  user e
    ids = torch.tensor([[1, 10, 4, 2, 11, 4, 3, 12, 13, 4, 0, 2, 14]])
    w = token_weights(ids, markers, 5.0)
    assert w.tolist() == [[1, 1, 1, 1, 1, 1, 1, 5, 5, 5, 1, 1, 1]]
    assert token_weights(ids, markers, 1.0).eq(1).all()
