"""Tandem: ``from tandem import LLM, SamplingParams`` (the offline API; ``BeamSearchParams``
for ``LLM.beam_search``, ``LoRARequest`` for generating with a LoRA adapter).

The layers keep the design's top-level folders (``engine/``, ``sched/``, ``cache/``,
``server/``, ``predictor/``, ``bench/``) and are imported as ``tandem.engine``,
``tandem.sched`` and so on, so no generic top-level name (``sched`` is also a standard-library
module) is ever imported. An installed copy has them under this package; in a checkout they are
this package's sibling folders, added to its search path here.
"""
import os as _os

_HERE = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_HERE, "engine")):
    __path__.append(_os.path.dirname(_HERE))     # a checkout: the layers sit beside this folder

from tandem.engine.params import SamplingParams, StructuredOutputs, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "StructuredOutputsParams", "RequestOutput",
           "BeamSearchParams", "LoRARequest"]


def __getattr__(name):  # load the scheduler and torch only when LLM is asked for
    if name in ("LLM", "RequestOutput", "LoRARequest"):
        from tandem.sched import llm
        return getattr(llm, name)
    if name == "BeamSearchParams":
        from tandem.sched.beam import BeamSearchParams
        return BeamSearchParams
    raise AttributeError(name)
