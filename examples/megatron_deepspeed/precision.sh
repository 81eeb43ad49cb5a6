# Sourced by the example scripts: PRECISION (fp16, upstream's and the default; bf16; fp32)
# as the trainer's flag and the DeepSpeed config template's fp16/bf16 switches, which
# change together (a config left at fp16 beside --bf16 is refused as a conflict).
# bf16 or fp32 is for a device without fp16, where the trainer refuses --fp16: a CPU whose
# oneDNN has no float16 kernels (torch.ops.mkldnn._is_mkldnn_fp16_supported() False).
PRECISION=${PRECISION:-fp16}
case "${PRECISION}" in
    fp16) PRECISION_FLAG="--fp16" FP16_ENABLED=true BF16_ENABLED=false ;;
    bf16) PRECISION_FLAG="--bf16" FP16_ENABLED=false BF16_ENABLED=true ;;
    fp32) PRECISION_FLAG="" FP16_ENABLED=false BF16_ENABLED=false ;;
    *) echo "PRECISION must be fp16, bf16 or fp32, not ${PRECISION}" >&2; exit 2 ;;
esac
