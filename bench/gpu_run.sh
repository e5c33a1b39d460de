#!/usr/bin/env bash
# The whole GPU check, as one command on a lent GPU machine (the `device` tool): the machine
# has CUDA's torch, transformers, accelerate and peft but reaches no package index, so what
# ftune's trainer needs beside them travels as wheels in .gpu/ (ignored by git; made by
# `bench/gpu_run.sh --wheels` here, where pip works) and is unpacked to a folder of its own.
#
#   bench/gpu_run.sh --wheels     # here: fill .gpu/ (~26 MB)
#   bench/gpu_run.sh              # there, e.g. run(command="bench/gpu_run.sh", carry=[".gpu"])
#   GPU_CHECK_ARGS="--only full-bf16" GPU_SKIP_LOSS_CHECK=1 bench/gpu_run.sh   # one row
#
# Each step runs whatever the one before it did, with a time limit of its own, and writes
# its log (and gpu_check's JSON record) under $OUT (or bench/results) so a failed step
# still returns the others' figures.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--wheels" ]; then
  # The versions of this venv (constraints.txt), for the device's Python 3.12. huggingface_hub,
  # tokenizers, accelerate, safetensors and torch are the device's own.
  set -e
  rm -rf .gpu .gpu-tmp && mkdir -p .gpu .gpu-tmp
  # bitsandbytes' wheel carries a library per CUDA version (~130 MB unpacked); the device's
  # torch is built for CUDA 13, so only those libraries travel.
  pins=$(.venv/bin/python - <<'EOF'
import importlib.metadata as m
for d in ["transformers", "trl", "datasets", "dill", "multiprocess", "peft", "pydantic",
          "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
          "pydantic-settings", "python-dotenv", "bitsandbytes"]:
    print(f"{d}=={m.version(d)}")
EOF
)
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu $pins
  (cd .gpu-tmp && unzip -q ../.gpu/bitsandbytes-*.whl && rm ../.gpu/bitsandbytes-*.whl &&
   find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*cuda13*' ! -name '*cpu*' -delete &&
   zip -q -r ../.gpu/bitsandbytes-cuda13.whl .)
  rm -rf .gpu-tmp
  du -sh .gpu
  exit 0
fi

OUT=${OUT:-bench/results}
mkdir -p "$OUT"
SITE=/tmp/ftune-site
rm -rf "$SITE" && mkdir -p "$SITE"
for w in .gpu/*.whl; do python3 -m zipfile -e "$w" "$SITE"; done
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: runs it, logs to $OUT/NAME.log, says how it ended
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
}

step env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import torch, transformers, peft, trl, accelerate, bitsandbytes, pydantic
print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
for m in (transformers, peft, trl, accelerate, bitsandbytes, pydantic):
    print(m.__name__, m.__version__)
import core.train.job, core.train.loss, core.train.preference"'
[ -n "${GPU_SKIP_LOSS_CHECK:-}" ] || step loss 120 python3 -m bench.gpu_loss_check
step check "${GPU_CHECK_SECONDS:-360}" python3 -m bench.gpu_check --results "$OUT" \
  ${GPU_CHECK_ARGS:-}
