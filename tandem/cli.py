"""The ``tandem`` command: ``tandem serve``, ``tandem bench``, ``tandem predictor``, each the
same as ``python -m tandem.server`` / ``tandem.bench`` / ``tandem.predictor``."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("tandem.server.__main__", "start the OpenAI-compatible server"),
    "bench": ("tandem.bench.__main__", "run a benchmark (prints a table, writes JSON)"),
    "predictor": ("tandem.predictor.__main__", "train, evaluate or try the output-length predictor"),
}


def usage() -> str:
    lines = ["usage: tandem {" + ",".join(COMMANDS) + "} ...", ""]
    lines += [f"  {name:<10} {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "`tandem <command> --help` lists a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"tandem: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:], prog=f"tandem {argv[0]}") or 0
