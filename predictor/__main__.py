"""``python -m predictor {train,eval,predict}``: build, measure and try the length predictor."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path



def main(argv=None, prog: str = "python -m predictor") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="fit the seed predictor on ShareGPT's training records")
    t.add_argument("--out", type=Path, default=None, help="directory (default: the user cache)")
    t.add_argument("--limit", type=int, default=None, help="use only the first N training records")
    t.add_argument("--epochs", type=int, default=80, help="epochs of the embedding head")
    t.add_argument("--text-epochs", type=int, default=40, help="epochs of the text head")
    t.add_argument("--k", type=int, default=None)
    t.add_argument("--threshold", type=float, default=None)
    t.add_argument("--max-tokens", type=int, default=None)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--if-missing", action="store_true",
                   help="train only where no predictor with the text head is saved yet (make serve)")
    e = sub.add_parser("eval", help="accuracy and latency on the held-out records")
    e.add_argument("--path", type=Path, default=None, help="predictor directory (default: the trained one)")
    e.add_argument("--limit", type=int, default=None, help="evaluate on the first N held-out records")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--json", type=Path, default=None, help="result file (default: the bench results dir)")
    p = sub.add_parser("predict", help="predict the output length of prompts given as arguments")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--path", type=Path, default=None)
    a = ap.parse_args(argv)
    for name in ("limit", "threads", "epochs", "text_epochs"):
        if (v := getattr(a, name, None)) is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')}: must be 1 or more, got {v}")
    import torch
    torch.set_num_threads(getattr(a, "threads", 1))
    try:
        return {"train": _train, "eval": _eval, "predict": _predict}[a.cmd](a)
    except FileNotFoundError as e:          # no trained predictor where one was looked for: say so, no traceback
        print(f"{prog} {a.cmd}: {e}", file=sys.stderr)
        return 1


def _train(a) -> int:
    from dataclasses import replace
    from tandem.predictor.data import sharegpt
    from tandem.predictor.model import Settings, default_dir, is_current
    from tandem.predictor.train import train
    out = a.out or default_dir()
    if a.if_missing and is_current(out):
        print(f"a trained length predictor is in {out}; not training again")
        return 0
    given = {"k": a.k, "threshold": a.threshold, "max_tokens": a.max_tokens}
    settings = replace(Settings(), **{k: v for k, v in given.items() if v is not None})
    examples = sharegpt(held_out=False, limit=a.limit)
    print(f"{len(examples)} ShareGPT training records; settings {settings}")
    train(examples, settings, epochs=a.epochs, text_epochs=a.text_epochs, out=out)
    return 0


def _eval(a) -> int:
    from tandem.predictor.data import length_tokenizer, sharegpt
    from tandem.predictor.evaluate import evaluate, table
    from tandem.predictor.model import LengthPredictor
    tok = length_tokenizer()
    pred = LengthPredictor.load(a.path)
    res = evaluate(pred, sharegpt(False, tokenizer=tok), sharegpt(True, limit=a.limit, tokenizer=tok))
    print(table(res))
    if a.json is None:
        from tandem.bench.output import save_json
        save_json("predictor_eval.json", res)
        return 0
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(res, indent=1))
    print(f"wrote {a.json}")
    return 0


def _predict(a) -> int:
    from tandem.predictor.model import LengthPredictor
    pred = LengthPredictor.load(a.path)
    for prompt, out in zip(a.prompts, pred.predict_detailed(a.prompts)):
        how = f"similar past prompts (best {out.similarity:.2f})" if out.retrieved else "the fallback heads"
        print(f"{out.length:>6} tokens  by {how}: {prompt[:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(prog=f"python -m {__spec__.parent}"))   # or tandem.predictor when installed
