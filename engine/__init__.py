"""Tandem engine: model forward over a paged block pool, one worker process per device."""
from engine.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):  # keep `import engine.messages` free of torch
    if name in ("LLM", "RequestOutput"):
        from engine import llm
        return getattr(llm, name)
    raise AttributeError(name)
