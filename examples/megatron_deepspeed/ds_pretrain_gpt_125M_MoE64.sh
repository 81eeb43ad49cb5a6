#!/bin/bash
# Megatron-DeepSpeed's examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh, for this
# trainer (pretrain_gpt_moe.py), plus --moc-checkpoint.
#
# The flags are upstream's: the same megatron_options, data_options and deepspeed_options
# lists, built the same way (docs/megatron-deepspeed.md maps each one), in upstream's fp16
# by default; PRECISION=bf16 or PRECISION=fp32 for a device without fp16 (precision.sh).
# Changed are only values, to fit a 2-core CPU machine with 2 ranks, and paths:
#   model      NUM_LAYERS 12 -> 2, HIDDEN_SIZE 768 -> 32, NUM_ATTN_HEADS 12 -> 4,
#              SEQ_LEN 2048 -> 32, EP_SIZE (experts) 64 -> 4
#   batch      GLOBAL_BATCH_SIZE 256 -> 8, BATCH_SIZE (micro) 4 -> 2
#   length     TRAIN_TOKENS 300B -> 1024 (4 iterations); TRAIN_ITERS keeps upstream's
#              formula (3x the tokens); WARMUP_TOKENS 375M -> 256 (1 iteration),
#              LR_DECAY_TOKENS 300B -> 1024
#   cluster    NUM_GPUS (from nvidia-smi) -> 2 ranks, launched by `deepspeed --num_gpus`
#   logging    LOG_INTERVAL 10 -> 1, EVAL_INTERVAL 100 -> 2, EVAL_ITERS 10 -> 1,
#              SAVE_INTERVAL 10000 -> 2
#   ZeRO       the DeepSpeed config's stage 0 -> 1: --moc-checkpoint with fp16 needs the
#              fp32 master weights in ZeRO's partitions (stage 0 is refused with a message)
#   not run    upstream's ssh/ds_ssh loop that syncs latest_checkpointed_iteration.txt
#              across nodes (one machine here)
#   tensorboard the four TensorBoard switches and --tensorboard-dir are passed when the
#              tensorboard package is importable (TENSORBOARD=auto), or always with
#              TENSORBOARD=true
# Paths (environment): DATA_PATH, VOCAB_PATH, MERGE_PATH (a GPT-2 BPE vocab.json /
# merges.txt and a dataset preprocessed with them), OUTPUT_BASEPATH (default ./output).
# MOC_PRINT_ARGS=1 prints the argument list, one per line, instead of running.
DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "${DIR}/../.." && pwd)
PYTHON=${PYTHON:-python}
###############################################################################
### Main configs
SEQ_LEN=32

## GPT-3 Small 125M (scaled)
MODEL_SIZE=0.125
NUM_LAYERS=2
HIDDEN_SIZE=32
NUM_ATTN_HEADS=4
GLOBAL_BATCH_SIZE=8
###############################################################################
### Training duration configs
TRAIN_TOKENS=${TRAIN_TOKENS:-1024}
TRAIN_ITERS=$(( ${TRAIN_TOKENS} * 3 / ${GLOBAL_BATCH_SIZE} / ${SEQ_LEN} ))
EXIT_DURATION=${EXIT_DURATION:-30000000}
###############################################################################
### LR configs
WARMUP_TOKENS=256
LR_DECAY_TOKENS=1024
###############################################################################
### Parallelism configs
BATCH_SIZE=2
MP_SIZE=1
PP_SIZE=1
NUM_GPUS=${NUM_GPUS:-2}
###############################################################################
### MoE configs
EP_SIZE=4
if [[ $EP_SIZE -gt $NUM_GPUS ]]; then
    EP_PARALLEL_SIZE=$NUM_GPUS
else
    EP_PARALLEL_SIZE=$EP_SIZE
fi
LR=4.5e-4
MIN_LR=4.5e-06
MLC=0.01
MOE_TRAIN_CAP_FACTOR=1.0
MOE_EVAL_CAP_FACTOR=1.0
MOE_MIN_CAP=4
MOE_DROP_TOKEN="true"
###############################################################################
### Curriculum learning (CL) configs (off, as upstream; only fills the template)
CL_ENABLED="false"
CL_START_SEQLEN=8
CL_AVG_SEQLEN=$(( (${CL_START_SEQLEN} + ${SEQ_LEN}) / 2 ))
CL_TOKENS=512
CL_STEP=$(( ${CL_TOKENS} / (${GLOBAL_BATCH_SIZE} * ${CL_AVG_SEQLEN}) ))
###############################################################################
### Misc configs
LOG_INTERVAL=1
EVAL_ITERS=1
EVAL_INTERVAL=2
SAVE_INTERVAL=2
INIT_STD=0.014
ACTIVATION_CHECKPOINT="true"
ZERO_STAGE=1
source "${DIR}/precision.sh"  # PRECISION: fp16 (upstream's), bf16 or fp32
TENSORBOARD=${TENSORBOARD:-auto}
if [ "${TENSORBOARD}" = "auto" ]; then
    if "${PYTHON}" -c "import tensorboard" 2>/dev/null; then TENSORBOARD="true"; else TENSORBOARD="false"; fi
fi
###############################################################################
### Output and data configs
current_time=$(date "+%Y.%m.%d-%H.%M.%S")
host="${HOSTNAME}"
NAME="gpt-${MODEL_SIZE}B-lr-${LR}-minlr-${MIN_LR}-bs-${GLOBAL_BATCH_SIZE}-gpus-${NUM_GPUS}-mp-${MP_SIZE}-pp-${PP_SIZE}"
if [[ $EP_SIZE -gt 1 ]]; then
    NAME="${NAME}-ep-${EP_SIZE}-mlc-${MLC}-cap-${MOE_TRAIN_CAP_FACTOR}-drop-${MOE_DROP_TOKEN}"
fi
OUTPUT_BASEPATH=${OUTPUT_BASEPATH:-$(pwd)/output}
mkdir -p "${OUTPUT_BASEPATH}/tensorboard/" "${OUTPUT_BASEPATH}/checkpoint/" "${OUTPUT_BASEPATH}/log/"
TENSORBOARD_DIR="${OUTPUT_BASEPATH}/tensorboard/${NAME}_${host}_${current_time}"
CHECKPOINT_PATH="${OUTPUT_BASEPATH}/checkpoint/${NAME}"
VOCAB_PATH=${VOCAB_PATH:?set VOCAB_PATH to a GPT-2 vocab.json}
MERGE_PATH=${MERGE_PATH:?set MERGE_PATH to a GPT-2 merges.txt}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a dataset prefix preprocessed with them}
###############################################################################
data_options=" \
         --vocab-file ${VOCAB_PATH} \
         --merge-file ${MERGE_PATH} \
         --data-path ${DATA_PATH} \
         --data-impl mmap"

megatron_options=" \
        --override-opt_param-scheduler \
        --adam-beta1 0.9 \
        --adam-beta2 0.95 \
        --tensor-model-parallel-size ${MP_SIZE} \
        --moe-expert-parallel-size ${EP_PARALLEL_SIZE} \
        --num-experts ${EP_SIZE} \
        --moe-loss-coeff ${MLC} \
        --moe-train-capacity-factor ${MOE_TRAIN_CAP_FACTOR} \
        --moe-eval-capacity-factor ${MOE_EVAL_CAP_FACTOR} \
        --moe-min-capacity ${MOE_MIN_CAP} \
        --init-method-std ${INIT_STD} \
        --lr-decay-tokens ${LR_DECAY_TOKENS} \
        --lr-warmup-tokens ${WARMUP_TOKENS} \
        --micro-batch-size ${BATCH_SIZE} \
        --exit-duration-in-mins ${EXIT_DURATION} \
        --global-batch-size ${GLOBAL_BATCH_SIZE} \
        --num-layers ${NUM_LAYERS} \
        --hidden-size ${HIDDEN_SIZE} \
        --num-attention-heads ${NUM_ATTN_HEADS} \
        --seq-length ${SEQ_LEN} \
        --max-position-embeddings ${SEQ_LEN} \
        --train-tokens ${TRAIN_TOKENS} \
        --train-iters ${TRAIN_ITERS} \
        --lr ${LR} \
        --min-lr ${MIN_LR} \
        --lr-decay-style cosine \
        --split 98,2,0 \
        --log-interval ${LOG_INTERVAL} \
        --eval-interval ${EVAL_INTERVAL} \
        --eval-iters ${EVAL_ITERS} \
        --save-interval ${SAVE_INTERVAL} \
        --weight-decay 0.1 \
        --clip-grad 1.0 \
        --hysteresis 2 \
        --num-workers 0 \
        ${PRECISION_FLAG} \
        --load ${CHECKPOINT_PATH} \
        --save ${CHECKPOINT_PATH} \
        --moc-checkpoint"

if [ "${TENSORBOARD}" = "true" ]; then
megatron_options="${megatron_options} \
        --tensorboard-queue-size 1 \
        --log-timers-to-tensorboard \
        --log-batch-size-to-tensorboard \
        --log-validation-ppl-to-tensorboard \
        --tensorboard-dir ${TENSORBOARD_DIR}"
fi

if [ "${ACTIVATION_CHECKPOINT}" = "true" ]; then
megatron_options="${megatron_options} \
        --checkpoint-activations"
fi

if [[ $EP_SIZE -gt 1 ]]; then
megatron_options="${megatron_options} \
        --create-moe-param-group"
fi

if [ "${MOE_DROP_TOKEN}" = "false" ]; then
megatron_options="${megatron_options} \
        --disable-moe-token-dropping"
fi

template_json="${DIR}/ds_config_gpt_TEMPLATE.json"
config_json="${OUTPUT_BASEPATH}/ds_config_gpt_${NAME}.json"
sed "s/CONFIG_BATCH_SIZE/${GLOBAL_BATCH_SIZE}/" ${template_json} \
    | sed "s/CONFIG_MBSIZE/${BATCH_SIZE}/" \
    | sed "s/LOG_INTERVAL/${LOG_INTERVAL}/" \
    | sed "s/ZERO_STAGE/${ZERO_STAGE}/" \
    | sed "s/PRESCALE_GRAD/true/" \
    | sed "s/CONFIG_FP16_ENABLED/${FP16_ENABLED}/" \
    | sed "s/CONFIG_BF16_ENABLED/${BF16_ENABLED}/" \
    | sed "s/CONFIG_CL_ENABLED/${CL_ENABLED}/" \
    | sed "s/CONFIG_CL_MIN/${CL_START_SEQLEN}/" \
    | sed "s/CONFIG_CL_MAX/${SEQ_LEN}/" \
    | sed "s/CONFIG_CL_DURATION/${CL_STEP}/" \
	  > ${config_json}

deepspeed_options=" \
		    --deepspeed \
		    --deepspeed_config ${config_json} \
		    --pipeline-model-parallel-size ${PP_SIZE}"

if [[ $EP_SIZE -gt 1 ]]; then
deepspeed_options="${deepspeed_options} \
        --no-pipeline-parallel"
fi

if [ "${ACTIVATION_CHECKPOINT}" = "true" ]; then
deepspeed_options="${deepspeed_options} \
        --deepspeed-activation-checkpointing"
fi

if [ "${MOC_PRINT_ARGS}" = "1" ]; then
    printf '%s\n' ${megatron_options} ${data_options} ${deepspeed_options}
    exit 0
fi

LOG_FILE="${OUTPUT_BASEPATH}/log/${NAME}_${host}_${current_time}.log"
run_cmd="deepspeed --num_gpus ${NUM_GPUS} --master_port ${MASTER_PORT:-29500} ${REPO}/pretrain_gpt_moe.py ${megatron_options} ${data_options} ${deepspeed_options} &> ${LOG_FILE}"
echo ${run_cmd}
eval ${run_cmd}
status=$?
echo "log: ${LOG_FILE} (exit ${status})"
exit ${status}
