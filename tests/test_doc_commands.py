"""Every command the docs show is run by a test: :data:`RUN_BY` names, for each command of
README.md, docs/*.md and benchmarks/README.md (tests/doc_commands.py reads them; inline
code counts when it is a whole command), the test that runs it end to end, or why none
does; a command without an entry fails here, so a new one cannot land untested.

And the cluster commands of README.md and docs/running.md, run here: each fixed-layout
launch as the page shows it (its hostfile, data and tokenizer files made in a sandbox),
with a stand-in ``deepspeed`` that records the launch, whose layout and trainer flags are
then validated at the world size it launches; the README's first one without its
tokenizer files stops before the launcher; and ``scripts/launch_cluster.sh`` with
configs/gpt-125m-8e.yaml at tiny sizes under the real ``deepspeed`` launcher on a
one-line ``localhost slots=2`` hostfile (CPU ranks), on data made by docs/running.md's
own GPT-2 preprocessing command.
"""

import ast
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args, validate_args
from tests import doc_commands as docs
from tests.data.test_tokenizer import write_gpt2_files
from tests.launch import REPO, free_port
from tests.precision import skip_without
from tests.test_readme import NAMED_AS_ABSENT, command_problems

BENCHMARK = ("not run: a benchmark (minutes of multi-rank timing); tests/test_readme.py parses "
             "its flags")
INSTALL = ("not run: installs from the package index; tests/test_readme.py checks that "
           "pyproject.toml declares the extra")
THE_SUITE = "not run: it runs this suite"
RUNNERS = ("bash", "sh", "source", ".", "python", "python3", "deepspeed", "torchrun", "pip",
           "srun")
# Each command the pages show -> "tests/FILE.py::TEST" that runs it (at test sizes, on CPU
# ranks), or "not run: why".
RUN_BY = {
    # README.md
    "bash scripts/quickstart.sh":
        "tests/test_launch_scripts.py::test_quickstart_says_which_device_its_ranks_use",
    "bash scripts/test.sh": THE_SUITE,
    "bash scripts/mutation.sh deepspeed_ext/policy --sample 320 --seed 1":
        "not run: mutation testing takes 18 min for this sample (docs/testing.md); "
        "tests/test_readme.py parses its words",
    "bash scripts/mutation.sh deepspeed_ext/policy --survivors-of "
    "runs/mutation/deepspeed_ext.policy-sample320-seed1.json":
        "not run: it reruns the survivors of the run above; tests/test_readme.py parses its words",
    "bash scripts/test.sh --fast": "not run: it runs this suite's tests that start no process; "
                                   "tests/test_markers.py checks the rule that picks them",
    "source scripts/setup_env.sh":
        "tests/test_packaging.py::test_setup_env_leaves_an_interactive_shell_as_it_was",
    "pip install -e .[gpu]": INSTALL,
    "pip install -e .[test]": INSTALL,
    "pip install -e .": "tests/test_packaging.py::"
                        "test_editable_install_keeps_megatron_core_and_our_megatron_packages",
    'python -c "import megatron; print(megatron.__path__)"':
        "tests/test_packaging.py::"
        "test_editable_install_keeps_megatron_core_and_our_megatron_packages",
    "bash scripts/gpu_check.sh":
        "tests/test_gpu_check.py::test_without_cuda_every_check_is_skipped_naming_why",
    "bash scripts/launch_1node_dp8_ep8.sh hostfile data/web_text_document --vocab-file "
    "gpt2-vocab.json --merge-file gpt2-merges.txt":
        "tests/test_doc_commands.py::test_the_docs_fixed_layout_launches",
    "bash scripts/launch_2node_dp16_ep16.sh hostfile data/web_text_document --vocab-file "
    "gpt2-vocab.json --merge-file gpt2-merges.txt":
        "tests/test_doc_commands.py::test_the_docs_fixed_layout_launches",
    "bash scripts/launch_2node_dp16_ep8.sh hostfile data/web_text_document --vocab-file "
    "gpt2-vocab.json --merge-file gpt2-merges.txt --save /ckpt --load /ckpt":
        "tests/test_doc_commands.py::test_the_docs_fixed_layout_launches",
    "bash scripts/launch_cluster.sh hostfile DATA CONFIG NODES GPUS_PER_NODE EP [flags...]":
        "tests/test_doc_commands.py::test_launch_cluster_trains_the_125m_config_on_localhost",
    "python benchmarks/checkpoint_bench.py --nproc 4 --tp 2 --ep 2 --repeats 5": BENCHMARK,
    "python benchmarks/moe_schedule_bench.py": BENCHMARK,
    "python benchmarks/localized_recovery_bench.py --stages 2 4": BENCHMARK,
    # docs/architecture.md
    "python docs/make_architecture.py":
        "tests/test_architecture_doc.py::test_the_committed_picture_is_what_the_script_draws_now",
    # docs/exact-recovery.md
    "bash scripts/run_elastic.sh 2 3 --config configs/small.yaml --data-path "
    "data/stdlib_text_document --save runs/x/ckpt --load runs/x/ckpt --moc-checkpoint "
    "--moc-mode exact --moc-window 4":
        "tests/deepspeed_ext/exact/test_exact.py::test_crash_mid_window_replays_to_the_bit",
    "moc-ckpt densify <save> --out <dir> [-- FLAGS...]":
        "tests/deepspeed_ext/exact/test_exact.py::"
        "test_densify_replays_frames_into_the_checkpoint_an_uninterrupted_run_saves",
    "python benchmarks/exact_bench.py --out runs/exact_bench --json exact.json --plot exact.png":
        BENCHMARK,
    # docs/failures.md
    "bash scripts/run_elastic.sh 2 3 --config configs/tiny.yaml --data-path DATA --train-iters "
    "16 --save runs/f/ckpt --load runs/f/ckpt --moc-checkpoint --moc-pec-k 1 --save-interval 4 "
    "--moc-monitor --moc-hang-timeout 10 --moc-dynamic-k --moc-fault crash@6:rank=1 "
    "hang@12:rank=0":
        "tests/training/test_restart.py::test_hang_is_detected_named_and_the_job_restarts",
    "MAX_RESTARTS=N bash scripts/launch_cluster.sh ...":
        "tests/test_launch_scripts.py::test_failed_job_is_relaunched_until_it_succeeds",
    "bash scripts/run_elastic.sh 3 0 --config configs/tiny.yaml --data-path DATA --save ckpt "
    "--load ckpt --moc-checkpoint --moc-two-level --moc-snapshot-interval 1 --moc-restart "
    "in-job --moc-spares 1":
        "not run: one node of it is the two-node test's supervisor with --nnodes 1 "
        "(tests/deepspeed_ext/supervisor/test_supervisor.py); benchmarks/restart_bench.py "
        "runs it with 4 ranks",
    "bash scripts/run_elastic.sh 5 0 --config configs/tiny.yaml --data-path DATA --save ckpt "
    "--load ckpt --moc-checkpoint --pipeline-model-parallel-size 2 --zero-stage 1 "
    "--expert-interval 1 --moc-mode exact --moc-window 2 --moc-upstream-logging --moc-restart "
    "in-job --moc-spares 1":
        "tests/training/test_pipeline_training.py::"
        "test_a_crashed_stage_recovers_alone_in_job_to_the_bit",
    "COORDINATOR=serve NNODES=3 SPARE_NODES=1 RDZV_ENDPOINT=HEAD:29500 bash scripts/run_elastic.sh "
    "2 0 --config configs/tiny.yaml --data-path DATA --save ckpt --load ckpt --moc-checkpoint "
    "--moc-two-level --moc-snapshot-interval 1 --moc-redundancy replicate --moc-ranks-per-node 1 "
    "--moc-restart in-job --moc-spares 1":
        "tests/training/test_restart.py::"
        "test_in_job_restart_a_crash_goes_to_its_node_s_spare_and_a_lost_node_0_to_the_spare_node",
    "COORDINATOR=join NNODES=3 SPARE_NODES=1 NODE_RANK=I RDZV_ENDPOINT=HEAD:29500 bash "
    "scripts/run_elastic.sh 2 0 --config configs/tiny.yaml --data-path DATA --save ckpt --load "
    "ckpt --moc-checkpoint --moc-two-level --moc-snapshot-interval 1 --moc-redundancy replicate "
    "--moc-ranks-per-node 1 --moc-restart in-job --moc-spares 1":
        "tests/training/test_restart.py::"
        "test_in_job_restart_a_crash_goes_to_its_node_s_spare_and_a_lost_node_0_to_the_spare_node",
    "NNODES=2 NODE_RANK=I RDZV_ENDPOINT=NODE0:29500 bash scripts/run_elastic.sh 2 0 --config "
    "configs/tiny.yaml --data-path DATA --save ckpt --load ckpt --moc-checkpoint --moc-two-level "
    "--moc-snapshot-interval 1 --moc-restart in-job --moc-spares 1":
        "tests/training/test_restart.py::"
        "test_in_job_restart_a_crash_goes_to_its_node_s_spare_and_a_lost_node_0_to_the_spare_node",
    "MAX_RESTARTS=3 bash scripts/launch_cluster.sh hostfile data/web_text_document "
    "configs/small.yaml 2 8 2 --global-batch-size 56 "
    "--save ckpt --load ckpt --moc-checkpoint --moc-two-level --moc-restart in-job "
    "--moc-spares 1":
        "tests/test_launch_scripts.py::"
        "test_an_in_job_launch_runs_one_supervisor_per_host_and_relaunches_on_the_next_port",
    "SPARE_NODES=1 COORDINATOR_HOST=HEAD MAX_RESTARTS=3 bash scripts/launch_cluster.sh hostfile "
    "data/web_text_document configs/small.yaml 2 8 2 --global-batch-size 56 --save ckpt --load "
    "ckpt --moc-checkpoint --moc-two-level --moc-redundancy replicate --moc-restart in-job "
    "--moc-spares 1":
        "tests/test_launch_scripts.py::"
        "test_an_in_job_launch_starts_spare_nodes_and_a_coordinator_and_moves_a_lost_one",
    "python -m deepspeed_ext.supervisor --nproc 2 --spares 1 --nnodes 2 --node-rank 1 "
    "--master-addr NODE0 --port 29500 -- PROGRAM [ARGS...]":
        "tests/training/test_restart.py::"
        "test_in_job_restart_a_crash_goes_to_its_node_s_spare_and_a_lost_node_0_to_the_spare_node",
    "python -m deepspeed_ext.supervisor --nproc 2 --spares 1 [--max-rounds 3] [--grace-s 10] "
    "[--port 29500] -- PROGRAM [ARGS...]":
        "tests/deepspeed_ext/supervisor/test_supervisor.py::"
        "test_a_killed_rank_goes_to_a_spare_the_survivors_keep_running_and_the_other_is_released",
    "python benchmarks/restart_bench.py --ranks 4 --repeats 3": BENCHMARK,
    "python benchmarks/restart_bench.py --ranks 4 --repeats 5": BENCHMARK,
    "python benchmarks/restart_bench.py --ranks 4 --repeats 3 --iters 48 --crash-at 32": BENCHMARK,
    "python benchmarks/restart_bench.py --ranks 4 --repeats 2 --fault hang": BENCHMARK,
    "python benchmarks/restart_trials.py --trials 20 --seed 1 --ranks 4": BENCHMARK,
    "python benchmarks/restart_trials.py --trials 20 --seed 5 --ranks 4": BENCHMARK,
    "python benchmarks/restart_trials.py --trials 20 --seed 6 --ranks 4": BENCHMARK,
    "python benchmarks/restart_trials.py --trials 20 --seed 7 --ranks 4": BENCHMARK,
    "python benchmarks/restart_trials.py --trials 20 --seed 5 --ranks 4 --refill": BENCHMARK,
    "python benchmarks/restart_trials.py --trials 16 --seed 5 --ranks 4 --refill": BENCHMARK,
    "python benchmarks/restart_trials.py --trials 20 --seed 1 --ranks 4 --pipeline": BENCHMARK,
    "python experiments/accuracy.py --out runs/accuracy":
        "not run: the accuracy experiment (thousands of iterations); tests/test_readme.py "
        "parses its flags",
    "pip install -e .[bench]": INSTALL,
    # docs/flags.md
    "python pretrain_gpt_moe.py --help":
        "tests/training/test_upstream_flags.py::"
        "test_help_shows_defaults_without_importing_torch_or_deepspeed",
    # docs/gpu.md
    "set -o pipefail; bash scripts/gpu_check.sh 2>&1 | tee console.log":
        "tests/test_gpu_check.py::test_without_cuda_every_check_is_skipped_naming_why",
    "bash scripts/gpu_wheels.sh": "not run: downloads wheels from the package index",
    "pip install --no-index --no-deps --target /tmp/moc-gpu-site":
        "tests/test_gpu_check.py::test_a_failed_install_fails_the_run_and_runs_no_check",
    "bash scripts/gpu_check.sh --only cuda_unit_tests,checkpoint_stall":
        "tests/test_gpu_check.py::test_dry_run_writes_the_summary_with_every_check_skipped",
    "bash scripts/gpu_check.sh --only in_job_restart":
        "tests/test_gpu_check.py::test_dry_run_writes_the_summary_with_every_check_skipped",
    # docs/logs.md
    "pip install -e .[tensorboard]": INSTALL,
    # docs/megatron-deepspeed.md
    "python tools/preprocess_data.py --input my_corpus/ --output-prefix data/corpus "
    "--tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file "
    "gpt2-merges.txt --append-eod":
        "tests/training/test_megatron_deepspeed_flags.py::"
        "test_the_125M_script_trains_on_two_ranks_with_moc",
    "DATA_PATH=data/corpus_text_document VOCAB_PATH=gpt2-vocab.json MERGE_PATH=gpt2-merges.txt "
    "bash examples/megatron_deepspeed/ds_pretrain_gpt_125M_MoE64.sh":
        "tests/training/test_megatron_deepspeed_flags.py::"
        "test_the_125M_script_trains_on_two_ranks_with_moc",
    "MOC_PRINT_ARGS=1 ... bash examples/megatron_deepspeed/ds_pretrain_gpt_1.3B_MoE128.sh":
        "tests/training/test_megatron_deepspeed_flags.py::test_example_scripts_parse_and_validate",
    "python benchmarks/activation_checkpointing_memory.py": BENCHMARK,
    "pip install wandb": "not run: installs from the package index",
    # docs/moc-checkpoints.md
    "moc-ckpt inspect runs/a/ckpt": "tests/deepspeed_ext/cli/test_cli.py::test_inspect_all",
    "moc-ckpt verify runs/a/ckpt": "tests/deepspeed_ext/cli/test_cli.py::test_verify_exit_codes",
    "moc-ckpt consolidate runs/a/ckpt --out model.safetensors [--optimizer]":
        "tests/deepspeed_ext/cli/test_cli.py::test_consolidate_with_optimizer_and_fallback",
    "moc-ckpt consolidate runs/a/ckpt --out model.safetensors --padded-vocab-size 264":
        "tests/deepspeed_ext/format/test_vocab.py::"
        "test_consolidate_writes_the_vocabulary_with_the_rows_asked_for",
    "moc-ckpt densify runs/a/ckpt --out runs/a/dense":
        "tests/deepspeed_ext/exact/test_exact.py::"
        "test_densify_replays_frames_into_the_checkpoint_an_uninterrupted_run_saves",
    "moc-ckpt densify runs/a/ckpt --out runs/a/dense -- --config my.yaml --data-path data/x":
        "tests/deepspeed_ext/cli/test_cli.py::test_densify_uses_the_flags_given_after_double_dash",
    "python benchmarks/checkpoint_bench.py": BENCHMARK,
    "moc-ckpt import UPSTREAM_SAVE_DIR --out runs/imported":
        "tests/training/test_import_upstream.py::"
        "test_moc_s_model_from_the_import_gives_upstream_s_next_loss",
    "moc-ckpt export runs/a/ckpt --format megatron-deepspeed --out runs/a/upstream":
        "tests/deepspeed_ext/interop/test_export.py::"
        "test_the_export_of_the_import_is_upstream_s_checkpoint_again",
    "moc-ckpt export DIR --format megatron-deepspeed --out NEW":
        "tests/deepspeed_ext/interop/test_export.py::"
        "test_an_export_imported_again_is_bitwise_the_checkpoint_it_came_from",
    "moc-ckpt export runs/a/ckpt --format hf --out runs/a/hf":
        "tests/training/test_mixtral_shape.py::"
        "test_the_hugging_face_export_gives_the_same_logits_in_transformers",
    "moc-ckpt import DIR --out NEW":
        "tests/deepspeed_ext/cli/test_import_cmd.py::"
        "test_import_writes_a_loadable_checkpoint_and_says_what_it_carried",
    # docs/moe-schedules.md
    "python benchmarks/moe_schedule_bench.py --json FILE --plot FILE": BENCHMARK,
    "python benchmarks/moe_schedule_bench.py --nproc 8 --experts-per-rank 1": BENCHMARK,
    # docs/node-loss.md
    "bash scripts/run_elastic.sh 6 2 --config configs/tiny.yaml --data-path "
    "data/stdlib_text_document --train-iters 14 --global-batch-size 12 --save runs/node-loss/ckpt "
    "--load runs/node-loss/ckpt --moc-checkpoint --moc-two-level --moc-persist-interval 5 "
    "--save-interval 1 --moc-ranks-per-node 2 --moc-redundancy erasure --moc-ec-data 2 "
    "--moc-fault lose-memory@8:rank=2":
        "tests/deepspeed_ext/test_peers.py::test_erasure_rebuilds_a_lost_node_from_parity",
    "python benchmarks/redundancy_bench.py --json redundancy.json --plot redundancy.png":
        BENCHMARK,
    # docs/pipeline-parallel.md
    "torchrun --nproc-per-node 4 pretrain_gpt_moe.py --config configs/tiny.yaml --data-path "
    "PREFIX --pipeline-model-parallel-size 2 --zero-stage 1 --expert-interval 1":
        "tests/training/test_pipeline_training.py::test_two_pipeline_stages_train_as_one",
    "torchrun --nproc-per-node 4 pretrain_gpt_moe.py --config configs/tiny.yaml --data-path "
    "PREFIX --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --zero-stage 1 "
    "--expert-interval 1":
        "tests/training/test_pipeline_training.py::"
        "test_pipeline_stages_with_tensor_parallelism_train_as_one",
    "torchrun --nproc-per-node 4 pretrain_gpt_moe.py --config configs/tiny.yaml --data-path "
    "PREFIX --pipeline-model-parallel-size 2 --zero-stage 1 --expert-interval 1 "
    "--moc-checkpoint --moc-pec-k 2 --save ckpt --save-interval 100":
        "tests/training/test_pipeline_training.py::test_moc_checkpoints_of_pipeline_stages",
    "torchrun --nproc-per-node 4 pretrain_gpt_moe.py --config configs/tiny.yaml --data-path "
    "PREFIX --pipeline-model-parallel-size 2 --zero-stage 1 --expert-interval 1 "
    "--moc-checkpoint --save ckpt --moc-mode exact --moc-window 2 --moc-upstream-logging "
    "--moc-fault lose-stage@4:rank=2":
        "tests/training/test_pipeline_training.py::"
        "test_a_stage_that_loses_its_state_recovers_in_place_to_the_bit",
    # docs/planning.md
    "moc-plan recommend --config configs/gpt-350m-16e.yaml --gpus 16 --mtbf 600 "
    "--iteration-time 1.2 --node-failure-fraction 0.3":
        "tests/deepspeed_ext/planning/test_cli.py::test_recommend_prints_table_and_flags",
    "moc-plan simulate --config configs/moe-250b.yaml --gpus 4096 --mtbf "
    "300,900,1800,3600,14400 --iteration-time 8 --restart-s 300 --node-failure-fraction 0.3 "
    "--seeds 5 --plot out.png":
        "tests/deepspeed_ext/planning/test_cli.py::test_simulate_default_policies_and_plot",
    "moc-plan calibrate --dir /path/on/checkpoint/storage --out hw.json [--config "
    "configs/small.yaml --data-path data/stdlib_text_document [--with-restart]] [--from-json "
    "a_benchmark.json]":
        "tests/deepspeed_ext/planning/test_calibrate.py::"
        "test_calibrate_cli_from_json_writes_a_hardware_file",
    "moc-plan simulate --config configs/moe-250b.yaml --gpus 4096 --mtbf 600 --iteration-time "
    "8 --restart-s 120 --node-failure-fraction 0.2 --seeds 3 --restart in-job --spares 96":
        "tests/deepspeed_ext/planning/test_restart_cli.py::"
        "test_the_docs_in_job_simulation_at_4096_gpus",
    "moc-plan simulate --config configs/moe-250b.yaml --gpus 4096 --mtbf 600 --iteration-time "
    "8 --restart-s 120 --node-failure-fraction 0.2 --seeds 3 --restart in-job --spares 96 "
    "--in-job-detection-s 0.105 --in-job-leave-s 0.046 --in-job-teardown-s 0.098 "
    "--in-job-rendezvous-s 0.001 --in-job-groups-s 0.054 --in-job-engine-s 0.403 "
    "--in-job-first-step-s 0.071":
        "tests/deepspeed_ext/planning/test_restart_cli.py::"
        "test_the_docs_in_job_simulation_with_the_measured_phases",
    "moc-plan pipeline --stages 8,16 --micro-batches 32 --window 8 --iteration-time 6 --mtbf "
    "600,3600 --restore-time 2 --downtime 30 [--log-overhead 0] [--json FILE]":
        "tests/deepspeed_ext/planning/test_pipeline.py::"
        "test_moc_plan_pipeline_prints_and_writes_the_comparison",
    # docs/running.md
    "python tools/preprocess_data.py --input path/to/dir --input-ext .txt,.md --output-prefix "
    "data/mycorpus --tokenizer-type ByteLevelTokenizer --append-eod --workers 2":
        "tests/data/test_preprocess.py::test_text_directory_round_trip",
    "python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix "
    "data/web --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file "
    "gpt2-merges.txt --append-eod":
        "tests/test_doc_commands.py::test_launch_cluster_trains_the_125m_config_on_localhost",
    "source .venv/bin/activate": "not run: it activates the environment this suite runs in",
    "deepspeed --num_gpus 2 pretrain_gpt_moe.py --config configs/small.yaml --data-path "
    "data/stdlib_text_document --save runs/a/ckpt --load runs/a/ckpt":
        "tests/training/test_pretrain.py::test_resume_is_bitwise_exact",
    "torchrun --nproc_per_node 4 pretrain_gpt_moe.py --config configs/small.yaml "
    "--moe-expert-parallel-size 4 --data-path data/stdlib_text_document":
        "tests/training/test_pretrain.py::test_torchrun_launch",
    "python pretrain_gpt_moe.py --config configs/tiny.yaml --moe-expert-parallel-size 1 "
    "--data-path data/stdlib_text_document":
        "tests/training/test_pretrain.py::test_single_process_python_run",
    "deepspeed --num_gpus 2 pretrain_gpt_moe.py --config configs/small.yaml --config "
    "configs/checkpoint/moc-pec.yaml --data-path ... --save ckpt --load ckpt":
        "tests/training/test_arguments.py::"
        "test_checkpoint_policy_fragments_compose_with_a_model_config",
    "pip install -e .[bpe]": INSTALL,
    # docs/security.md
    "moc-ckpt verify DIR": "tests/deepspeed_ext/cli/test_cli.py::test_verify_exit_codes",
    "python benchmarks/two_level_bench.py --checksum-speed":
        "tests/test_doc_commands.py::test_the_single_process_benchmarks_run_as_the_docs_show",
    # docs/tensor-parallel.md
    "torchrun --nproc-per-node 4 pretrain_gpt_moe.py --config configs/tiny.yaml --data-path "
    "PREFIX --tensor-model-parallel-size 2 --enable-expert-tensor-parallelism":
        "tests/training/test_tensor_parallel_training.py::"
        "test_tensor_parallel_training_tracks_the_single_rank_layers",
    "python -m pytest -q tests/training/test_tensor_parallel_training.py -k vocabulary":
        "tests/training/test_tensor_parallel_training.py::"
        "test_a_checkpoint_resumes_under_another_vocabulary_padding",
    # docs/troubleshooting.md
    "srun bash scripts/run_elastic.sh 8 3 --config configs/gpt-125m-8e.yaml --data-path "
    "data/web_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt "
    "--moe-expert-parallel-size 8 --save ckpt --load ckpt --moc-checkpoint --moc-two-level":
        "not run: a Slurm job over two 8-GPU nodes; tests/test_readme.py validates its flags "
        "at 8 ranks, and scripts/run_elastic.sh runs in tests/training/test_restart.py",
    # docs/testing.md
    "bash scripts/test.sh tests/data -x": THE_SUITE,
    "MOC_TEST_WORKERS=3 bash scripts/test.sh": THE_SUITE,
    "PYTHONPATH=tests/no_half_precision bash scripts/test.sh": THE_SUITE,
    # docs/two-level.md
    "python pretrain_gpt_moe.py --config configs/tiny.yaml ... --save runs/a/ckpt --load "
    "runs/a/ckpt --moc-checkpoint --moc-two-level --moc-snapshot-interval 1 --moc-k-snapshot 4 "
    "--moc-persist-interval 10 --moc-k-persist 1":
        "tests/training/test_pretrain.py::test_two_level_run_and_resume_match_an_uninterrupted_run",
    "python benchmarks/hostcopy_bench.py":
        "tests/test_doc_commands.py::test_the_single_process_benchmarks_run_as_the_docs_show",
    "python benchmarks/two_level_bench.py --json two_level.json --plot two_level.png": BENCHMARK,
    "python benchmarks/two_level_bench.py --json two_level.json": BENCHMARK,
    # benchmarks/README.md
    "python benchmarks/checkpoint_bench.py [--json FILE]": BENCHMARK,
    "python benchmarks/two_level_bench.py [--json FILE] [--plot FILE.png]": BENCHMARK,
    "python benchmarks/exact_bench.py [--out DIR] [--json FILE] [--plot FILE]": BENCHMARK,
    "python benchmarks/redundancy_bench.py [--json FILE] [--plot FILE]": BENCHMARK,
    "python benchmarks/hostcopy_bench.py [--mib 256] [--json FILE]":
        "tests/test_doc_commands.py::test_the_single_process_benchmarks_run_as_the_docs_show",
}


def _template(command: docs.Command) -> bool:
    """A usage template whose program is a placeholder (``python SCRIPT ARGS``,
    ``python benchmarks/<name>.py``): nothing to run."""
    return any(docs.is_placeholder(w) or "PLACEHOLDER_" in w
               for step in docs.steps(command.text) for w in [step.program, *step.args[:1]])


def _runs_the_project(command: docs.Command) -> bool:
    """Whether a step of ``command`` runs something of this project (a script, a Python
    program, a launcher, pip); ``cd``, ``ls``, ``rm`` and the like do not."""
    return any(step.program in RUNNERS or step.program.startswith("moc-")
               for step in docs.steps(command.text))


def shown_commands():
    """The commands that need an entry: those that run something of the project, fenced,
    or inline as a whole command (it parses as one); {text: [where]}."""
    out = {}
    for command in docs.commands():
        if command.text in NAMED_AS_ABSENT or _template(command) \
                or not _runs_the_project(command):
            continue
        if command.fenced or not command_problems(command, whole=True):
            out.setdefault(command.text, []).append(f"{command.page}:{command.line}")
    return out


def test_every_command_the_docs_show_is_run_by_a_test():
    shown = shown_commands()
    assert len(shown) > 40, "the pages' commands were not found"
    missing = [f"{where[0]}: {text!r}" for text, where in shown.items() if text not in RUN_BY]
    assert not missing, ("commands the docs show with no test in RUN_BY of "
                         "tests/test_doc_commands.py (add the test that runs each, or "
                         "'not run: why'):\n" + "\n".join(missing))
    stale = [text for text in RUN_BY if text not in shown]
    assert not stale, "RUN_BY entries no page shows any more:\n" + "\n".join(stale)


def _test_names(path: str) -> set:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_each_entry_names_a_test_that_exists_or_why_none_runs_it():
    bad = []
    for text, entry in RUN_BY.items():
        if entry.startswith("not run: ") and len(entry) > len("not run: ") + 10:
            continue
        path, _, name = entry.partition("::")
        if not (path.startswith("tests/") and os.path.isfile(os.path.join(REPO, path))
                and name in _test_names(path)):
            bad.append(f"{text!r}: {entry}")
    assert not bad, "RUN_BY entries that name no test and no reason:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------
# The cluster commands.

FIXED_LAYOUT = re.compile(r"scripts/launch_(\d+)node_dp(\d+)_ep(\d+)\.sh")
CLEARED = ("MASTER_ADDR", "MASTER_PORT", "DS_ENV_FILE", "EXCLUDE_SUSPECTS", "MOC_EVENT_FILE",
           "MAX_RESTARTS", "DEEPSPEED", "DS_ACCELERATOR")


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    home = tmp_path / "home"  # no ~/.deepspeed_env of the caller's
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), **extra)
    return env


def _fixed_layout_commands():
    return sorted({c.text for c in docs.commands() if c.fenced and FIXED_LAYOUT.search(c.text)})


def _sandbox(text: str, files: dict) -> list:
    """The argv of a one-step doc command: the user's files the page names replaced by
    ``files``' paths, the repository's by absolute paths, ``python`` by this one."""
    (step,) = docs.steps(text)
    argv = []
    for word in [step.program, *step.args]:
        if word in files:
            word = str(files[word])
        elif docs.repo_path(word) and os.path.exists(os.path.join(REPO, word)):
            word = os.path.join(REPO, word)
        elif word in ("python", "python3"):
            word = sys.executable
        argv.append(word)
    return argv


def _cluster_files(tmp_path: Path) -> dict:
    """The files the cluster commands name, made: a hostfile of two 8-slot nodes, a data
    prefix (never read: the launcher is a stand-in), GPT-2 tokenizer files."""
    vocab, merges = write_gpt2_files(tmp_path / "gpt2")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\n")
    for suffix in (".idx", ".bin"):
        (tmp_path / f"web_text_document{suffix}").write_bytes(b"x")
    return {"hostfile": hostfile, "data/web_text_document": tmp_path / "web_text_document",
            "gpt2-vocab.json": vocab, "gpt2-merges.txt": merges, "/ckpt": tmp_path / "ckpt"}


def _without_tokenizer_files(argv: list) -> list:
    out = []
    for word in argv:
        if out and out[-1] in ("--vocab-file", "--merge-file"):
            out.pop()
            continue
        out.append(word)
    return out


def _recorder(tmp_path: Path) -> Path:
    """A stand-in ``deepspeed`` that writes its arguments to $RECORD, one per line."""
    recorder = tmp_path / "deepspeed"
    recorder.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD"\n')
    recorder.chmod(0o755)
    return recorder


@pytest.mark.parametrize("text", _fixed_layout_commands())
def test_the_docs_fixed_layout_launches(text, tmp_path):
    """The page's command launches its layout (NODES x 8 ranks, the expert-parallel size of
    its name), and the trainer's flags it passes validate at that world size, with the
    GPT-2 tokenizer files."""
    nodes, dp, ep = map(int, FIXED_LAYOUT.search(text).groups())
    files, record = _cluster_files(tmp_path), tmp_path / "launch"
    env = _env(tmp_path, DEEPSPEED=str(_recorder(tmp_path)), RECORD=str(record))
    proc = subprocess.run(_sandbox(text, files), cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    launch = record.read_text().splitlines()
    script = launch.index("pretrain_gpt_moe.py")
    launcher, trainer = launch[:script], launch[script + 1:]
    assert launcher[launcher.index("--num_nodes") + 1] == str(nodes)
    assert launcher[launcher.index("--num_gpus") + 1] == str(dp // nodes)
    assert ("--no_ssh_check" in launcher) == (nodes == 1)  # one node: a local launch
    args = validate_args(parse_args(trainer), world_size=dp)
    assert (args.data_parallel_size, args.moe_expert_parallel_size, args.zero_stage) == (dp, ep, 2)
    assert (args.tokenizer_type, args.vocab_file, args.merge_file) == \
        ("GPT2BPETokenizer", str(files["gpt2-vocab.json"]), str(files["gpt2-merges.txt"]))
    assert args.save in (None, str(files["/ckpt"]))


def test_the_readmes_first_launch_without_tokenizer_files_stops_before_the_launcher(tmp_path):
    """The command as the README showed it before it named the tokenizer files: the
    launch stops, saying which files the config needs, and never starts the launcher."""
    text = next(t for t in _fixed_layout_commands() if "launch_1node_dp8_ep8.sh" in t)
    record = tmp_path / "launch"
    env = _env(tmp_path, DEEPSPEED=str(_recorder(tmp_path)), RECORD=str(record))
    proc = subprocess.run(_without_tokenizer_files(_sandbox(text, _cluster_files(tmp_path))),
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not record.exists()
    assert proc.stderr.strip() == (
        "error: configs/gpt-125m-8e.yaml uses GPT2BPETokenizer: pass --vocab-file and "
        "--merge-file (GPT-2's vocab.json and merges.txt)")


def test_every_fixed_layout_script_is_shown_by_a_page():
    scripts = {os.path.relpath(p, REPO)
               for p in glob.glob(os.path.join(REPO, "scripts", "launch_*node_*.sh"))}
    shown = {FIXED_LAYOUT.search(text).group(0) for text in _fixed_layout_commands()}
    assert scripts and shown == scripts


@pytest.mark.parametrize("extra, message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "error: --tokenizer-type GPT2BPETokenizer: pass "
     "--vocab-file and --merge-file (GPT-2's vocab.json and merges.txt)"),
    (["--vocab-file", "VOCAB"], "error: --vocab-file selects GPT2BPETokenizer: pass "
     "--merge-file (GPT-2's merges.txt)"),
    (["--vocab-file", "VOCAB", "--merge-file", "no/such/merges.txt"],  # from the repository root
     "error: --merge-file no/such/merges.txt: file not found"),
    (["--moc-chekpoint"], "error: unrecognized arguments: --moc-chekpoint"),
])
def test_launch_cluster_checks_the_trainers_flags_before_it_launches(tmp_path, extra, message):
    files = _cluster_files(tmp_path)
    extra = [str(files["gpt2-vocab.json"]) if w == "VOCAB" else w for w in extra]
    proc = subprocess.run(
        ["bash", "scripts/launch_cluster.sh", str(files["hostfile"]),
         str(files["data/web_text_document"]), "configs/tiny.yaml", "1", "2", "2", *extra],
        cwd=REPO, env=_env(tmp_path, DEEPSPEED="false"), capture_output=True, text=True,
        timeout=60)
    assert proc.returncode == 2  # `false` as the launcher would have exited 1
    assert proc.stderr.splitlines()[0].startswith(message), proc.stderr


# GPT-125M-8E at test sizes: the config's every other setting (8 experts every other layer,
# top-1, bf16, ZeRO-2, GPT-2 BPE) as it is.
TINY_125M = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--global-batch-size", "2", "--train-iters", "2", "--lr-warmup-iters", "0",
             "--log-interval", "1", "--split", "90,10,0"]
PREPROCESS = "python tools/preprocess_data.py --input corpus.jsonl --json-keys text"


def _gpt2_data(tmp_path: Path) -> dict:
    """docs/running.md's JSONL preprocessing command, as shown, on 80 short documents with
    the small GPT-2 vocabulary of the tokenizer tests; returns the files it names."""
    vocab, merges = write_gpt2_files(tmp_path / "gpt2")
    words = "the cat and the hat sat in the sun at the end of the day".split()
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for i in range(80):
            text = " ".join(words[(i + j) % len(words)] for j in range(40))
            f.write(json.dumps({"text": text}) + "\n")
    files = {"corpus.jsonl": tmp_path / "corpus.jsonl", "data/web": tmp_path / "data" / "web",
             "gpt2-vocab.json": vocab, "gpt2-merges.txt": merges}
    (command,) = {c.text for c in docs.commands() if c.text.startswith(PREPROCESS)}
    proc = subprocess.run(_sandbox(command, files), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=_env(tmp_path, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files["data/web_text_document"] = tmp_path / "data" / "web_text_document"
    return files


def test_launch_cluster_trains_the_125m_config_on_localhost(tmp_path):
    """The launch of the README's cluster section, for real at test sizes: DeepSpeed's
    launcher on a one-line localhost hostfile, 2 CPU ranks, expert-parallel 2, MoC
    checkpoints; no passwordless ssh needed (one node launches locally)."""
    skip_without("bf16", "the config's flags and tokenizer files are checked at 8 and 16 "
                 "ranks by the tests above, without training")  # the config sets bf16
    files = _gpt2_data(tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    ckpt, metrics, port = tmp_path / "ckpt", tmp_path / "metrics.jsonl", free_port()
    proc = subprocess.run(
        ["bash", "scripts/launch_cluster.sh", str(hostfile), str(files["data/web_text_document"]),
         "configs/gpt-125m-8e.yaml", "1", "2", "2", "--vocab-file", str(files["gpt2-vocab.json"]),
         "--merge-file", str(files["gpt2-merges.txt"]), *TINY_125M, "--save", str(ckpt),
         "--load", str(ckpt), "--save-interval", "2", "--moc-checkpoint",
         "--metrics-file", str(metrics)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=_env(tmp_path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                 MASTER_PORT=str(port)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "world size 2, expert-parallel 2, ZeRO stage 2" in out and "bf16" in out
    assert "8 experts every 2 layers, top-1" in out
    train = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [row["lm_loss"] for row in train if row["kind"] == "train"]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
    assert (ckpt / "latest").read_text().strip() == "global_step2"
    assert (ckpt / "global_step2" / "manifest.json").exists()
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []


def test_the_single_process_benchmarks_run_as_the_docs_show(tmp_path):
    """The benchmarks that take seconds in one process run as the pages show them (the
    host copy at 8 MiB instead of 256): each prints its table and exits 0, and the host
    copy's --json file holds the measured copy. The multi-rank benchmarks take minutes;
    their flags are parsed by tests/test_readme.py."""
    env = _env(tmp_path, PYTHONWARNINGS="ignore")
    checksum = subprocess.run([sys.executable, "benchmarks/two_level_bench.py", "--checksum-speed"],
                              cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert checksum.returncode == 0, checksum.stdout + checksum.stderr
    assert re.search(r"^xxh3_64x16m x1 +\| +[\d.]+ \|", checksum.stdout, re.MULTILINE), checksum.stdout
    out = tmp_path / "hostcopy.json"
    copy = subprocess.run([sys.executable, "benchmarks/hostcopy_bench.py", "--mib", "8",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)
    assert copy.returncode == 0, copy.stdout + copy.stderr
    assert "moc snapshot into shared memory" in copy.stdout
    record = json.loads(out.read_text())
    assert record["bytes"] == 8 << 20 and record["copies"], record
