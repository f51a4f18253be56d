"""``python -m demo.distill``: the draft learns the target's distributions; the off-domain asks
never include the benchmarks' free-form prompts."""

import copy
import json

import torch
from transformers import LlamaForCausalLM, MixtralForCausalLM

from demo.distill import DISTILL_BEGIN, DISTILL_END, main, offdomain_asks
from demo.prompts import FREE_FORM
from demo.tokenizer import load_tokenizer
from demo.train import heldout_rows, train_model
from demo.train import main as train_main


def _kl(target, draft, ids) -> float:
    """Mean KL(target || draft) over the next-token distributions of `ids` [B, T]."""
    with torch.no_grad():
        p = target(input_ids=ids).logits.log_softmax(-1)
        q = draft(input_ids=ids).logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_distillation_brings_the_draft_toward_the_target(tmp_path):
    train_main(["--quick", "--out", str(tmp_path), "--threads", "1"])
    target = MixtralForCausalLM.from_pretrained(tmp_path / "demo-moe")
    ids = heldout_rows(load_tokenizer(tmp_path / "demo-moe"), 4, 64)  # held-out corpus text
    before = _kl(target, LlamaForCausalLM.from_pretrained(tmp_path / "demo-draft"), ids)
    result = main(["--quick", "--pair", str(tmp_path), "--threads", "1"])
    after = _kl(target, LlamaForCausalLM.from_pretrained(tmp_path / "demo-draft"), ids)
    assert after < 0.7 * before, (before, after)
    assert result["kl_last_50"] < result["kl_first"]
    assert result["chats"] == 2 * result["asks"] and result["chat_tokens"] > result["chats"]
    # the pair's report says how its draft was made; a second run replaces the TRAINING.md section
    main(["--quick", "--pair", str(tmp_path), "--threads", "1"])
    assert len(json.loads((tmp_path / "training_report.json").read_text())["distillation"]) == 2
    md = (tmp_path / "TRAINING.md").read_text()
    assert md.count(DISTILL_BEGIN) == 1 and md.count(DISTILL_END) == 1 and "(2 run(s)" in md
    assert md.index("# Demo pair") < md.index(DISTILL_BEGIN)  # the training part stays above it


def test_offdomain_asks_are_distinct_and_never_the_benchmark_prompts():
    asks = offdomain_asks(500, seed=5)
    assert len(set(asks)) == 500
    assert not set(asks) & set(FREE_FORM)
    assert asks == offdomain_asks(500, seed=5) and asks != offdomain_asks(500, seed=6)


def test_a_teacher_equal_to_the_model_costs_nothing():
    """With the model as its own teacher the KL is zero: the oracle of the loss."""
    torch.manual_seed(0)
    from demo.models import draft_config

    model = LlamaForCausalLM(draft_config(64, quick=True))
    teacher = copy.deepcopy(model).eval()
    batches = iter([torch.randint(1, 60, (2, 16))] * 3)
    result = train_model(model, batches, name="self", budget_s=0, peak_lr=1e-3, max_steps=3,
                         markers={"system": 1, "user": 2, "assistant": 3, "end": 4}, teacher=teacher)
    assert abs(result["loss_first"]) < 1e-6
