"""The installed product, away from the checkout.

A fresh venv in a temp dir gets a real (non-editable) install of this repository. Its
dependencies come from the test's own environment through a path file (nothing is downloaded).
From another directory, with nothing of the checkout on the path, it imports ``tandem``, finds
its data files (the kernel source, the dashboard), runs a greedy generation on a tiny model,
and answers ``--help`` on its commands. The generation is
compared with HF transformers here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.conftest import hf_greedy

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 99, 3, 41], [7, 7, 200, 13]]
MAX_NEW = 12

SCRIPT = """
import json, sys
from importlib import resources
import tandem
from tandem import LLM, SamplingParams
for src in ("ops.cpp", "paged_decode.cpp", "linear.cpp", "qlinear.cpp", "qlinear_bf16.cpp", "panel_tile.h"):
    assert (resources.files("tandem.engine") / "csrc" / src).is_file(), f"kernel source {src} not installed"
assert "Tandem" in (resources.files("tandem.server") / "static" / "dashboard.html").read_text()
# the torch attention path: compiling the kernel again for this location would only cost time
with LLM(sys.argv[1], "cpu:1", dtype="float32", threads_per_worker=1, cpu_kernels=False) as llm:
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=int(sys.argv[3]),
                                                                temperature=0, ignore_eos=True))
print(json.dumps({"tokens": [o.token_ids for o in outs], "where": tandem.__file__}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, bin dir, env) of a fresh venv holding a built install of the repository."""
    home = tmp_path_factory.mktemp("fresh-venv")
    venv.EnvBuilder(with_pip=False).create(home / "venv")
    py = home / "venv" / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (torch, transformers, pip, setuptools) from this environment, after the venv's own
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    src = home / "src"            # built from a copy: the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "results", "__pycache__", ".pytest_cache", ".hypothesis", "tests"))
    build = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", str(src)], capture_output=True, text=True, env=env, cwd=home)
    assert build.returncode == 0, build.stderr[-3000:]
    return py, py.parent, env, home


def test_installed_copy_generates_from_another_directory(installed, tiny_llama):
    py, _, env, home = installed
    elsewhere = home / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([py, "-c", SCRIPT, str(tiny_llama), json.dumps(PROMPTS), str(MAX_NEW)],
                         capture_output=True, text=True, env=env, cwd=elsewhere, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert not Path(got["where"]).is_relative_to(ROOT), f"imported the checkout: {got['where']}"
    assert got["tokens"] == hf_greedy(tiny_llama, PROMPTS, MAX_NEW)


def test_installed_commands_answer_help(installed):
    py, bin_dir, env, home = installed
    for cmd, said in (([py, "-m", "tandem.server", "--help"], "python -m tandem.server"),
                      ([bin_dir / "tandem", "serve", "--help"], "tandem serve"),
                      ([bin_dir / "tandem", "bench", "--help"], "tandem bench"),
                      ([py, "-m", "tandem", "predictor", "--help"], "tandem predictor")):
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=home, timeout=120)
        assert run.returncode == 0, (cmd, run.stderr[-2000:])
        assert "--help" in run.stdout, run.stdout
        assert run.stdout.startswith(f"usage: {said} "), (said, run.stdout[:200])   # the command as typed
    bad = subprocess.run([bin_dir / "tandem", "launch"], capture_output=True, text=True, env=env, cwd=home)
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_no_generic_top_level_name_is_installed(installed):
    """Only the ``tandem`` namespace lands in site-packages: ``sched`` stays the standard library's."""
    py, _, env, home = installed
    probe = ("import importlib.util, sched, sys; "
             "print(sched.__file__); "
             "print([n for n in ('engine', 'server', 'cache', 'predictor', 'bench') "
             "if importlib.util.find_spec(n) is not None])")
    run = subprocess.run([py, "-c", probe], capture_output=True, text=True, env=env, cwd=home, check=True)
    sched_file, found = run.stdout.strip().splitlines()
    assert Path(sched_file).parent == Path(sysconfig.get_paths()["stdlib"]), sched_file
    assert found == "[]", found
