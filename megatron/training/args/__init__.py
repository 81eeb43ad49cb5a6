"""The trainer's flags, one module per group, each with its own checks.

:mod:`megatron.training.arguments` is the entry point (``build_parser``, ``parse_args``,
``validate_args``) and re-exports what callers use; the modules here hold the pieces:

* :mod:`~megatron.training.args.checks` small checkers every group shares
  (``require``, ``check_positive``, ``check_float``, ``check_output_file``);
* :mod:`~megatron.training.args.model` the model's and the experts' flags;
* :mod:`~megatron.training.args.training` batch, optimizer, precision, learning rate,
  checkpoints, DeepSpeed, and the batch sizes derived from the world size;
* :mod:`~megatron.training.args.moc` the ``--moc-*`` flags of MoC checkpointing;
* :mod:`~megatron.training.args.data` datasets and tokenizer;
* :mod:`~megatron.training.args.logs` logging, TensorBoard, Weights & Biases;
* :mod:`~megatron.training.args.yaml_config` ``--config FILE.yaml``;
* :mod:`~megatron.training.args.configs` the library's and the model's configurations
  built from the arguments.

The fault-injection and monitor flags live with their code
(:func:`megatron.training.faults.add_fault_args`,
:func:`megatron.training.monitor.add_monitor_args`), the Megatron-DeepSpeed
compatibility flags in :mod:`megatron.training.megatron_compat`.
"""
