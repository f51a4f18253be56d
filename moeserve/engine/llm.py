"""The offline API: the whole engine in this process, for batch jobs and as every benchmark's baseline.

    from moeserve import LLM, SamplingParams
    llm = LLM()                                    # the demo pair, the shipped defaults
    outs = llm.generate(["Is the mawa cake eggless?", "Hi"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].text, outs[0].finish_reason)

Text is made as the server makes it: one incremental detokenizer per request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from moeserve.config import AppConfig
from moeserve.engine.factory import build_engine
from moeserve.sampling_params import SamplingParams, StructuredOutputsParams, TokenLogprob, TokenTrace
from moeserve.tokenizer import IncrementalDetokenizer

PROGRESS_FROM = 16  # show a progress bar for this many prompts or more


@dataclass
class CompletionOutput:
    """One prompt's result."""

    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, with SamplingParams(logprobs=N)
    trace: list[TokenTrace] | None = None  # one per token id, with SamplingParams(trace_experts / trace_speculation)


class LLM:
    """An engine in this process, built from the one config tree (moeserve/config.py) and its
    defaults. `model`: target checkpoint folder (default: the demo MoE); `draft`: "none",
    "ngram", "model" (the demo draft) or a draft checkpoint folder (default: prompt lookup);
    `options`: any model, engine or speculative option by name (max_num_seqs=8, num_tokens=3, ...)."""

    def __init__(self, model: str | None = None, draft: str | None = None, *, config: AppConfig | None = None,
                 **options: Any) -> None:
        """`config`: a whole config tree to start from (e.g. `AppConfig.load(FILE)`); the other
        arguments override it."""
        if config is None:
            self.config = AppConfig.from_options(model, draft, **options)
        else:
            flat = AppConfig.from_options(model, draft, **options).model_dump(exclude_unset=True)
            self.config = config.with_overrides(flat)
        if self.config.engine.torch_threads:
            import torch

            torch.set_num_threads(self.config.engine.torch_threads)
        self.engine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._compiler = None  # made on the first structured-output request

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[CompletionOutput]:
        """Generate for one prompt (text or token ids) or a list of them; results in prompt order.
        `params`: one SamplingParams for all, or one per prompt (default: SamplingParams())."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        results, live = self._add(prompts, per_prompt)
        with _progress(len(prompts), use_tqdm) as bar:
            for out, _ in self._run(live):
                if out.finish_reason is not None:
                    bar.update(1)
        return results

    def stream(self, prompt: str | Sequence[int],
               params: SamplingParams | None = None) -> Iterator[tuple[str, CompletionOutput]]:
        """One prompt as it is generated: (the new text, the output so far) after each step."""
        _, live = self._add([prompt], [params or SamplingParams()])
        for out, text in self._run(live):
            yield text, out

    def _add(self, prompts: Sequence, params: list[SamplingParams]) -> tuple[list[CompletionOutput], dict]:
        # every grammar first: a bad one raises (GrammarError, as the server's 400) before anything is queued
        grammars = [self._compile(p.structured_outputs) if p.structured_outputs is not None else None for p in params]
        results, live = [], {}
        for prompt, p, grammar in zip(prompts, params, grammars):
            ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
            out = CompletionOutput(ids)
            request_id = self.engine.add_request(ids, p, grammar=grammar)
            live[request_id] = (out, IncrementalDetokenizer(self.tokenizer, ids, p.stop))
            results.append(out)
        return results, live

    def _compile(self, structured: StructuredOutputsParams) -> Any:
        from moeserve.grammar import GrammarCompiler, GrammarError

        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.engine.runner.vocab_size,
                                             config=self.config.grammar.grammar_config())
        spec = structured.spec()
        try:
            return self._compiler.compile(spec)
        except GrammarError as e:  # worded as the server's 400
            raise type(e)(e.refusal(spec.kind), feature=e.feature) from None

    def _run(self, live: dict[str, tuple[CompletionOutput, IncrementalDetokenizer]]) -> Iterator[tuple]:
        """Step the engine until every request in `live` ends: (output, its new text) per request and step."""
        while live:
            for step_out in self.engine.step():
                if step_out.request_id not in live:  # a stream whose reader left early: nobody wants the rest
                    self.engine.abort(step_out.request_id)
                    continue
                out, detok = live[step_out.request_id]
                out.token_ids += step_out.new_token_ids
                if step_out.logprobs is not None:
                    out.logprobs = (out.logprobs or []) + step_out.logprobs
                if step_out.trace is not None:
                    out.trace = (out.trace or []) + step_out.trace
                text = detok.push(step_out.new_token_ids)
                if detok.stopped and not step_out.finished:
                    self.engine.abort(step_out.request_id)  # the stop string is the serving side's to see
                    out.finish_reason = "stop"
                elif step_out.finished:
                    text += detok.finish()
                    out.finish_reason = "stop" if detok.stopped else step_out.finish_reason
                out.text += text
                if out.finish_reason is not None:
                    del live[step_out.request_id]
                yield out, text


def _progress(total: int, use_tqdm: bool | None) -> Any:
    from tqdm import tqdm

    show = total >= PROGRESS_FROM if use_tqdm is None else use_tqdm
    return tqdm(total=total, desc="generate", unit="prompt", disable=not show)
