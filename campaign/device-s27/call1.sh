#!/usr/bin/env bash
# device call 1: keep the first GGUF part, the stand-ins and the shipped drafters under /root; run the CUDA tests
set -u
mkdir -p /root/dev && cp -rp .dev/p1 .dev/site .dev/ck /root/dev/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
export PYTHONPATH=/root/dev/site:$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee $OUT/test_cuda.log
ls -la /root/dev/p1 /root/dev/ck
