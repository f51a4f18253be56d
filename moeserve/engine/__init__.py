"""The in-process engine: scheduler, model runner, and the step loop."""

from moeserve.engine.engine import Completion, LLMEngine
from moeserve.engine.model_runner import ModelRunner, Row
from moeserve.engine.scheduler import Scheduler, SchedulerConfig
from moeserve.spec.policy import SpecConfig

__all__ = ["Completion", "LLMEngine", "ModelRunner", "Row", "Scheduler", "SchedulerConfig", "SpecConfig"]
