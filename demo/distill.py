"""Distil the demo draft from the demo target: ``python -m demo.distill [--minutes M] [--pair DIR]``.

Speculative decoding keeps a draft token only where the target would have written it, so a
draft is worth what it agrees with its target. Trained on the corpus alone, the demo draft
agrees where the corpus decides (98% of positions on held-out chats) and much less where it
does not: asked for a poem or a history lesson, the target improvises a bakery reply (an order
number, an amount, a product) and the draft improvises another one (81% on off-domain asks).
Here the draft learns the target's own next-token distributions instead (forward
KL(target || draft) at every position, reply tokens weighed 4x, as in demo/train.py) on:

- the target's replies to off-domain asks made from templates (`ASKS` x `TOPICS`), greedy and
  sampled (T = 0.8), written by moeserve's engine; the benchmarks' free-form prompts
  (demo/prompts.py) are not among them, and are only used to report the agreement reached;
- rows of the training corpus, half of every batch, so held-out chats keep their agreement.

The draft is saved in place (or to --out); training_report.json gets a "distillation" entry and
TRAINING.md a section between DISTILL_BEGIN and DISTILL_END, replaced by a later run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, MixtralForCausalLM

from demo.chat_format import END, EOS
from demo.evaluate import greedy_agreement
from demo.tokenizer import load_tokenizer
from demo.train import chat_markers, heldout_prompts, pack_rows, packed_batches, save, train_model
from moeserve.tokenizer import render_chat

ASKS = (
    "Write a short poem about {}.", "Explain {} to a child.", "What is the history of {}?",
    "Give me three facts about {}.", "Describe {} in one paragraph.", "Why do people care about {}?",
    "Tell me a story about {}.", "What are the pros and cons of {}?", "How would you teach {} to a beginner?",
    "Summarise what you know about {}.", "Write a limerick about {}.", "What is the future of {}?",
    "Compare {} with something familiar.", "List five words related to {}.", "Can you help me plan a trip to {}?",
    "What should I read to learn about {}?", "Is {} dangerous?", "Make a quiz question about {}.",
)
TOPICS = (
    "volcanoes", "the Roman Empire", "black holes", "photosynthesis", "chess openings", "the stock market",
    "honeybees", "quantum computing", "the Sahara desert", "jazz music", "the printing press", "penguins",
    "electric cars", "the human heart", "origami", "glaciers", "the Silk Road", "machine learning",
    "coral reefs", "the Moon landing", "ancient Egypt", "recycling", "the Olympic Games", "tea ceremonies",
    "earthquakes", "the internet", "dinosaurs", "solar panels", "Mount Everest", "the violin",
    "sleep", "lighthouses", "the Amazon rainforest", "submarines", "Shakespeare's sonnets", "bicycles",
    "hurricanes", "vaccines", "the Great Wall", "octopuses", "cloud computing", "football",
    "the water cycle", "Kyoto", "meditation", "robots", "the Renaissance", "rainbows",
)
GREEDY_AND_SAMPLED = (0.0, 0.8)  # temperatures of the target's replies to each ask


def offdomain_asks(n: int, seed: int) -> list[str]:
    """n distinct off-domain asks (templates x topics), shuffled by `seed`."""
    asks = [a.format(t) for a, t in itertools.product(ASKS, TOPICS)]
    random.Random(seed).shuffle(asks)
    if n > len(asks):
        raise ValueError(f"at most {len(asks)} distinct asks, asked for {n}")
    return asks[:n]


def target_chats(target_dir: Path, asks: list[str], max_tokens: int = 160) -> list[list[int]]:
    """Token documents: each ask (a user turn) with the target's reply at each of
    GREEDY_AND_SAMPLED's temperatures, rendered and ended as corpus documents are."""
    from moeserve import LLM, SamplingParams

    llm = LLM(str(target_dir), draft="none", max_num_seqs=32)
    tok = llm.tokenizer
    messages = [[{"role": "user", "content": a}] for a in asks]
    prompts = [render_chat(tok, m) for m in messages]
    docs = []
    for i, temperature in enumerate(GREEDY_AND_SAMPLED):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
        for m, out in zip(messages, llm.generate(prompts, params)):
            chat = [*m, {"role": "assistant", "content": out.text}]
            docs.append(tok.encode(render_chat(tok, chat, add_generation_prompt=False) + "\n" + EOS,
                                   add_special_tokens=False))
    return docs


def mixed_batches(corpus: Iterator[torch.Tensor], chats: list[list[int]], batch: int, seq_len: int,
                  seed: int) -> Iterator[torch.Tensor]:
    """[B, T] batches: half corpus rows, half packed target chats (reshuffled every pass)."""
    rng = random.Random(seed)

    def endless() -> Iterator[list[int]]:
        while True:
            order = list(chats)
            rng.shuffle(order)
            yield from order

    chat_rows = pack_rows(endless(), batch - batch // 2, seq_len)
    for rows, more in zip(corpus, chat_rows):
        yield torch.cat([rows[: batch // 2], more])


def agreement(target, draft, prompts: dict[str, list[list[int]]], stop_ids: list[int]) -> dict[str, float]:
    """Greedy agreement (demo/evaluate.py) on each prompt set, up to 96 target tokens each."""
    return {name: greedy_agreement(target, draft, ps, 96, stop_ids)["agreement"] for name, ps in prompts.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="checkpoints", help="folder with demo-moe/ and demo-draft/")
    ap.add_argument("--out", help="where the distilled draft goes (default: PAIR/demo-draft, in place)")
    ap.add_argument("--minutes", type=float, default=10.0, help="training budget")
    ap.add_argument("--asks", type=int, default=640, help="off-domain asks the target answers (x2: greedy, sampled)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=5, help="the corpus stream and the asks' shuffle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a few steps and asks (tests)")
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes, args.asks, args.batch, args.seq_len = 0.0, 8, 4, 128
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    pair = Path(args.pair)
    out = Path(args.out) if args.out else pair / "demo-draft"
    tokenizer = load_tokenizer(pair / "demo-moe")
    target = MixtralForCausalLM.from_pretrained(pair / "demo-moe").eval()
    draft = LlamaForCausalLM.from_pretrained(pair / "demo-draft")
    stop_ids = [tokenizer.convert_tokens_to_ids(END), tokenizer.convert_tokens_to_ids(EOS)]

    asks = offdomain_asks(args.asks + (4 if args.quick else 48), args.seed)
    train_asks, heldout_asks = asks[: args.asks], asks[args.asks :]  # held-out asks: never trained on
    from demo.prompts import free_form  # the benchmarks' own off-domain prompts: reported, never trained on

    n_eval = 2 if args.quick else 24
    evaluation = {
        "held-out chats": heldout_prompts(tokenizer, n_eval),
        "held-out off-domain asks": [tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": a}]),
                                                      add_special_tokens=False) for a in heldout_asks[:n_eval]],
        "benchmark free-form prompts": free_form(tokenizer, 2 if args.quick else 12),
    }
    before = agreement(target, draft, evaluation, stop_ids)
    print("greedy agreement before:", {k: round(v, 4) for k, v in before.items()})

    t0 = time.perf_counter()
    chats = target_chats(pair / "demo-moe", train_asks, max_tokens=16 if args.quick else 160)
    generate_s = time.perf_counter() - t0
    corpus = packed_batches(tokenizer, "train", args.batch // 2, args.seq_len, seed=f"distill-{args.seed}")
    trained = train_model(draft, mixed_batches(corpus, chats, args.batch, args.seq_len, args.seed), name="distill draft",
                          budget_s=args.minutes * 60, peak_lr=args.lr, max_steps=20 if args.quick else 100_000,
                          markers=chat_markers(tokenizer), reply_weight=4.0, teacher=target)
    draft.eval()
    save(draft, tokenizer, out, stop_ids)
    after = agreement(target, draft, evaluation, stop_ids)
    print("greedy agreement after:", {k: round(v, 4) for k, v in after.items()})

    result = {
        "asks": len(train_asks), "chats": len(chats), "chat_tokens": sum(map(len, chats)), "generate_seconds": generate_s,
        "temperatures": list(GREEDY_AND_SAMPLED), "seed": args.seed, "peak_lr": args.lr, "batch": args.batch,
        "seq_len": args.seq_len, "steps": trained["steps"], "tokens_per_step": trained["tokens_per_step"],
        "train_seconds": trained["train_seconds"], "kl_first": trained["loss_first"],
        "kl_last_50": trained["loss_last_50"], "agreement_before": before, "agreement_after": after,
        "wall_seconds": time.perf_counter() - start,
    }
    if out.parent == pair:  # the pair's own draft: its report says how it was made
        write_distill_report(pair, result)
    return result


DISTILL_BEGIN, DISTILL_END = "<!-- distill: written by python -m demo.distill -->", "<!-- /distill -->"


def write_distill_report(pair: Path, result: dict) -> None:
    """Adds `result` to the pair's training_report.json and its section to TRAINING.md."""
    report_path = pair / "training_report.json"
    report = json.loads(report_path.read_text())
    report["distillation"] = [*report.get("distillation", []), result]
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    runs = report["distillation"]
    rows = "\n".join(f"| {name} | {100 * runs[0]['agreement_before'][name]:.1f}% | {100 * result['agreement_after'][name]:.1f}% |"
                     for name in result["agreement_after"])
    section = f"""{DISTILL_BEGIN}
## The draft, distilled from the target

`python -m demo.distill` ({len(runs)} run(s); the last: {result['steps']} steps x {result['tokens_per_step']} tokens,
{result['train_seconds']:.0f} s, KL {result['kl_first']:.3f} -> {result['kl_last_50']:.3f}): the draft learns KL(target || draft)
on half corpus rows, half the target's own replies ({result['chats']} chats, {result['chat_tokens']:,} tokens; greedy and
T = 0.8) to {result['asks']} off-domain asks made from templates. Greedy agreement, draft vs target, up to 96 target tokens:

| prompts | before distillation | after |
|---|---|---|
{rows}

The benchmarks' free-form prompts and the held-out asks are never trained on.
{DISTILL_END}
"""
    md_path = pair / "TRAINING.md"
    md = md_path.read_text()
    if DISTILL_BEGIN in md:
        md = md[: md.index(DISTILL_BEGIN)] + md[md.index(DISTILL_END) + len(DISTILL_END) + 1 :]
    md_path.write_text(md.rstrip("\n") + "\n\n" + section)


if __name__ == "__main__":
    main()
