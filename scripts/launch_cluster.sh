#!/usr/bin/env bash
# Launch pretrain_gpt_moe.py on a GPU cluster with the deepspeed launcher.
#
#   bash scripts/launch_cluster.sh HOSTFILE DATA_PATH CONFIG NODES GPUS_PER_NODE EP [extra flags...]
#
# HOSTFILE is a DeepSpeed hostfile ("hostname slots=8" per line); DATA_PATH an indexed
# dataset prefix (tools/preprocess_data.py); CONFIG a YAML under configs/. Extra flags
# go to pretrain_gpt_moe.py and win over the YAML (e.g. --save /ckpt --load /ckpt).
# The repository and its .venv must be at the same path on every node.
set -euo pipefail
if [ $# -lt 6 ]; then
    sed -n '2,10p' "$0" >&2
    exit 2
fi
HOSTFILE="$1"; DATA_PATH="$2"; CONFIG="$3"; NODES="$4"; GPUS="$5"; EP="$6"; shift 6
cd "$(dirname "$0")/.."
for f in "$HOSTFILE" "$CONFIG" "${DATA_PATH}.idx" "${DATA_PATH}.bin"; do
    [ -f "$f" ] || { echo "error: file not found: $f" >&2; exit 2; }
done
[ -x .venv/bin/python ] && source .venv/bin/activate
export NCCL_ASYNC_ERROR_HANDLING="${NCCL_ASYNC_ERROR_HANDLING:-1}"
exec deepspeed --hostfile "$HOSTFILE" --num_nodes "$NODES" --num_gpus "$GPUS" \
    pretrain_gpt_moe.py --config "$CONFIG" --data-path "$DATA_PATH" \
    --moe-expert-parallel-size "$EP" "$@"
