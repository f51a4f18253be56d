"""docs/scaling.md from the scale model's checks (bench/scale_checks.py): the checks table and
its verdict, the misses' explanations, and the plots.

    python -m bench.scale_model --report          # writes docs/scaling.md and its plots
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.scale_checks import DEEPEP_LOW_LATENCY, DEMO, TOLERANCE, Check, checks, served
from bench.scale_model import DOCS, HARDWARE, Layout, a2a_ms, best_layout, load_shape, skew_from_stats, step


def checks_table(rows: list[Check]) -> str:
    from bench.report import markdown_table

    return markdown_table(["check", "model", "measured / published", "error", "verdict", "source"],
                          [[c.name, c.model, c.actual, f"{c.error:+.0%}", c.verdict, c.source] for c in rows])


def verdict(rows: list[Check]) -> str:
    """The table's closing line: how many checks hold, and every miss by name."""
    counted = [c for c in rows if not c.fitted]
    misses = [c for c in counted if c.verdict == "miss"]
    fitted = "; ".join(c.name.split(":")[0] for c in rows if c.fitted)
    text = f"**{len(counted) - len(misses)} of {len(counted)} checks are within {TOLERANCE:.0%}** (not counted: {fitted}, the fit). "
    if not misses:
        return text + "None misses."
    return (text + f"**{len(misses)} miss**: "
            + "; ".join(f"{c.name.split(':')[0]} ({c.error:+.0%})" for c in misses) + ".")


def served_notes(rows: list[Check]) -> dict[str, str]:
    """The misses' explanations with the numbers the generator has, so the prose cannot drift
    from the table: where the SGLang step goes, and what the wide-EP row says at other batches."""
    ds = load_shape("deepseek-v3")
    (tbo_name, h100, tbo, pub), (flat_name, _, flat, flat_pub), (wide_name, h200, wide, _) = served()
    by_name = {c.name.split(":")[0]: c for c in rows}
    over, plain = by_name[tbo_name], by_name[flat_name]
    ms = step(ds, h100, tbo)["ms"]
    compute = ms["attention"] + ms["gating"] + ms["experts"] + ms["other"]
    gain = step(ds, h100, tbo)["tokens_per_s_per_gpu"] / step(ds, h100, flat)["tokens_per_s_per_gpu"]
    overlap = (f"{over.error:+.0%}, {over.verdict}. The model's two half-batches compute for {compute:.0f} ms "
               f"and communicate for {ms['dispatch'] + ms['combine']:.0f} ms per step, and it predicts a "
               f"{step(ds, h100, tbo)['step_ms']:.0f} ms step; the run takes {tbo.batch / pub['tokens_per_s_per_gpu'] * 1e3:.0f} ms "
               f"({tbo.batch} sequences at {pub['tokens_per_s_per_gpu']:,.0f} tok/s). Without overlap the same run is "
               f"{plain.error:+.0%} ({plain.verdict}); the rest of the miss is overlap: it gains {gain:.2f}x in the "
               f"model and {flat_pub['overlap_gain']}x in the blog's ablation.")
    wide_check = by_name[wide_name]
    at = {b: step(ds, h200, replace(wide, batch=b))["tokens_per_s_per_gpu"] / wide_check.actual - 1 for b in (64, 96)}
    wide_note = (f"{wide_check.error:+.0%}, {wide_check.verdict}, at the assumed {wide.batch} sequences per GPU; at "
                 f"{' and '.join(map(str, at))} it would be {' and '.join(f'{e:+.0%}' for e in at.values())}.")
    return {"{{OVERLAP_NOTE}}": overlap, "{{WIDE_EP_NOTE}}": wide_note}


def write_report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import markdown_table

    DOCS.mkdir(exist_ok=True)
    rows = checks()
    figures = {}
    # DeepEP: predicted vs published latency by EP size
    fig, ax = plt.subplots(figsize=(6, 3.2))
    eps = sorted(DEEPEP_LOW_LATENCY)
    for i, kind in enumerate(("dispatch", "combine")):
        ax.plot(eps, [DEEPEP_LOW_LATENCY[e][i] for e in eps], "o", color=f"C{i}", label=f"{kind}, published")
        ax.plot(eps, [a2a_ms(HARDWARE["h800"], 128 * 8 * 7168 * (1 + i), e) * 1e3 for e in eps], "-", color=f"C{i}",
                label=f"{kind}, model")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("expert-parallel ranks")
    ax.set_ylabel("us")
    ax.legend(fontsize=7)
    fig.tight_layout()
    figures["scaling-deepep.png"] = fig
    # step split by EP size, Mixtral-8x7B on H200, batch 64 per GPU
    mix = load_shape("mixtral-8x7b")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    sizes = [1, 2, 4, 8]
    left = [0.0] * len(sizes)
    for part in ("attention", "gating", "experts", "dispatch", "combine", "other"):
        vals = [step(mix, HARDWARE["h200"], Layout(gpus=g, batch=64))["ms"][part] for g in sizes]
        ax.barh([f"EP{g}" for g in sizes], vals, left=left, label=part)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("ms per decode step (Mixtral-8x7B bf16, H200, 64 sequences per GPU, 2k context)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    figures["scaling-split.png"] = fig
    # tokens/s per GPU against GPUs, best batch under a 50 ms per-token target
    fig, ax = plt.subplots(figsize=(6, 3.2))
    best_rows = []
    for name, fp8 in (("mixtral-8x7b", False), ("qwen3-30b-a3b", False), ("deepseek-v3", True)):
        shape = load_shape(name)
        base = Layout(context=2048, weight_bytes=1 if fp8 else 2, dispatch_bytes=1 if fp8 else 2)
        xs, ys = [], []
        for g in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            found = best_layout(shape, HARDWARE["h200"], base, 50.0, gpus=(g,))
            if found:
                xs.append(g)
                ys.append(found[1]["tokens_per_s_per_gpu"])
        ax.plot(xs, ys, "o-", label=name)
        for target in (20.0, 50.0):
            found = best_layout(shape, HARDWARE["h200"], base, target)
            if found:
                lay, r = found
                best_rows.append([name, f"<= {target:.0f} ms", lay.gpus, lay.tp, lay.batch, r["step_ms"],
                                  r["tokens_per_s_per_gpu"], r["memory_gib"]["weights"], r["memory_gib"]["kv"]])
            else:
                best_rows.append([name, f"<= {target:.0f} ms", "-", "-", "-", "-", "-", "-", "-"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (expert parallel, data-parallel attention)")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title("H200, 2k context, best batch with <= 50 ms per token", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    figures["scaling-throughput.png"] = fig
    for name, f in figures.items():
        f.savefig(DOCS / name, dpi=120)

    skew_rows = _skew_rows()
    text = (Path(__file__).resolve().parent / "scaling_template.md").read_text()
    text = text.replace("{{CHECKS}}", checks_table(rows)).replace("{{VERDICT}}", verdict(rows))
    for key, note in served_notes(rows).items():
        text = text.replace(key, note)
    text = text.replace("{{BEST}}", markdown_table(
        ["model", "time per token", "GPUs", "attention TP", "batch per GPU", "ms per step", "tokens/s per GPU",
         "weights GiB per GPU", "KV GiB per GPU"], best_rows))
    text = text.replace("{{SKEW}}", skew_rows)
    text = text.replace("{{OVERLAY}}", _overlay_rows(markdown_table))
    (DOCS / "scaling.md").write_text(text)
    print(f"wrote {DOCS / 'scaling.md'} and {len(figures)} plots")


def _skew_rows() -> str:
    """The demo's own expert load (its held-out chats through the engine) as a skew, and what
    that skew would cost Mixtral-8x7B on 8 H200s with and without the router's placement."""
    from demo.prompts import formulaic
    from model_shards import load_checkpoint
    from moeserve.engine import LLMEngine, ModelRunner
    from moeserve.sampling_params import SamplingParams
    from moeserve.tokenizer import load_tokenizer

    model = load_checkpoint(DEMO)
    stats = model.enable_stats()
    engine = LLMEngine(ModelRunner(model, 16, 1024, prefix_caching=False), load_tokenizer(str(DEMO)))
    engine.generate(formulaic(engine.tokenizer, 16), SamplingParams(max_tokens=32, temperature=0.0))
    lines = []
    mix = load_shape("mixtral-8x7b")
    for ranks in (2, 4, 8):
        skews = skew_from_stats(stats.to_dict(), ranks)
        cost = {k: step(mix, HARDWARE["h200"], Layout(gpus=ranks, batch=64, skew=v))["step_ms"]
                for k, v in skews.items()}
        lines.append(f"| {ranks} | {skews['contiguous']:.2f} | {skews['eplb']:.2f} | {cost['contiguous']:.2f} | "
                     f"{cost['eplb']:.2f} |")
    head = ("| ranks | skew, contiguous | skew, router's placement | Mixtral ms/step, contiguous | "
            "Mixtral ms/step, router's placement |\n|---|---|---|---|---|\n")
    return head + "\n".join(lines)


def _overlay_rows(markdown_table) -> str:
    """The prod-gpu overlay's engine replica (max_num_seqs 64, max_model_len 4096, bf16 Mixtral)
    at 1, 2, 4 and 8 shards on H200."""
    mix = load_shape("mixtral-8x7b")
    rows = []
    for g in (1, 2, 4, 8):
        lay = Layout(gpus=g, batch=max(1, 64 // g), context=4096)
        r = step(mix, HARDWARE["h200"], lay)
        big = best_layout(mix, HARDWARE["h200"], lay, None, gpus=(g,))
        rows.append([g, r["memory_gib"]["weights"], r["step_ms"], 64 / r["step_ms"] * 1e3, 64 / r["step_ms"] * 1e3 / g,
                     big[0].batch * g if big else "-"])
    return markdown_table(["shards", "weights GiB per GPU", "ms per step (64 sequences)", "tokens/s per replica",
                           "tokens/s per GPU", "sequences that fit at 4k context"], rows)
