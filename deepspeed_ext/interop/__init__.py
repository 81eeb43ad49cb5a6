"""The way in and out: Megatron-DeepSpeed's DeepSpeed-format MoE checkpoints read
without running their pickles (:mod:`~deepspeed_ext.interop.safe_load`), their names
and fused layouts mapped onto MoC's (:mod:`~deepspeed_ext.interop.megatron_names`),
their ZeRO partitions put back together (:mod:`~deepspeed_ext.interop.zero_files`), the
whole checkpoint read into one record (:mod:`~deepspeed_ext.interop.upstream`) and
written as a MoC checkpoint (:mod:`~deepspeed_ext.interop.moc_write`), for
``moc-ckpt import`` (:mod:`deepspeed_ext.cli.import_cmd`)."""
