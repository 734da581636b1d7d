"""python -m bench <subcommand>: benchmarks (never part of the tests)."""
from __future__ import annotations

import argparse
import os


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ap = argparse.ArgumentParser(prog="python -m bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    off = sub.add_parser("offline", help="offline throughput vs HF transformers and vLLM")
    off.add_argument("--num-prompts", type=int, default=64)
    off.add_argument("--max-tokens", type=int, default=128)
    off.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    off.add_argument("--devices", default="cpu:1")
    off.add_argument("--skip", nargs="*", default=[],
                     help="systems to skip: tandem hf_generate hf_cb vllm_bfloat16 vllm_float32")
    args = ap.parse_args()
    if args.cmd == "offline":
        from bench.offline import main as offline
        offline(args)


if __name__ == "__main__":
    main()
