"""Install MoC: the GPT-MoE training side (``megatron.*`` beside ``megatron.core``) and
the checkpoint system (``deepspeed_ext``)."""

from setuptools import find_namespace_packages, setup

setup(
    name="moc",
    version="0.1.0",
    description="Fault tolerance for Mixture-of-Experts training on DeepSpeed",
    python_requires=">=3.10",
    # `megatron` is a namespace package shared with the installed megatron-core:
    # it must not get an __init__.py, or it would shadow megatron.core.
    packages=find_namespace_packages(include=["megatron.training*", "megatron.model*",
                                              "megatron.data*", "deepspeed_ext*"]),
    py_modules=["pretrain_gpt_moe"],
    install_requires=[
        # torch is installed first by scripts/setup_env.sh (a pinned CPU build, or the
        # user's own); any version DeepSpeed supports works.
        "torch>=2.4",
        # deepspeed_ext patches engine internals: pinned to the tested minor release.
        "deepspeed>=0.19.8,<0.20",
        # 0.16 is the newest release for Python 3.11; datasets, tokenizers and the LR
        # scheduler are the parts used.
        "megatron-core>=0.16.1,<0.17",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        # Memory snapshots' checksums (deepspeed_ext.format.memsum): XXH3 is about 7x faster than
        # CRC-32 here; without the package CRC-32 is used.
        "xxhash>=3.0",
    ],
    extras_require={
        # transformers: so the tests exercise the real GPT2BPETokenizer path.
        "test": ["pytest>=8", "transformers>=4.43,<6"],
        # ninja lets DeepSpeed JIT-build its fused CUDA ops; NVIDIA apex (fused
        # LayerNorm) is not on PyPI: build it from its source and it is picked up
        # when importable.
        "gpu": ["ninja>=1.11"],
        "tensorboard": ["tensorboard>=2.14"],
        # the benchmarks' plots (benchmarks/two_level_bench.py --plot, moc-plan simulate --plot)
        "bench": ["matplotlib>=3.5"],
        # GPT2BPETokenizer (megatron/data/tokenizer.py). 4.41 and older ignore
        # split_special_tokens in fast tokenizers; 4.42 pins numpy<2.
        "bpe": ["transformers>=4.43,<6"],
    },
    entry_points={
        "console_scripts": [
            "moc-pretrain=pretrain_gpt_moe:main_cli",
            "moc-preprocess-data=megatron.data.preprocess:main_cli",
            "moc-ckpt=deepspeed_ext.cli:main_cli",
            "moc-plan=deepspeed_ext.planning.cli:main_cli",
        ],
    },
)
