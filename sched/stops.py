"""When does a request stop? Checked once per generated token, in sched/."""
from __future__ import annotations

from typing import Callable

from sched.request import FinishReason, RequestState


def check_stop(st: RequestState, eos_ids: tuple[int, ...], max_model_len: int,
               detokenize: Callable[[list[int]], str] | None) -> FinishReason | None:
    """Finish reason after st's newest token, or None to keep going.

    EOS and stop token ids count only once min_tokens tokens exist. A stop
    string sets ``st.stop_text_end`` so the returned text ends before it.
    """
    sp = st.request.sampling
    tok = st.output_token_ids[-1]
    n = len(st.output_token_ids)
    if n >= sp.min_tokens:
        if (not sp.ignore_eos and tok in eos_ids) or tok in sp.stop_token_ids:
            return FinishReason.STOP
        if sp.stop and detokenize is not None:
            text = detokenize(st.output_token_ids)
            hits = [i for i in (text.find(s) for s in sp.stop) if i >= 0]
            if hits:
                st.stop_text_end = min(hits)
                return FinishReason.STOP
    if n >= sp.max_tokens or st.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
