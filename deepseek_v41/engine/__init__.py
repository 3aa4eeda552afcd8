"""Inference engine: scheduler, model runner, sampler, ``LLM`` (SPEC.md §4)."""

from deepseek_v41.engine.engine import EngineArgs, LLMEngine
from deepseek_v41.engine.llm import LLM
from deepseek_v41.engine.sampling_params import SamplingParams, StructuredOutputsParams
from deepseek_v41.engine.sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
