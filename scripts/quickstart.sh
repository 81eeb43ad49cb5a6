#!/usr/bin/env bash
# One command from a fresh clone to a trained, checkpointed and resumed GPT-MoE:
#   1. create or reuse .venv and install the project (scripts/setup_env.sh);
#   2. turn a real corpus every machine with Python has -- the standard library's own
#      source files -- into an indexed dataset (byte-level tokens);
#   3. train configs/small.yaml on 2 CPU ranks (ZeRO-2, 8 experts, expert-parallel 2;
#      where torch sees a GPU for every rank, on one GPU per rank unless
#      DS_ACCELERATOR=cpu; with fewer GPUs than ranks, on the CPU: its
#      "[quickstart] device:" line says which and why)
#      with the deepspeed launcher and MoC two-level checkpointing: a snapshot of every
#      iteration into the node keeper's shared memory, every 10th persisted to storage
#      with 2 of the 8 experts per MoE layer (partial experts checkpointing); exit half
#      way (--exit-interval: the LR schedule still spans all iterations), persisting the
#      last snapshot whole; keep 2 checkpoints (and the expert versions they need);
#   4. start a fresh job that resumes from the checkpoint and finishes.
# Environment: QUICKSTART_ITERS (default 200), QUICKSTART_RANKS (default 2),
# QUICKSTART_DIR (default runs/quickstart), DS_ACCELERATOR (DeepSpeed's: cpu for CPU ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh

ITERS="${QUICKSTART_ITERS:-200}"
RANKS="${QUICKSTART_RANKS:-2}"
RUN_DIR="${QUICKSTART_DIR:-runs/quickstart}"
HALF=$((ITERS / 2))
DATA_PREFIX="data/stdlib"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Where the ranks run: DeepSpeed's accelerator, CUDA (rank r on cuda:r) when torch sees a
# GPU for every rank, unless DS_ACCELERATOR names another (DS_ACCELERATOR=cpu: CPU ranks
# on a GPU host). With fewer GPUs than ranks (a one-GPU workstation) the ranks run on the
# CPU, as on a machine without a GPU: the same job as there.
GPUS_SEEN="$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
case "${DS_ACCELERATOR:-}" in
    '' | cuda)
        if [ "$GPUS_SEEN" -ge "$RANKS" ]; then
            DEVICE=GPU
            WHY="one per rank, cuda:0-$((RANKS - 1)) of the $GPUS_SEEN torch sees;"
            WHY+=" DS_ACCELERATOR=cpu for CPU ranks"
        elif [ "$GPUS_SEEN" -gt 0 ] && [ -z "${DS_ACCELERATOR:-}" ]; then
            export DS_ACCELERATOR=cpu
            DEVICE=CPU
            WHY="$RANKS ranks and torch sees $GPUS_SEEN GPU$([ "$GPUS_SEEN" = 1 ] || echo s): the"
            WHY+=" ranks run on the CPU, DS_ACCELERATOR=cpu; with a GPU per rank they use GPUs"
        elif [ "$GPUS_SEEN" -gt 0 ]; then
            echo "error: DS_ACCELERATOR=cuda with $RANKS ranks needs $RANKS GPUs and torch" \
                 "sees $GPUS_SEEN: DS_ACCELERATOR=cpu (or unset) runs them on the CPU" >&2
            exit 2
        else
            DEVICE=CPU WHY="torch.cuda.is_available(): False"
        fi ;;
    *) DEVICE="${DS_ACCELERATOR^^}" WHY="DS_ACCELERATOR=$DS_ACCELERATOR" ;;
esac
echo "[quickstart] device: $DEVICE ($WHY)"

if [ ! -f "${DATA_PREFIX}_text_document.idx" ]; then
    STDLIB="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
    echo "[quickstart] preparing data from the Python standard library at $STDLIB"
    python tools/preprocess_data.py --input "$STDLIB" --input-ext .py \
        --output-prefix "$DATA_PREFIX" --tokenizer-type ByteLevelTokenizer \
        --append-eod --workers 2 --max-documents 1500 --exclude-dirs site-packages dist-packages
fi

rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
common=(--config configs/small.yaml --data-path "${DATA_PREFIX}_text_document"
        --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints"
        --save-interval "$HALF" --eval-interval "$HALF" --log-interval 10
        --metrics-file "$RUN_DIR/metrics.jsonl"
        --moc-checkpoint --moc-two-level --moc-snapshot-interval 1
        --moc-persist-interval 10 --moc-k-persist 2 --moc-keep 2)

echo "[quickstart] training iterations 0-$HALF of $ITERS on $RANKS $DEVICE ranks, then stopping"
deepspeed --num_gpus "$RANKS" --master_port "${MASTER_PORT:-29561}" pretrain_gpt_moe.py \
    "${common[@]}" --train-iters "$ITERS" --exit-interval "$HALF" 2>&1 | tee "$RUN_DIR/part1.log"

echo "[quickstart] resuming from $RUN_DIR/checkpoints for iterations $HALF-$ITERS"
deepspeed --num_gpus "$RANKS" --master_port "${MASTER_PORT:-29561}" pretrain_gpt_moe.py \
    "${common[@]}" --train-iters "$ITERS" 2>&1 | tee "$RUN_DIR/part2.log"

python - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if r["kind"] == "train"]
valid = [r for r in rows if r["kind"] == "valid"]
print(f"[quickstart] done: {len(train)} iterations logged; lm loss "
      f"{train[0]['lm_loss']:.3f} (iteration {train[0]['iteration']}) -> "
      f"{train[-1]['lm_loss']:.3f} (iteration {train[-1]['iteration']})")
if valid:
    print(f"[quickstart] validation lm loss {valid[-1]['lm_loss']:.3f} at iteration {valid[-1]['iteration']}")
PY
echo "[quickstart] checkpoints: $(ls "$RUN_DIR/checkpoints" | tr '\n' ' ')"
