#!/usr/bin/env bash
# MoC paper parallel case: 2 node(s) x 8 GPUs, ZeRO-2, data-parallel 16, expert-parallel 8.
#   bash scripts/launch_2node_dp16_ep8.sh HOSTFILE DATA_PATH [CONFIG] [extra flags...]
# CONFIG defaults to configs/gpt-350m-16e.yaml, which uses GPT-2's tokenizer: give its files
# (those the data was tokenized with) as extra flags, --vocab-file vocab.json --merge-file
# merges.txt. scripts/launch_cluster.sh checks the flags and launches (its header has more).
set -euo pipefail
if [ $# -lt 2 ]; then sed -n '2,6p' "$0" >&2; exit 2; fi
HOSTFILE="$1"; DATA_PATH="$2"; shift 2
CONFIG="configs/gpt-350m-16e.yaml"
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then CONFIG="$1"; shift; fi
exec bash "$(dirname "$0")/launch_cluster.sh" "$HOSTFILE" "$DATA_PATH" "$CONFIG" 2 8 8 --zero-stage 2 "$@"
