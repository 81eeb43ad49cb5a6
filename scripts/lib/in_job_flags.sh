# Sourced by scripts/run_elastic.sh and scripts/launch_cluster.sh: what launching needs of
# the trainer's in-job restart flags (the trainer checks both again).
#
# in_job_flags PER_NODE NAME ARGS...: sets RESTART (relaunch or in-job), SPARES and REFILL
# (the supervisor's --refill-spares, or nothing) from the trainer's flags ARGS; with in-job, exits 2 with "error: ..." when --moc-spares is not an
# integer >= 0 or leaves none of the PER_NODE processes to train (NAME: the caller's name
# for that count, e.g. NPROC_PER_NODE).
in_job_flags() {
    local per_node="$1" name="$2" prev="" word
    shift 2
    RESTART=relaunch
    SPARES=0
    REFILL=()
    for word in "$@"; do
        case "$prev" in
            --moc-restart) RESTART="$word" ;;
            --moc-spares) SPARES="$word" ;;
        esac
        case "$word" in
            --moc-refill-spares) REFILL=(--refill-spares) ;;
            --moc-restart=*) RESTART="${word#*=}" ;;
            --moc-spares=*) SPARES="${word#*=}" ;;
        esac
        prev="$word"
    done
    [ "$RESTART" = in-job ] || return 0
    case "$SPARES" in
        *[!0-9]*|"") echo "error: --moc-spares must be an integer >= 0, got '$SPARES'" >&2; exit 2 ;;
    esac
    if [ "$SPARES" -ge "$per_node" ]; then
        echo "error: --moc-spares $SPARES leaves no training process of $name $per_node" >&2
        exit 2
    fi
}
