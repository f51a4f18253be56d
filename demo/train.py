"""Train the demo pair: ``python -m demo.train [--out checkpoints] [--quick]``.

Steps: train the tokenizer on the corpus; train the MoE target (cross-entropy + alpha * Switch
balance loss), then the dense draft, each on packed sequences for a wall-clock budget turned
into a fixed step count after timing the first steps; evaluate held-out perplexity and greedy
agreement; save both in HF format with the tokenizer and write TRAINING.md + training_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig, LlamaForCausalLM, MixtralForCausalLM, PreTrainedTokenizerFast

from demo.balance import format_load, switch_balance
from demo.chat_format import ASSISTANT, END, EOS, SYSTEM, USER
from demo.corpus import iter_documents, kind_weights
from demo.evaluate import answering, answering_line, greedy_agreement, perplexity, tool_calls
from demo.models import draft_config, parameter_counts, target_config
from demo.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

# shapes: B batch, T sequence length, V vocabulary


def packed_batches(tokenizer: PreTrainedTokenizerFast, split: str, batch: int, seq_len: int, *,
                   seed: int | None = None, weights: dict[str, float] | None = None) -> Iterator[torch.Tensor]:
    """Endless [B, T] batches in which every document starts inside the row that holds its beginning.

    A row takes whole documents (each ends with EOS) while they fit, then the first tokens of
    the next one, which starts the following row again from its first token. So no row begins
    mid-document: a reply is never trained without the order record or question it answers
    (a plain cut every T tokens did that to most order chats, which are longer than 256 tokens).
    `seed` and `weights` go to `iter_documents`.
    """
    return pack_rows((tokenizer.encode(d.text) for d in iter_documents(split, seed, weights)), batch, seq_len)


def pack_rows(docs: Iterator[list[int]], batch: int, seq_len: int) -> Iterator[torch.Tensor]:
    """Endless [B, T] batches of the token documents `docs` (an endless iterator), packed as
    `packed_batches` describes."""
    pending: list[int] | None = None
    while True:
        rows = []
        for _ in range(batch):
            row: list[int] = []
            while len(row) < seq_len:
                doc = pending if pending is not None else next(docs)
                pending = None
                room = seq_len - len(row)
                if len(doc) > room:
                    pending = doc if len(doc) <= seq_len else doc[room:]  # a document longer than a row continues
                    doc = doc[:room]
                row.extend(doc)
            rows.append(row)
        yield torch.tensor(rows)  # [B, T]


def heldout_rows(tokenizer: PreTrainedTokenizerFast, rows: int = 192, seq_len: int = 512) -> torch.Tensor:
    """The held-out perplexity set: the first ``rows`` packed rows of the held-out split, [rows, seq_len]."""
    return next(packed_batches(tokenizer, "heldout", rows, seq_len))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of peak at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def token_weights(ids: torch.Tensor, markers: dict[str, int], reply_weight: float) -> torch.Tensor:
    """[B, T] loss weights: ``reply_weight`` for the tokens of assistant replies (up to and including
    their <|end|>), 1 elsewhere. Rows start at a document's first token, so a row's first reply
    marker opens its first reply. markers: the ids of the system, user, assistant and end tokens."""
    if reply_weight == 1.0:
        return torch.ones(ids.shape, dtype=torch.float32)
    pos = torch.arange(ids.shape[1]).expand_as(ids)  # [B, T]

    def last_before(mask: torch.Tensor) -> torch.Tensor:  # [B, T] position of the latest marker before each token
        seen = torch.where(mask, pos, -1).cummax(dim=1).values
        return torch.nn.functional.pad(seen[:, :-1], (1, 0), value=-1)

    opened = last_before(ids == markers["assistant"])
    closed = last_before((ids == markers["system"]) | (ids == markers["user"]) | (ids == markers["end"]))
    in_reply = opened > closed
    return torch.where(in_reply, reply_weight, 1.0)


def chat_markers(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The ids of the system, user, assistant and end tokens (`token_weights`' markers)."""
    return {role: tokenizer.convert_tokens_to_ids(tok) for role, tok in
            (("system", SYSTEM), ("user", USER), ("assistant", ASSISTANT), ("end", END))}


def train_model(model: torch.nn.Module, batches: Iterator[torch.Tensor], *, name: str, budget_s: float, peak_lr: float,
                max_steps: int, markers: dict[str, int], reply_weight: float = 1.0, alpha: float = 0.0,
                log_every: int = 100, warmup: int = 30, teacher: torch.nn.Module | None = None) -> dict:
    """Train for ``budget_s`` seconds' worth of steps (capped at ``max_steps``); return loss curve and speed.
    The loss weighs reply tokens ``reply_weight`` times the others (token_weights); the losses reported
    are the plain mean cross-entropy. With a `teacher` (distillation, demo/distill.py) each token's
    loss is KL(teacher || model) between their next-token distributions instead; the losses
    reported are then that mean KL."""
    is_moe = alpha > 0
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    total, losses, tokens, train_time = max_steps, [], 0, 0.0
    bar = tqdm(total=total, desc=f"train {name}", dynamic_ncols=True, mininterval=2.0)
    step, step_times, wall_start = 0, [], time.perf_counter()
    while step < total:
        ids = next(batches)  # [B, T]
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, peak_lr, warmup)
        out = model(input_ids=ids, use_cache=False, output_router_logits=is_moe)
        logits = out.logits[:, :-1]  # [B, T-1, V]
        if teacher is None:
            per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                          reduction="none")  # [B * (T-1)]
        else:
            with torch.no_grad():
                target = teacher(input_ids=ids, use_cache=False).logits[:, :-1].log_softmax(-1)  # [B, T-1, V]
            per_token = torch.nn.functional.kl_div(logits.log_softmax(-1), target, log_target=True,
                                                   reduction="none").sum(-1).reshape(-1)  # [B * (T-1)]
        ce = per_token.mean()
        weights = token_weights(ids, markers, reply_weight)[:, 1:].reshape(-1)  # [B * (T-1)]
        loss = (per_token * weights).sum() / weights.sum()
        if is_moe:
            balance, loads = switch_balance(out.router_logits, model.config.num_experts_per_tok)
            loss = loss + alpha * balance
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        if step > 0:  # step 0 pays one-off allocation costs
            train_time, tokens = train_time + dt, tokens + ids.numel()
        ce = ce.detach()
        losses.append(float(ce))
        if budget_s > 0 and step >= 5 and step % 25 == 5 and step < 0.8 * total:
            # size the run from the measured speed of the recent steps: the machine is shared, so speed drifts;
            # re-planning stops at 80% so the cosine tail runs to its planned end
            recent = step_times[-25:]
            left = budget_s - (time.perf_counter() - wall_start)
            total = max(step + 10, min(max_steps, step + int(left * len(recent) / sum(recent))))
            bar.total = total
            bar.refresh()
            tqdm.write(f"[{name}] step {step}: {ids.numel() * len(recent) / sum(recent):.0f} tokens/s recently -> "
                       f"{total} steps of {ids.numel()} tokens")
        postfix = {"ce": f"{float(ce):.3f}", "lr": f"{opt.param_groups[0]['lr']:.1e}"}
        if is_moe:
            postfix["bal"] = f"{float(balance.detach()):.3f}"
            if step % log_every == 0 or step == total - 1:
                tqdm.write(f"[{name}] step {step} ce {float(ce):.3f} expert load:\n{format_load(loads)}")
        bar.set_postfix(postfix)
        bar.update(1)
        step += 1
    bar.close()
    return {"steps": step, "tokens_per_step": int(ids.numel()), "train_seconds": round(train_time, 1),
            "tokens_per_second": round(tokens / max(train_time, 1e-9), 1), "loss_first": losses[0],
            "loss_last_50": sum(losses[-50:]) / len(losses[-50:]), "losses": losses,
            "final_expert_load": [[f.tolist(), p.detach().tolist()] for f, p in loads] if is_moe else None}


def heldout_prompts(tokenizer: PreTrainedTokenizerFast, n: int) -> list[list[int]]:
    """Held-out chats cut before their last assistant turn, rendered with the generation prompt."""
    prompts = []
    for sample in iter_documents("heldout"):
        if sample.messages is None:
            continue
        prompts.append(tokenizer.apply_chat_template(sample.messages[:-1], add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
        if len(prompts) == n:
            return prompts
    raise AssertionError("unreachable: the document stream is endless")


def save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, folder: Path, stop_ids: list[int]) -> None:
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_ids,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    model.save_pretrained(folder)  # config.json, generation_config.json, model.safetensors
    save_tokenizer(tokenizer, folder)


def lineage_line(report: dict) -> str:
    """Training rows and, for a continued pair, the runs before this one (a TRAINING.md bullet)."""
    line = (f"- Rows of {report['batch']} x {report['seq_len']} tokens, each starting at a document's first token; "
            f"peak learning rate {report.get('peak_lr', {}).get('target', 2e-3):g} (target), "
            f"{report.get('peak_lr', {}).get('draft', 3e-3):g} (draft); reply tokens weigh "
            f"{report.get('reply_weight', 1.0):g}x in the loss.\n")
    if report.get("fresh_target"):
        line += "- The target trained from random weights in this run; the earlier runs below are the draft's.\n"
    for run in report.get("continued_from", []):
        t, d = run["target"], run["draft"]
        line += (f"- Continued from an earlier run: target {t['steps']} x {t['tokens_per_step']} tokens, draft "
                 f"{d['steps']} x {d['tokens_per_step']} tokens, sequence length {run['seq_len']}, reply weight "
                 f"{run.get('reply_weight', 1.0):g}.\n")
    return line


def write_report(out: Path, report: dict) -> None:
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    t, d = report["target"], report["draft"]
    md = f"""# Demo pair: how it was trained

Made by `python -m demo.train` (corpus: `demo/corpus.py`, tokenizer: `demo/tokenizer.py`). Torch threads: {report['threads']}.

| | demo-moe (target) | demo-draft |
|---|---|---|
| family | Mixtral (`MixtralForCausalLM`) | Llama (`LlamaForCausalLM`) |
| shape | {t['shape']} | {d['shape']} |
| parameters, total | {t['params']['total']:,} | {d['params']['total']:,} |
| parameters active per token (non-embedding + lm_head) | {t['params']['active_per_token']:,} | {d['params']['active_per_token']:,} |
| training steps x tokens/step | {t['train']['steps']} x {t['train']['tokens_per_step']} | {d['train']['steps']} x {d['train']['tokens_per_step']} |
| training speed | {t['train']['tokens_per_second']:,.0f} tokens/s | {d['train']['tokens_per_second']:,.0f} tokens/s |
| training time | {t['train']['train_seconds']:.0f} s | {d['train']['train_seconds']:.0f} s |
| train loss, first step -> mean of last 50 | {t['train']['loss_first']:.3f} -> {t['train']['loss_last_50']:.3f} | {d['train']['loss_first']:.3f} -> {d['train']['loss_last_50']:.3f} |
| held-out perplexity | {t['heldout_perplexity']:.3f} | {d['heldout_perplexity']:.3f} |

- Compute ratio (target active / draft active): **{report['compute_ratio']:.2f}x**.
- Tokenizer: byte-level BPE, {report['tokenizer_size']} tokens (model vocab {report['vocab_size']}); special tokens
  `<|endoftext|>` (EOS/BOS/pad, id 0), `<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>`; generation stops at
  `<|end|>` or `<|endoftext|>` (`generation_config.json`).
- Switch load-balancing loss, alpha = {report['alpha']}; final per-layer N * sum f_i P_i: {', '.join(f'{x:.3f}' for x in report['final_balance'])} (1.0 = even).
- Greedy agreement, draft vs target, on {report['agreement']['prompts']} held-out chat prompts x up to
  {report['agreement_new_tokens']} target-greedy tokens ({report['agreement']['positions']} positions): **{100 * report['agreement']['agreement']:.1f}%**
  (mean per prompt {100 * report['agreement']['mean_per_prompt']:.1f}%). This is the acceptance rate to expect from greedy speculative decoding.
{answering_line(report.get('answering'))}{lineage_line(report)}- Total wall time: {report['wall_seconds']:.0f} s.
"""
    (out / "TRAINING.md").write_text(md)


def _lineage(earlier: dict | None) -> list[dict]:
    """Every earlier run this pair continues, oldest first: steps, tokens per step and sequence length of each."""
    if earlier is None:
        return []
    run = {part: {"steps": earlier[part]["train"]["steps"], "tokens_per_step": earlier[part]["train"]["tokens_per_step"]}
           for part in ("target", "draft")}
    return [*earlier.get("continued_from", []),
            {**run, "seq_len": earlier["seq_len"], "reply_weight": earlier.get("reply_weight", 1.0)}]


def shape_of(cfg) -> str:
    s = f"d={cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV, "
    if hasattr(cfg, "num_local_experts"):
        return s + f"{cfg.num_local_experts} experts top-{cfg.num_experts_per_tok}, expert intermediate {cfg.intermediate_size}"
    return s + f"intermediate {cfg.intermediate_size}"


def _kind_weights(text: str) -> dict[str, float]:
    """'order_status=0.4,price=0.2' -> {'order_status': 0.4, 'price': 0.2}, kinds checked."""
    try:
        weights = {kind.strip(): float(w) for kind, w in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KIND=WEIGHT,...") from None
    try:
        kind_weights(weights)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return weights


def main(argv: list[str] | None = None) -> dict:
    """Train, evaluate and save the demo pair; returns the report dict."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="checkpoints", help="folder for demo-moe/, demo-draft/ and the report")
    ap.add_argument("--quick", action="store_true", help="a minuscule pair for a few steps (tests)")
    ap.add_argument("--moe-minutes", type=float, default=12.0)
    ap.add_argument("--draft-minutes", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512, help="every demo document fits in 512 tokens")
    ap.add_argument("--moe-lr", type=float, default=2e-3, help="peak learning rate of the target")
    ap.add_argument("--draft-lr", type=float, default=3e-3, help="peak learning rate of the draft")
    ap.add_argument("--reply-weight", type=float, default=4.0,
                    help="loss weight of assistant reply tokens against 1 for the rest (prompts, records)")
    ap.add_argument("--init-from", metavar="DIR",
                    help="continue training the pair in DIR (its demo-moe/, demo-draft/ and tokenizer) instead of "
                         "starting from random weights")
    ap.add_argument("--kind-weights", type=_kind_weights, default=None, metavar="KIND=W,...",
                    help="how often each kind of training document is drawn, e.g. order_status=0.4 (demo/corpus.py's "
                         "kind_weights; the held-out set keeps the corpus' own mix)")
    ap.add_argument("--fresh-target", action="store_true",
                    help="with --init-from: the target starts from random weights (the tokenizer and draft continue)")
    ap.add_argument("--seed", type=int, default=0, help="0: the corpus' training stream; others: another stream")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quick = args.quick
    batch, seq_len = (4, 64) if quick else (args.batch, args.seq_len)
    moe_steps, draft_steps, budget_moe, budget_draft = (30, 30, 0, 0) if quick else (100_000, 100_000, args.moe_minutes * 60, args.draft_minutes * 60)

    earlier = None
    if args.init_from:
        src = Path(args.init_from)
        tokenizer = load_tokenizer(src / "demo-moe")
        earlier = json.loads((src / "training_report.json").read_text())
    else:
        tokenizer = train_tokenizer(vocab_size=512 if quick else 2048, n_docs=300 if quick else 4000)
    vocab = 64 * math.ceil(len(tokenizer) / 64)  # padded to a multiple of 64 (rows past the tokenizer are never targets)
    stop_ids = [tokenizer.convert_tokens_to_ids(END), tokenizer.convert_tokens_to_ids(EOS)]
    heldout = heldout_rows(tokenizer, 8 if quick else 192, seq_len)
    alpha = 0.02

    torch.manual_seed(args.seed)
    if args.init_from and not args.fresh_target:
        target = MixtralForCausalLM.from_pretrained(src / "demo-moe")
    else:
        target = MixtralForCausalLM(target_config(vocab, quick))
    torch.manual_seed(args.seed + 1)
    if args.init_from:
        draft = LlamaForCausalLM.from_pretrained(src / "demo-draft")
    else:
        draft = LlamaForCausalLM(draft_config(vocab, quick))
    t_params, d_params = parameter_counts(target), parameter_counts(draft)
    ratio = t_params["active_per_token"] / d_params["active_per_token"]
    print(f"target: {t_params['total']:,} params, {t_params['active_per_token']:,} active per token; "
          f"draft: {d_params['total']:,} params, {d_params['active_per_token']:,} active; compute ratio {ratio:.2f}x")

    weighting = {"markers": chat_markers(tokenizer), "reply_weight": args.reply_weight}
    # seed 0: the corpus' own training stream; another seed, another stream (fresh documents for a continued run)
    stream = {"seed": None if args.seed == 0 else f"train-{args.seed}", "weights": kind_weights(args.kind_weights)}
    t_train = train_model(target, packed_batches(tokenizer, "train", batch, seq_len, **stream), name="demo-moe", budget_s=budget_moe,
                          peak_lr=args.moe_lr, max_steps=moe_steps, alpha=alpha, log_every=10 if quick else 100,
                          **weighting)
    d_train = train_model(draft, packed_batches(tokenizer, "train", batch, seq_len, **stream), name="demo-draft",
                          budget_s=budget_draft, peak_lr=args.draft_lr, max_steps=draft_steps, **weighting)

    # save before the (slow) evaluation, so a crash there loses no training
    save(target, tokenizer, out / "demo-moe", stop_ids)
    save(draft, tokenizer, out / "demo-draft", stop_ids)
    t_ppl, d_ppl = perplexity(target, heldout), perplexity(draft, heldout)
    n_new = 8 if quick else 32
    agreement = greedy_agreement(target, draft, heldout_prompts(tokenizer, 4 if quick else 64), n_new, stop_ids)
    print(f"held-out perplexity: target {t_ppl:.3f}, draft {d_ppl:.3f}; greedy agreement {100 * agreement['agreement']:.1f}%")
    answers = answering(target, tokenizer, 8 if quick else 200, stop_ids=stop_ids) | {
        "tool_calls": tool_calls(target, tokenizer, 4 if quick else 100)}
    print(answering_line(answers), end="")

    n = target.config.num_local_experts
    report = {
        "quick": quick, "threads": args.threads, "seed": args.seed, "alpha": alpha, "vocab_size": vocab,
        "tokenizer_size": len(tokenizer), "batch": batch, "seq_len": seq_len,
        "target": {"shape": shape_of(target.config), "params": t_params, "heldout_perplexity": t_ppl, "train": t_train},
        "draft": {"shape": shape_of(draft.config), "params": d_params, "heldout_perplexity": d_ppl, "train": d_train},
        "compute_ratio": ratio, "agreement": agreement, "agreement_new_tokens": n_new, "answering": answers,
        "final_balance": [n * sum(f * p for f, p in zip(fs, ps)) for fs, ps in t_train["final_expert_load"]],
        "wall_seconds": time.perf_counter() - start, "peak_lr": {"target": args.moe_lr, "draft": args.draft_lr},
        "reply_weight": args.reply_weight, "kind_weights": stream["weights"],
        "continued_from": _lineage(earlier), "fresh_target": bool(args.fresh_target),
    }
    write_report(out, report)
    return report


if __name__ == "__main__":
    main()
