#!/usr/bin/env bash
# `omnikv bench serve` with each vLLM engine on a GPU of its own (the producer on one, the
# consumer on another), so that PD is measured against recompute with each engine on its own
# device, as in a deployment. Needs a Python environment with a CUDA build of vLLM and omnikv
# (`--python`, default $VLLM_PYTHON or python3) and two GPUs; `--share-gpu` runs both engines
# on GPU 0 at 0.4 of its memory each (then PD and recompute share one device: say so).
# Every other argument goes to `omnikv bench serve` (e.g. --clients 4,16 --tokens 1024,4096).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/serve_gpu.sh [--python PY] [--producer-gpu N] [--consumer-gpu N] [--share-gpu]
                            [--dry-run] [-- BENCH-SERVE-ARGS...]
Runs `omnikv bench serve --device cuda --gpus P,C` with each engine on its own GPU.
  --python PY        the interpreter with CUDA vLLM and omnikv (default: $VLLM_PYTHON or python3)
  --producer-gpu N   the producer's GPU index (default 0)
  --consumer-gpu N   the consumer's GPU index (default 1)
  --share-gpu        both engines on GPU 0, 0.4 of its memory each
  --dry-run          check the GPUs, print the command, run nothing
EOF
}

py="${VLLM_PYTHON:-python3}"
producer=0
consumer=1
share=0
dry=0
rest=()
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --python) py="${2:?--python needs a value}"; shift 2 ;;
    --producer-gpu) producer="${2:?--producer-gpu needs a value}"; shift 2 ;;
    --consumer-gpu) consumer="${2:?--consumer-gpu needs a value}"; shift 2 ;;
    --share-gpu) share=1; shift ;;
    --dry-run) dry=1; shift ;;
    --) shift; rest+=("$@"); break ;;
    *) rest+=("$1"); shift ;;
  esac
done

for n in "$producer" "$consumer"; do
  if ! [[ "$n" =~ ^[0-9]+$ ]]; then
    echo "serve_gpu.sh: a GPU index is a number, got '$n'" >&2
    exit 2
  fi
done

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "serve_gpu.sh: no GPU here (nvidia-smi not found); bench serve on CPU: omnikv bench serve" >&2
  exit 2
fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
memory=()
if ((share)); then
  producer=0
  consumer=0
  memory=(--gpu-memory-utilization 0.4)
  need=1
else
  if [[ "$producer" == "$consumer" ]]; then
    echo "serve_gpu.sh: the producer and the consumer need different GPUs (or --share-gpu)" >&2
    exit 2
  fi
  need=$((1 + (producer > consumer ? producer : consumer)))
fi
if ((gpus < need)); then
  echo "serve_gpu.sh: $gpus GPU(s) visible, GPUs $producer and $consumer asked for" \
    "(one GPU: --share-gpu)" >&2
  exit 2
fi

cmd=("$py" -m omnikv.cli bench serve --device cuda --gpus "$producer,$consumer" "${memory[@]}"
  "${rest[@]}")
echo "serve_gpu.sh: $gpus GPU(s); producer on GPU $producer, consumer on GPU $consumer" >&2
if ((dry)); then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
