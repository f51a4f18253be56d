"""Pure-torch MoE and dense decoder models, their checkpoint loader and the expert-parallel data plane."""

from model_shards.config import ModelConfig
from model_shards.kv_cache import PagedKVCache, StepBatch
from model_shards.loader import CheckpointError, load_checkpoint
from model_shards.model import CausalLM
from model_shards.moe import Dispatch, LocalDispatch

__all__ = ["CausalLM", "CheckpointError", "Dispatch", "LocalDispatch", "ModelConfig", "PagedKVCache", "StepBatch",
           "load_checkpoint"]
