#!/usr/bin/env bash
# Launch pretrain_gpt_moe.py on a GPU cluster with the deepspeed launcher.
#
#   bash scripts/launch_cluster.sh HOSTFILE DATA_PATH CONFIG NODES GPUS_PER_NODE EP [extra flags...]
#
# HOSTFILE is a DeepSpeed hostfile ("hostname slots=8" per line); the job runs on its
# first NODES hosts, GPUS_PER_NODE ranks on each. DATA_PATH an indexed dataset prefix
# (tools/preprocess_data.py); CONFIG a YAML under configs/. Extra flags go to
# pretrain_gpt_moe.py and win over the YAML (e.g. --save /ckpt --load /ckpt).
# The repository and its .venv must be at the same path on every node. Relative paths
# are taken from the repository root.
#
# Tokenizer files: a config that selects GPT2BPETokenizer (configs/gpt-125m-8e.yaml,
# configs/gpt-350m-16e.yaml) needs GPT-2's vocab.json and merges.txt, the files the data
# was tokenized with, as extra flags: --vocab-file FILE --merge-file FILE. The trainer's
# flags are parsed here before anything is launched: a flag it refuses, or a tokenizer
# without its files, stops the launch with "error: ..." and exit status 2.
#
# MASTER_ADDR, MASTER_PORT: where rank 0 (on the first host used) listens, given to the
# launcher when set; without MASTER_ADDR DeepSpeed takes the first address `hostname -I`
# prints on that host, which can be an interface the other nodes cannot reach (docker0).
# The launcher gives the other nodes' ranks only part of this environment (PYTHON*,
# NCCL*, ...); this script also sends them every MOC_*, TORCH_NCCL_* and OMP_NUM_THREADS
# variable set here (TORCH_NCCL_ASYNC_ERROR_HANDLING defaults to 1, 2 in-job), through a
# file of its own, to which it adds the lines of your .deepspeed_env in $HOME and in the
# repository root (or of the files DS_ENV_FILE names there; read, never written; their
# values win, as they do over NCCL_* ones with DeepSpeed alone).
#
# Automatic restarts (the DeepSpeed launcher has none of its own): MAX_RESTARTS=N runs the
# job again, up to N times, after it fails (any rank's crash ends the launcher with a
# non-zero status; --moc-monitor turns hangs into such failures); give --save and --load
# the same directory so that each attempt resumes. EXCLUDE_SUSPECTS=1 with MOC_EVENT_FILE
# (the job's --moc-event-file) also leaves out of the next attempt every host that a
# hang or straggler event of this launch named: that attempt runs on the first NODES
# hosts of HOSTFILE without them (keep spare hosts in the hostfile so that NODES remain;
# with fewer the world size shrinks, which MoC checkpoints load on). RESTART_DELAY
# seconds between attempts (10). DEEPSPEED: the launcher command (default: deepspeed).
#
# One node (NODES=1): DeepSpeed starts every rank on this machine whatever host the
# hostfile names, so the launch skips DeepSpeed's ssh check and rank 0 listens on 127.0.0.1
# (MASTER_ADDR overrides): no passwordless ssh to this machine is needed.
#
# In-job restart (--moc-restart in-job --moc-spares S): instead of DeepSpeed's launcher,
# every one of the NODES hosts runs scripts/run_elastic.sh GPUS_PER_NODE 0 (MoC's
# supervisor: GPUS_PER_NODE - S training ranks and S hot spares), started over ssh
# (SSH: the command, default ssh; one node runs here) with NNODES, NODE_RANK and
# RDZV_ENDPOINT (MASTER_ADDR, default the first host's name, and MASTER_PORT, default
# 29500, plus the attempt) and the variables listed above. A crash is recovered in
# place by a spare of its node. SPARE_NODES=K starts the K hosts after the first NODES
# as spare nodes (all their processes wait): one takes the ranks of a node lost whole,
# whose supervisor went silent for NODE_TIMEOUT seconds (5; passed on when set),
# recovering them from the peers' copies (--moc-redundancy). COORDINATOR_HOST=HOST
# runs MoC's coordinator there over ssh (a host outside HOSTFILE that trains nothing,
# by a name the nodes reach): it serves the job's store instead of node 0, so losing
# node 0 is a node loss like any other; a list HOST1,HOST2 moves the next attempt to
# the next host when an attempt's coordinator was lost (its ssh exited 255, or still ran
# COORDINATOR_GRACE seconds, 60, after every node ended). An attempt whose store server
# (the coordinator, else node 0's supervisor) ended 0 finished, whatever a lost node's ssh
# returned. When no spare can help, the attempt fails and MAX_RESTARTS relaunches it on
# the hosts then left, without those whose ssh exited 255 (down or unreachable).
set -euo pipefail
if [ $# -lt 6 ]; then
    sed -n '2,60p' "$0" >&2
    exit 2
fi
HOSTFILE="$1"; DATA_PATH="$2"; CONFIG="$3"; NODES="$4"; GPUS="$5"; EP="$6"; shift 6
cd "$(dirname "$0")/.."
for f in "$HOSTFILE" "$CONFIG" "${DATA_PATH}.idx" "${DATA_PATH}.bin"; do
    [ -f "$f" ] || { echo "error: file not found: $f" >&2; exit 2; }
done
for n in "NODES=$NODES" "GPUS_PER_NODE=$GPUS" "MAX_RESTARTS=${MAX_RESTARTS:-0}" \
         "MASTER_PORT=${MASTER_PORT:-0}" "SPARE_NODES=${SPARE_NODES:-0}" \
         "COORDINATOR_GRACE=${COORDINATOR_GRACE:-0}"; do
    case "${n#*=}" in *[!0-9]*|'') echo "error: ${n%%=*} must be an integer" >&2; exit 2 ;; esac
done
MAX_RESTARTS="${MAX_RESTARTS:-0}"
SPARE_NODES="${SPARE_NODES:-0}"
IFS=, read -r -a COORDINATORS <<< "${COORDINATOR_HOST:-}"
COORD_INDEX=0
UNREACHABLE=""
# shellcheck disable=SC1091  # the project's venv, made by scripts/setup_env.sh
[ -x .venv/bin/python ] && source .venv/bin/activate

# shellcheck source=lib/in_job_flags.sh
source scripts/lib/in_job_flags.sh
in_job_flags "$GPUS" GPUS_PER_NODE "$@"
restart="$RESTART"
if [ "$restart" != in-job ] && { [ "$SPARE_NODES" != 0 ] || [ "${#COORDINATORS[@]}" != 0 ]; }; then
    echo "error: SPARE_NODES and COORDINATOR_HOST need --moc-restart in-job (a relaunch" \
         "takes spare hosts from the hostfile by itself: see EXCLUDE_SUSPECTS)" >&2
    exit 2
fi
if [ "${#COORDINATORS[@]}" != 0 ]; then
    if [ $((NODES + SPARE_NODES)) -lt 2 ]; then
        echo "error: COORDINATOR_HOST needs NODES + SPARE_NODES >= 2 (a coordinator watches" \
             "several nodes; one node runs here with its own store)" >&2
        exit 2
    fi
    for host in "${COORDINATORS[@]}"; do
        if awk -v h="$host" '!/^[[:space:]]*#/ && $2 ~ /^slots=/ && $1 == h {found=1}
                             END {exit !found}' "$HOSTFILE"; then
            echo "error: COORDINATOR_HOST names $host, a host of $HOSTFILE: the coordinator" \
                 "runs on a host that trains nothing (a head or login node)" >&2
            exit 2
        fi
    done
fi
if [ "$restart" = in-job ]; then
    # checked as the supervisor starts them: its store named, the spares left out
    export MOC_RESTART_STORE="${MOC_RESTART_STORE:-127.0.0.1:29500}"
fi
# The trainer's flags, checked once here: a flag it refuses, or a tokenizer without its
# files, would otherwise stop every rank of every node after the launch.
python -m megatron.training.launch_check "$CONFIG" "$DATA_PATH" "$EP" "$@" || exit 2
unset MOC_RESTART_STORE  # the supervisor sets it for its processes
# TORCH_NCCL_ASYNC_ERROR_HANDLING is the current name (NCCL_ASYNC_ERROR_HANDLING is
# deprecated); a value given under the old name still counts. 1 tears a rank down on its
# first NCCL error, so that the launcher sees the failure; in-job, 2 aborts the
# communicators and leaves the process alive (a survivor), as MoC's supervisor requires.
handling=1
[ "$restart" != in-job ] || handling=2
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-${NCCL_ASYNC_ERROR_HANDLING:-$handling}}"
LAUNCHED_AT="$(date +%s)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/moc-launch.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The environment of the other nodes' ranks. DeepSpeed's runner (launcher/runner.py)
# exports to them the variables whose names start with one of its EXPORT_ENVS prefixes
# (PYTHON, MLFLOW, MV2, UCX, and the accelerator's: NCCL on CUDA), then the KEY=VALUE
# lines of the file named by DS_ENV_FILE (default .deepspeed_env) in $HOME and in its
# working directory (this repository), a later value winning. MOC_*, TORCH_NCCL_* and
# OMP_NUM_THREADS start with no such prefix, so they go into a file of this launch's,
# followed by the lines of those files of the user's (which keep the last word), and
# DS_ENV_FILE names it by absolute path (joined to either directory that is the file
# itself, so the runner reads it and only it). Nothing is written to the user's files.
# A one-node launch starts its ranks locally and they inherit this whole environment.
python - "$WORK/deepspeed_env" "${DS_ENV_FILE:-.deepspeed_env}" <<'PY'
import os, sys
out, name = sys.argv[1], sys.argv[2]
lines = []
for key, value in sorted(os.environ.items()):
    if key.startswith(("MOC_", "TORCH_NCCL_")) or key == "OMP_NUM_THREADS":
        if "\n" in value:  # the runner reads the file line by line
            print(f"[launch_cluster] warning: {key} holds a newline; not sent to other nodes",
                  file=sys.stderr)
            continue
        lines.append(f"{key}={value}\n")
read = set()
for directory in (os.path.expanduser("~"), "."):  # the runner's DEEPSPEED_ENVIRONMENT_PATHS
    path = os.path.join(directory, name)
    if os.path.isfile(path) and os.path.realpath(path) not in read:
        read.add(os.path.realpath(path))
        with open(path) as f:  # blank lines dropped: the runner stops at a line without "="
            lines += [line.rstrip("\n") + "\n" for line in f if line.strip()]
with open(out, "w") as f:
    f.writelines(lines)
PY
export DS_ENV_FILE="$WORK/deepspeed_env"

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

# The hosts the next attempt leaves out, joined by @: the suspects, and the hosts whose
# ssh failed (255) in an in-job attempt.
left_out() {
    local named
    named="$(suspects)"
    printf '%s' "${named}${named:+${UNREACHABLE:+@}}${UNREACHABLE}"
}

# Writes HOSTFILE less the hosts in $1 (joined by @) to $WORK/hostfile; prints the first
# host that remains (rank 0's). An event names a host by its hostname, which may be the
# short form of the hostfile's name. Fails when no host remains.
hostfile_without() {
    python - "$HOSTFILE" "$1" "$WORK/hostfile" "$NODES" <<'PY'
import re, sys
source, leave_out, out, nodes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
leave_out = set(filter(None, leave_out.split("@")))
kept, hosts, matched = [], [], set()
for line in open(source):
    match = re.search(r"^(\S+)\s+slots=(\d+)", line.strip())  # as DeepSpeed's _parse_hostfile
    if match and not line.strip().startswith("#"):
        host = match.group(1)
        short = host if re.fullmatch(r"[\d.]+", host) else host.split(".")[0]
        named = leave_out & {host, short}
        if named:
            matched |= named
            continue
        hosts.append(host)
    kept.append(line)
for host in sorted(leave_out - matched):
    print(f"[launch_cluster] warning: {host}, named by an event, is not in {source}; "
          "it cannot be left out", file=sys.stderr)
if not hosts:
    print(f"[launch_cluster] error: no host of {source} is left" + (
        f" without {', '.join(sorted(leave_out))}" if leave_out else ""), file=sys.stderr)
    sys.exit(1)
if len(hosts) < nodes:
    print(f"[launch_cluster] warning: {len(hosts)} host(s) left for {nodes} nodes: the job "
          "runs on fewer ranks", file=sys.stderr)
with open(out, "w") as f:
    f.writelines(kept)
print(hosts[0])
PY
}

# The remote command for one host: cd to this repository, then env with the variables the
# deepspeed launcher would have sent the other nodes' ranks, then the words given (NAME=VALUE
# words, then the command), each quoted for the remote shell.
remote_command() {
    local remote line
    remote="cd $(printf %q "$PWD") && env"
    while IFS= read -r line; do
        [ -n "$line" ] && remote+=" $(printf %q "$line")"
    done < "$DS_ENV_FILE"
    printf '%s%s' "$remote" "$(printf ' %q' "$@")"
}

# wait_within PID SECONDS: PID's exit status; 124 when it still ran after SECONDS (then
# killed). A coordinator whose host went down can leave its ssh waiting on a dead
# connection for as long as TCP keeps it open, which would hold the relaunch.
wait_within() {
    local pid="$1" ticks=$(( $2 * 10 ))
    while kill -0 "$pid" 2>/dev/null && [ "$ticks" -gt 0 ]; do
        sleep 0.1
        ticks=$((ticks - 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        return 124
    fi
    wait "$pid"
}

# One attempt of an in-job launch: run_elastic.sh on each of the first NODES hosts of
# $1 (the attempt's hostfile) and on the SPARE_NODES hosts after them, rank 0's host
# being $2, the attempt's number $3, the trainer's flags after; with COORDINATOR_HOST,
# MoC's coordinator on COORDINATORS[COORD_INDEX] too. Waits for every node's, then the
# coordinator's (COORDINATOR_GRACE seconds at most), returns the first non-zero status;
# sets COORD_LOST=1 when the coordinator's ssh failed (255) or had to be killed.
launch_in_job() {
    local hostfile="$1" first="$2" try="$3"; shift 3
    local -a cmd=(bash scripts/run_elastic.sh "$GPUS" 0 --config "$CONFIG"
                  --data-path "$DATA_PATH" --moe-expert-parallel-size "$EP" "$@"
                  --moc-restart-count "$try")
    local port=$(( ${MASTER_PORT:-29500} + try ))
    local -a hosts pids=() place
    mapfile -t hosts < <(awk '!/^[[:space:]]*#/ && $2 ~ /^slots=/ {print $1}' "$hostfile" \
                         | head -n "$((NODES + SPARE_NODES))")
    local spares=$(( ${#hosts[@]} > NODES ? ${#hosts[@]} - NODES : 0 ))
    if [ "${#hosts[@]}" = 1 ] && [ "${#COORDINATORS[@]}" = 0 ]; then
        MASTER_PORT="$port" "${cmd[@]}"
        return
    fi
    if [ "$spares" -lt "$SPARE_NODES" ]; then
        echo "[launch_cluster] warning: $spares of SPARE_NODES=$SPARE_NODES spare hosts left" \
             "in the hostfile: a node lost beyond them relaunches the job" >&2
    fi
    local addr="${MASTER_ADDR:-$first}" node=0 host status=0 pid rc coord_pid=""
    [ "$first" = "$FIRST_HOST" ] || addr="$first"
    place=(NNODES="${#hosts[@]}" SPARE_NODES="$spares")
    [ -z "${NODE_TIMEOUT:-}" ] || place+=(NODE_TIMEOUT="$NODE_TIMEOUT")
    COORD_LOST=0
    if [ "${#COORDINATORS[@]}" -gt 0 ]; then
        # the store on a host that trains nothing: losing node 0 is then a node loss
        addr="${COORDINATORS[$COORD_INDEX]}"
        ${SSH:-ssh} "$addr" "$(remote_command "${place[@]}" COORDINATOR=serve \
                                RDZV_ENDPOINT="$addr:$port" "${cmd[@]}")" &
        coord_pid="$!"
        place+=(COORDINATOR=join)
    fi
    for host in "${hosts[@]}"; do
        ${SSH:-ssh} "$host" "$(remote_command "${place[@]}" NODE_RANK="$node" \
                                RDZV_ENDPOINT="$addr:$port" "${cmd[@]}")" &
        pids+=("$!")
        node=$((node + 1))
    done
    local index=0 server="${hosts[0]}" verdict=""
    local -a failed=()
    for pid in "${pids[@]}"; do
        rc=0
        wait "$pid" || rc=$?
        [ "$rc" != 3 ] || rc=0  # that node left the job, its ranks on a spare node
        [ "$rc" = 0 ] || failed+=("${hosts[$index]} (exit $rc)")
        # ssh's own failure: the host went down or cannot be reached; the next attempt
        # leaves it out (a node never started would hold round 0 until its group timed out)
        [ "$rc" != 255 ] || UNREACHABLE+="${UNREACHABLE:+@}${hosts[$index]}"
        [ "$index" != 0 ] || [ -n "$coord_pid" ] || verdict="$rc"  # node 0 serves the store
        [ "$status" != 0 ] || status="$rc"
        index=$((index + 1))
    done
    if [ -n "$coord_pid" ]; then
        rc=0
        wait_within "$coord_pid" "${COORDINATOR_GRACE:-60}" || rc=$?
        if [ "$rc" = 255 ] || [ "$rc" = 124 ]; then
            COORD_LOST=1
            echo "[launch_cluster] the coordinator on $addr was lost (ssh" \
                 "$([ "$rc" = 124 ] && echo "still waiting ${COORDINATOR_GRACE:-60} s after" \
                    "every node ended" || echo "exit 255"))" >&2
        fi
        server="$addr"
        verdict="$rc"
        [ "$status" != 0 ] || status="$rc"
    fi
    # The store's server ends 0 only when every training process of the job exited 0: a
    # node lost and replaced by a spare node (its ssh ended 255, or killed) does not fail
    # a job that finished without it, and a relaunch would redo the whole job.
    if [ "$verdict" = 0 ] && [ "$status" != 0 ]; then
        echo "[launch_cluster] the job finished ($server's supervisor ended 0);" \
             "lost and replaced on the way: ${failed[*]}" >&2
        status=0
    fi
    return "$status"
}

FIRST_HOST="$(hostfile_without "")" || exit 2
attempt=0
while true; do
    # Suspects leave the hostfile itself, and --num_nodes/--num_gpus pick the job's layout
    # from what remains as from a full hostfile. Not DeepSpeed's --exclude: its runner
    # refuses it next to --num_nodes/--num_gpus ("Cannot specify num_nodes/gpus with
    # include/exclude"); alone it would run on every remaining host (spares included) and
    # every slot of each (GPUS_PER_NODE ignored); and the MPI backends refuse it while
    # they pass the hostfile to mpirun.
    hostfile="$HOSTFILE"
    first="$FIRST_HOST"
    excluded="$(left_out)"
    if [ -n "$excluded" ]; then
        first="$(hostfile_without "$excluded")" || exit 1
        hostfile="$WORK/hostfile"
    fi
    master=()
    if [ "$NODES" = 1 ]; then  # a local launch (see the header)
        master=(--no_ssh_check --master_addr "${MASTER_ADDR:-127.0.0.1}")
    elif [ -n "${MASTER_ADDR:-}" ]; then
        if [ "$first" = "$FIRST_HOST" ]; then
            master=(--master_addr "$MASTER_ADDR")
        else
            echo "[launch_cluster] MASTER_ADDR=$MASTER_ADDR is $FIRST_HOST's, which this" \
                 "attempt leaves out: DeepSpeed takes $first's address ('hostname -I')" >&2
        fi
    fi
    if [ -n "${MASTER_PORT:-}" ]; then
        master+=(--master_port "$MASTER_PORT")
    fi
    status=0
    # The attempt number as a flag: the launcher carries only some of its environment
    # (NCCL_*, PYTHON*, ...) to other nodes' ranks, which then all counted as attempt 0
    # and ETTR covered only the last attempt.
    if [ "$restart" = in-job ]; then
        launch_in_job "$hostfile" "$first" "$attempt" "$@" || status=$?
    else
        "${DEEPSPEED:-deepspeed}" --hostfile "$hostfile" --num_nodes "$NODES" \
            --num_gpus "$GPUS" "${master[@]}" pretrain_gpt_moe.py --config "$CONFIG" \
            --data-path "$DATA_PATH" --moe-expert-parallel-size "$EP" "$@" \
            --moc-restart-count "$attempt" || status=$?
    fi
    if [ "$status" = 0 ] || [ "$status" = 2 ] || [ "$attempt" -ge "$MAX_RESTARTS" ]; then
        exit "$status"  # done, bad input (a restart would fail the same way), or out of restarts
    fi
    attempt=$((attempt + 1))
    if [ "${COORD_LOST:-0}" = 1 ] && [ "${#COORDINATORS[@]}" -gt 1 ]; then
        COORD_INDEX=$(( (COORD_INDEX + 1) % ${#COORDINATORS[@]} ))
        echo "[launch_cluster] the next attempt's coordinator runs on" \
             "${COORDINATORS[$COORD_INDEX]}" >&2
    fi
    excluded="$(left_out)"
    echo "[launch_cluster] the job failed (exit $status); restart $attempt of $MAX_RESTARTS" \
         "in ${RESTART_DELAY:-10} s${excluded:+, without $excluded}" >&2
    sleep "${RESTART_DELAY:-10}"
done
