"""Tandem's offline API: ``from tandem import LLM, SamplingParams``."""
from engine.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):  # load the scheduler and torch only when LLM is asked for
    if name in ("LLM", "RequestOutput"):
        from sched import llm
        return getattr(llm, name)
    raise AttributeError(name)
