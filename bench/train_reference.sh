#!/usr/bin/env bash
# Train the reference LLaMA on the device machine (one H200, one 10-minute run) into OUT_DIR.
#
# Inputs travel through the device tool's `carry` option: .carry/reference (train/val/test .bin, tokenizer.json,
# manifest.json; ~33 MB), made here on the CPU by
#   .venv/bin/python -m rankserve.compress.corpus --out .carry/corpus && \
#   .venv/bin/python -m rankserve.compress.bpe --corpus .carry/corpus --out .carry/reference
# Device command (carry [".carry/reference"], timeout_s 600); the package must be installed first:
#   pip install -q --no-deps --no-build-isolation -e . && bash bench/train_reference.sh "$OUT"
# Outputs: the 8 files of compress/train.py (HF model dir + train_log.json, loss.png, README.md model card).
#
# Usage: bench/train_reference.sh OUT_DIR [MINUTES] [extra compress/train.py arguments...]
#   MINUTES (default 8): training budget from process start; install, final evaluation and saving take ~45 s more,
#   which keeps the whole command inside the device's 600 s.
set -euo pipefail
out=${1:?usage: bench/train_reference.sh OUT_DIR [MINUTES] [args...]}
minutes=${2:-8}
shift $(( $# > 1 ? 2 : 1 ))
export PYTHONUNBUFFERED=1
# the device command installs the package first; install here if that `pip` was not python3's
python3 -c "import rankserve.compress" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m rankserve.compress.train --data .carry/reference --out "$out" --minutes "$minutes" "$@"
ls -la "$out"
