"""Held-out measures of the demo pair: perplexity, the draft's greedy agreement with the target,
and whether replies answer the question.

Greedy agreement is the acceptance rate to expect from greedy speculative decoding: for each
held-out prompt, the target writes its own greedy continuation; then both models read
prompt + continuation in one teacher-forced pass, and we count the positions where the
draft's argmax equals the target's argmax.

Answering: held-out chats are cut before their last reply; the model's greedy reply is checked
for the facts the reference reply states and the prompt or the menu fixes: order ids, SKUs, rupee
amounts, pin codes, time slots, store names, the customer's name, "quantity x product", and in
JSON replies the status, total, slot, customer, SKUs and quantities. E.g. "What was the total?"
must be answered with that order's total, and "Where is my order?" with its items and store.
Names right: of the replies whose reference names the customer, those naming the right one.

Tool calls: held-out chats that list functions and call one, asked as a named `tool_choice` asks
(the prompt ends with the call's opening, `ToolCalling.call_prefix`), without a grammar: the share
whose arguments equal the reference's (`tool_call_args`), by function.
`python -m demo.evaluate --model DIR [--draft DIR]`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict

import torch

from demo.bakery import FIRST_NAMES, PRODUCTS, STORES

# shapes: B sequences, T positions, V vocabulary


@torch.no_grad()
def perplexity(model: torch.nn.Module, sequences: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token cross-entropy) over packed held-out sequences [N, T]."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, sequences.shape[0], batch_size):
        ids = sequences[start:start + batch_size]  # [B, T]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # [B, T-1, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total, count = total + float(loss), count + ids[:, 1:].numel()
    return math.exp(total / count)


@torch.no_grad()
def greedy_agreement(target: torch.nn.Module, draft: torch.nn.Module, prompts: list[list[int]],
                     new_tokens: int = 32, stop_ids: list[int] | None = None) -> dict[str, float]:
    """Fraction of continuation positions where argmax(draft) == argmax(target), over all prompts."""
    target.eval()
    draft.eval()
    matches = positions = 0
    per_prompt = []
    for prompt in prompts:
        ids = torch.tensor([prompt])  # [1, T]
        full = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=stop_ids,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))  # [1, T + n]
        n = full.shape[1] - ids.shape[1]
        if n == 0:
            continue
        # position t predicts token t+1: the continuation is predicted from positions T-1 .. T+n-2
        window = slice(ids.shape[1] - 1, full.shape[1] - 1)
        t_arg = target(input_ids=full, use_cache=False).logits[0, window].argmax(-1)  # [n]
        d_arg = draft(input_ids=full, use_cache=False).logits[0, window].argmax(-1)  # [n]
        hit = int((t_arg == d_arg).sum())
        matches, positions = matches + hit, positions + n
        per_prompt.append(hit / n)
    return {"agreement": matches / max(positions, 1), "mean_per_prompt": sum(per_prompt) / max(len(per_prompt), 1),
            "positions": positions, "prompts": len(per_prompt)}


NAME_PATTERNS = (rf"(?:Hi|welcome,) (?:{'|'.join(FIRST_NAMES)})!", r'"customer": ?"[^"]*"')  # whose order
FACT_PATTERNS = NAME_PATTERNS + (
    r"ORD-\d{6}", r"CRB-\d{3}", r"₹\d(?:[\d,]*\d)?", r"(?<![\w-])\d{6}\b", r"\b\d{1,2}:\d{2} [ap]m\b",
    rf"\b(?:{'|'.join(re.escape(s.name) for s in STORES)})\b",  # which store
    rf"\b\d x (?:{'|'.join(re.escape(p.name) for p in PRODUCTS)})",  # what was ordered, and how many
    r'"(?:status|total|slot|sku|qty)": ?(?:"[^"]*"|\d+)',  # the fields of a JSON reply
)


def facts(text: str, patterns: tuple[str, ...] = FACT_PATTERNS) -> set[str]:
    """The checkable facts a reply states (see the module docstring)."""
    return {m.replace(" ", "") for p in patterns for m in re.findall(p, text)}


@torch.no_grad()
def answering(model: torch.nn.Module, tokenizer, n: int = 200, max_new_tokens: int = 320,
              stop_ids: list[int] | None = None) -> dict:
    """Greedy replies to the first `n` held-out chats whose reference reply states facts: the
    share of those facts the reply states (recall), and of replies stating all of them."""
    from demo.corpus import iter_documents

    model.eval()
    found = total = right = replies = named = names_right = 0
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for sample in iter_documents("heldout"):
        if replies == n:
            break
        if sample.messages is None or not facts(sample.messages[-1]["content"]):
            continue
        want = facts(sample.messages[-1]["content"])
        ids = torch.tensor([tokenizer.apply_chat_template(sample.messages[:-1], add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_ids,
                             pad_token_id=0, attention_mask=torch.ones_like(ids))
        reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        got = facts(reply)
        hit = len(want & got)
        if names := facts(sample.messages[-1]["content"], NAME_PATTERNS):
            named, names_right = named + 1, names_right + (names <= facts(reply, NAME_PATTERNS))
        found, total, replies = found + hit, total + len(want), replies + 1
        right += hit == len(want)
        kind = sample.kind
        if kind == "json_answer":
            kind += " (status)" if "Order record:" in sample.messages[0]["content"] else " (new order)"
        by_kind[kind][0] += hit == len(want)
        by_kind[kind][1] += 1
    return {"replies": replies, "fact_recall": found / max(total, 1), "all_facts_right": right / max(replies, 1),
            "all_facts_right_by_kind": {k: round(a / b, 3) for k, (a, b) in sorted(by_kind.items())},
            "named_replies": named, "names_right": names_right / max(named, 1)}


@torch.no_grad()
def tool_calls(model: torch.nn.Module, tokenizer, n: int = 100, max_new_tokens: int = 64) -> dict:
    """The first `n` held-out chats that call a function, asked as a named tool_choice asks (see the
    module docstring): the share whose arguments are exactly the reference's, overall and by function."""
    from demo.corpus import iter_documents, tool_call_args
    from moeserve.tokenizer import hermes_call, render_chat

    model.eval()
    by_name: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for sample in iter_documents("heldout"):
        if sum(b for _, b in by_name.values()) == n:
            break
        if sample.kind != "tool_call" or (call := tool_call_args(sample.openai_messages)) is None:
            continue
        name, args = call
        asked = sample.openai_messages[: next(i for i, m in enumerate(sample.openai_messages) if m.get("tool_calls"))]
        prompt = render_chat(tokenizer, asked, tools=sample.tools, call_prefix=hermes_call(name))
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        try:
            got = json.JSONDecoder().raw_decode(text.lstrip())[0]
        except json.JSONDecodeError:
            got = None
        by_name[name][0] += got == args
        by_name[name][1] += 1
    calls = sum(b for _, b in by_name.values())
    return {"calls": calls, "arguments_right": sum(a for a, _ in by_name.values()) / max(calls, 1),
            "arguments_right_by_function": {k: round(a / b, 3) for k, (a, b) in sorted(by_name.items())}}


def answering_line(a: dict | None) -> str:
    """The answering result as a TRAINING.md bullet ('' when not measured)."""
    if not a:
        return ""
    kinds = ", ".join(f"{k} {100 * v:.0f}%" for k, v in a["all_facts_right_by_kind"].items())
    line = (f"- Answering, greedy, on {a['replies']} held-out chats whose reply states facts: **{100 * a['fact_recall']:.1f}%** "
            f"of the facts stated (ids, SKUs, amounts, pins, slots, stores, names, items), **{100 * a['all_facts_right']:.1f}%** of replies with all "
            f"of them ({kinds}).\n")
    if "names_right" in a:
        line += f"- Customer names right in {a['named_replies']} replies that name one: **{100 * a['names_right']:.1f}%**.\n"
    if calls := a.get("tool_calls"):
        by = ", ".join(f"{k} {100 * v:.0f}%" for k, v in calls["arguments_right_by_function"].items())
        line += (f"- Tool calls, named as `tool_choice` names them, no grammar, on {calls['calls']} held-out chats: "
                 f"**{100 * calls['arguments_right']:.1f}%** with every argument right ({by}).\n")
    return line


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    ap = argparse.ArgumentParser(description="held-out measures of a demo checkpoint (answering; with --draft also "
                                             "perplexity of both models and their greedy agreement)")
    ap.add_argument("--model", default="checkpoints/demo-moe")
    ap.add_argument("--draft", metavar="DIR", help="a draft checkpoint to measure beside the model")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--update-report", metavar="DIR", help="add the result to DIR/training_report.json and TRAINING.md")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    stop = GenerationConfig.from_pretrained(args.model).eos_token_id
    stop_ids = stop if isinstance(stop, list) else [stop]
    report = {"answering": answering(model, tokenizer, args.n, stop_ids=stop_ids) | {"tool_calls": tool_calls(model, tokenizer)}}
    if args.draft:
        from demo.train import heldout_prompts, heldout_rows

        draft = AutoModelForCausalLM.from_pretrained(args.draft)
        heldout = heldout_rows(tokenizer)
        report["perplexity"] = {"target": perplexity(model, heldout), "draft": perplexity(draft, heldout)}
        report["agreement"] = greedy_agreement(model, draft, heldout_prompts(tokenizer, 64), 32, stop_ids)
    print(json.dumps(report, indent=1))
    if args.update_report:
        from pathlib import Path

        from demo.train import write_report

        folder = Path(args.update_report)
        full = json.loads((folder / "training_report.json").read_text())
        write_report(folder, {**full, "answering": report["answering"]})
    return report


if __name__ == "__main__":
    main()
