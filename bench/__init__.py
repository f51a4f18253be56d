"""Benchmarks, each runnable as `python -m bench.NAME` (for example bench.generation: ours vs
transformers; bench.speculative: speculative decoding). They print ratios measured side by
side and write JSON + Markdown reports under bench/reports/.
"""
