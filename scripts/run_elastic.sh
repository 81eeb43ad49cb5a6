#!/usr/bin/env bash
# Run pretrain_gpt_moe.py under torchrun's elastic agent, which restarts every rank of the
# job when one fails (a crash, an injected fault, or a hang/straggler stop from
# --moc-hang-timeout), up to MAX_RESTARTS times; each restart resumes from --load.
#
#   bash scripts/run_elastic.sh NPROC_PER_NODE MAX_RESTARTS [pretrain_gpt_moe.py flags...]
#
# One node by default. Several nodes: run the same command on every node with
#   NNODES=2 RDZV_ENDPOINT=host0:29400 RDZV_ID=myjob bash scripts/run_elastic.sh 8 3 ...
# Give --save and --load the same directory, or restarts start from scratch.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,10p' "$0" >&2
    exit 2
fi
NPROC="$1"; MAX_RESTARTS="$2"; shift 2
case "$NPROC$MAX_RESTARTS" in
    *[!0-9]*) echo "error: NPROC_PER_NODE and MAX_RESTARTS must be integers" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091  # the project's venv, made by scripts/setup_env.sh
[ -x .venv/bin/python ] && source .venv/bin/activate
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${NNODES:-}" ] && [ "${NNODES}" != 1 ]; then
    : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port (the same on every node)}"
    RDZV=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
          --rdzv-id "${RDZV_ID:-moc-job}")
else
    RDZV=(--standalone)
fi
# --monitor-interval: how often the agent polls its workers; a failed rank is noticed
# within it and every other rank is stopped (no rank is left waiting in a collective).
exec python -m torch.distributed.run "${RDZV[@]}" --nproc-per-node "$NPROC" \
    --max-restarts "$MAX_RESTARTS" --monitor-interval "${MONITOR_INTERVAL:-1}" \
    pretrain_gpt_moe.py "$@"
