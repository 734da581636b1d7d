"""Output-length prediction by retrieval over past prompts (ALISE).

    from tandem.predictor import LengthPredictor
    p = LengthPredictor.load()          # the one `python -m predictor train` made
    p.predict(["Write a haiku about autumn."])   # -> [tokens]
"""
from tandem.predictor.model import LengthPredictor, Prediction, Settings, default_dir

__all__ = ["LengthPredictor", "Prediction", "Settings", "default_dir"]
