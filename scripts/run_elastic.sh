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
#
# With --moc-restart in-job: MoC's supervisor starts the processes instead and keeps the
# job's store; the last --moc-spares N of each node's NPROC_PER_NODE processes wait as hot
# spares, and a failed process is replaced by one of its node's in place, the others
# keeping their processes and memory (--moc-refill-spares: a new process then takes the
# dead one's slot as a spare). When no spare is left the job is relaunched (up to
# MAX_RESTARTS times), as without the flag. Several nodes: the same command on every node
# with NNODES, RDZV_ENDPOINT=node0:port and NODE_RANK=0..NNODES-1 (node 0's supervisor
# serves the store at RDZV_ENDPOINT, on its port plus the relaunch attempt); SPARE_NODES=K
# makes the last K nodes spare nodes, one of which takes the ranks of a node whose
# supervisor node 0's has not heard from for NODE_TIMEOUT seconds (5). Node 0 serves the
# store, so losing it relaunches the job; to survive that too, run the same command once
# more on a host that does not train with COORDINATOR=serve (no NODE_RANK: it serves the
# store at RDZV_ENDPOINT, starts no process and watches every node) and every node's with
# COORDINATOR=join.
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
# shellcheck source=lib/in_job_flags.sh
source scripts/lib/in_job_flags.sh
in_job_flags "$NPROC" NPROC_PER_NODE "$@"
if [ "$RESTART" = in-job ]; then
    spares="$SPARES"
    NODES=(); port="${MASTER_PORT:-0}"
    case "${COORDINATOR:-}" in
        "") COORD=() ;;
        serve) COORD=(--coordinator); NODE_RANK="${NODE_RANK:-0}" ;;
        join) COORD=(--store-elsewhere) ;;
        *) echo "error: COORDINATOR must be serve (this host serves the store and watches" \
                "every node) or join (a coordinator serves it), got '$COORDINATOR'" >&2; exit 2 ;;
    esac
    if [ -n "${NNODES:-}" ] && [ "${NNODES}" != 1 ]; then
        : "${NODE_RANK:?set NODE_RANK=0..NNODES-1 (the index of this node; node 0 serves the store)}"
        NODES=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "${RDZV_ENDPOINT%:*}"
               --spare-nodes "${SPARE_NODES:-0}" --node-timeout "${NODE_TIMEOUT:-5}"
               ${COORD[@]+"${COORD[@]}"})
        port="${RDZV_ENDPOINT##*:}"
    elif [ "${#COORD[@]}" -gt 0 ]; then
        echo "error: COORDINATOR=${COORDINATOR} needs NNODES > 1 (a coordinator watches several" \
             "nodes)" >&2; exit 2
    fi
    case "$port" in
        *[!0-9]*|"") echo "error: RDZV_ENDPOINT (or MASTER_PORT) must end in a port number," \
                          "got '$port'" >&2; exit 2 ;;
    esac
    attempt=0
    while :; do
        status=0
        # each attempt's store on a port of its own: a node relaunched early must not join
        # the store the failed attempt's node 0 still serves while its nodes leave
        [ "$port" -gt 0 ] && PORT=(--port "$((port + attempt))") || PORT=()
        # the attempt, for the event file and the ETTR (each round adds its own number)
        MOC_RESTART_COUNT="$attempt" python -m deepspeed_ext.supervisor "${NODES[@]}" "${PORT[@]}" \
            --nproc "$((NPROC - spares))" --spares "$spares" ${REFILL[@]+"${REFILL[@]}"} \
            -- pretrain_gpt_moe.py "$@" \
            || status=$?
        # 0 done, 2 bad input, 3 this node left the job (its ranks went to a spare node;
        # the job goes on on the others), 128+N stopped by a signal (Ctrl-C): no relaunch
        if [ "$status" -eq 0 ] || [ "$status" -eq 2 ] || [ "$status" -eq 3 ] \
                || [ "$status" -ge 128 ] \
                || [ "$attempt" -ge "$MAX_RESTARTS" ]; then
            exit "$status"
        fi
        attempt=$((attempt + 1))
        echo "[moc] in-job restart could not go on (exit $status): relaunching the job," \
             "attempt $attempt of $MAX_RESTARTS" >&2
    done
fi
# --monitor-interval: how often the agent polls its workers; a failed rank is noticed
# within it and every other rank is stopped (no rank is left waiting in a collective).
exec python -m torch.distributed.run "${RDZV[@]}" --nproc-per-node "$NPROC" \
    --max-restarts "$MAX_RESTARTS" --monitor-interval "${MONITOR_INTERVAL:-1}" \
    pretrain_gpt_moe.py "$@"
