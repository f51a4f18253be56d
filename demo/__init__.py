"""The demo model pair: a bakery corpus, a byte-level BPE tokenizer, a small MoE target and a dense draft.

No weights can be downloaded, so moeserve trains its own: ``python -m demo.train`` writes
``checkpoints/demo-moe/`` and ``checkpoints/demo-draft/`` in the Hugging Face format.
"""
