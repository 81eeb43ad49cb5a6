#!/usr/bin/env bash
# Launch pretrain_gpt_moe.py on a GPU cluster with the deepspeed launcher.
#
#   bash scripts/launch_cluster.sh HOSTFILE DATA_PATH CONFIG NODES GPUS_PER_NODE EP [extra flags...]
#
# HOSTFILE is a DeepSpeed hostfile ("hostname slots=8" per line); DATA_PATH an indexed
# dataset prefix (tools/preprocess_data.py); CONFIG a YAML under configs/. Extra flags
# go to pretrain_gpt_moe.py and win over the YAML (e.g. --save /ckpt --load /ckpt).
# The repository and its .venv must be at the same path on every node.
#
# Automatic restarts (the DeepSpeed launcher has none of its own): MAX_RESTARTS=N runs the
# job again, up to N times, after it fails (any rank's crash ends the launcher with a
# non-zero status; --moc-monitor turns hangs into such failures); give --save and --load
# the same directory so that each attempt resumes. EXCLUDE_SUSPECTS=1 with MOC_EVENT_FILE
# (the job's --moc-event-file) also leaves out of the next attempt every host that a
# hang or straggler event of this launch named (DeepSpeed's --exclude; the world size
# shrinks, which MoC checkpoints load on; keep spare hosts in the hostfile so that NODES
# remain). RESTART_DELAY seconds between attempts (10). DEEPSPEED: the launcher command
# (default: deepspeed).
set -euo pipefail
if [ $# -lt 6 ]; then
    sed -n '2,18p' "$0" >&2
    exit 2
fi
HOSTFILE="$1"; DATA_PATH="$2"; CONFIG="$3"; NODES="$4"; GPUS="$5"; EP="$6"; shift 6
cd "$(dirname "$0")/.."
for f in "$HOSTFILE" "$CONFIG" "${DATA_PATH}.idx" "${DATA_PATH}.bin"; do
    [ -f "$f" ] || { echo "error: file not found: $f" >&2; exit 2; }
done
[ -x .venv/bin/python ] && source .venv/bin/activate
export NCCL_ASYNC_ERROR_HANDLING="${NCCL_ASYNC_ERROR_HANDLING:-1}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
case "$MAX_RESTARTS" in *[!0-9]*|'') echo "error: MAX_RESTARTS must be an integer" >&2; exit 2 ;; esac
LAUNCHED_AT="$(date +%s)"

# Hosts named by hang/straggler events written since this launch started.
suspects() {
    [ "${EXCLUDE_SUSPECTS:-0}" = 1 ] && [ -f "${MOC_EVENT_FILE:-}" ] || return 0
    python - "$MOC_EVENT_FILE" "$LAUNCHED_AT" <<'PY'
import json, sys
hosts = []
for line in open(sys.argv[1]):
    try:
        event = json.loads(line)
    except ValueError:
        continue
    if event.get("kind") in ("hang", "straggler") and event.get("time", 0) >= float(sys.argv[2]) \
            and event.get("host") and event["host"] not in hosts:
        hosts.append(event["host"])
print("@".join(hosts))
PY
}

attempt=0
while true; do
    exclude=()
    excluded="$(suspects)"
    [ -n "$excluded" ] && exclude=(--exclude "$excluded")
    status=0
    # The attempt number as a flag: the launcher carries only some of its environment
    # (NCCL_*, PYTHON*, ...) to other nodes' ranks, which then all counted as attempt 0
    # and ETTR covered only the last attempt.
    "${DEEPSPEED:-deepspeed}" --hostfile "$HOSTFILE" --num_nodes "$NODES" \
        --num_gpus "$GPUS" "${exclude[@]}" pretrain_gpt_moe.py --config "$CONFIG" \
        --data-path "$DATA_PATH" --moe-expert-parallel-size "$EP" "$@" \
        --moc-restart-count "$attempt" || status=$?
    if [ "$status" = 0 ] || [ "$status" = 2 ] || [ "$attempt" -ge "$MAX_RESTARTS" ]; then
        exit "$status"  # done, bad input (a restart would fail the same way), or out of restarts
    fi
    attempt=$((attempt + 1))
    excluded="$(suspects)"
    echo "[launch_cluster] the job failed (exit $status); restart $attempt of $MAX_RESTARTS" \
         "in ${RESTART_DELAY:-10} s${excluded:+, without $excluded}" >&2
    sleep "${RESTART_DELAY:-10}"
done
