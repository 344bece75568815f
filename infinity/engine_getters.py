"""DeepSpeed's engine getters that read the configuration (fp16_enabled(), zero_offload_param(), ...), and for the
engine methods infinity does not have, an AttributeError that says why and what to use instead. A mixin of Engine
(engine.py)."""

from __future__ import annotations

import contextlib
import dataclasses

# DeepSpeed engine names that infinity does not implement, with why / what to use instead.
NOT_HERE = {
    **dict.fromkeys(("curriculum_learning_enabled", "curriculum_learning_config", "data_efficiency_enabled",
                     "data_efficiency_config", "data_sampling_enabled", "data_sampling_config", "random_ltd_enabled",
                     "random_ltd_config", "random_ltd_initialize", "set_custom_curriculum_learning_schedule",
                     "set_data_post_process_func"),
                    "DeepSpeed's data-efficiency library (curriculum learning, random-LTD) is not implemented; "
                    "schedule the data in your own loader"),
    **dict.fromkeys(("flops_profiler_enabled", "flops_profiler_recompute_fwd_factor", "flops_profiler_profile_step",
                     "flops_profiler_module_depth", "flops_profiler_top_modules", "flops_profiler_detailed",
                     "flops_profiler_output_file", "print_forward_breakdown", "get_wall_clock_timers",
                     "memory_breakdown"),
                    "DeepSpeed's profilers are not implemented; engine.zero_stats(), engine.tier_stats() and the "
                    "step line (steps_per_print) report the step's phases, fetches and I/O"),
    **dict.fromkeys(("autotuning_enabled", "autotuning_start_profile_step", "autotuning_end_profile_step",
                     "autotuning_metric_path", "autotuning_model_info_path", "autotuning_metric",
                     "autotuning_profile_model_info"),
                    "DeepSpeed's autotuner is not implemented; `infinity estimate` sizes a config"),
    **dict.fromkeys(("get_tensor_parallel_rank", "get_model_parallel_rank", "get_sequence_parallel_group",
                     "tensor_parallel_config", "autotp_size", "load_moe_state_dict"),
                    "tensor, sequence and expert parallelism are not implemented: infinity is data-parallel ZeRO"),
    **dict.fromkeys(("compile_zero_optimization_stage", "compile_autosp", "compile_autotp", "get_autosp_backend",
                     "get_autotp_backend", "get_deepcompile_backend", "get_deepspeed_compile_backend",
                     "get_compile_time", "register_compile_pass", "is_deepcompile_enabled", "is_deepcompile_active",
                     "is_compiled", "uses_parallelization_pass_only"),
                    "DeepSpeed's compiler passes are not implemented; torch.compile the model before initialize()"),
    **dict.fromkeys(("allreduce_gradients", "allreduce_bucket", "allreduce_and_copy", "allreduce_no_retain",
                     "buffered_allreduce_fallback", "sparse_allreduce_no_retain", "sparse_allreduce_bucket",
                     "sparse_allreduce", "sparse_all_gather", "all_gather_scalar", "coalesce_grad_reduction"),
                    "the gradient reduction is the engine's own (engine.backward reduces in buckets); use "
                    "torch.distributed for collectives of your own"),
    **dict.fromkeys(("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
                     "zero_hpz_partition_size", "zenflow_config", "super_offload", "zero_partial_offload",
                     "cpuadam_cores_perc", "zero_save_muon_momentum_buffer_in_memory"),
                    "ZeRO++ quantization, hpZ, ZenFlow, SuperOffload and partial offload are not implemented "
                    "(their config keys are refused by name)"),
    **dict.fromkeys(("checkpoint_serialization_enabled", "checkpoint_writer_enabled",
                     "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail", "use_node_local_storage",
                     "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_reduce_scatter",
                     "zero_multi_rank_bucket_allreduce", "zero_compute_grad_norm", "zero_contiguous_gradients",
                     "zero_load_from_fp32_weights", "zero_elastic_checkpoint", "zero_module_granularity_threshold",
                     "zero_legacy_stage1", "zero_ignore_unused_parameters", "zero_allgather_partitions",
                     "zero_round_robin_gradients", "zero_parameter_alignment", "zero_log_trace_cache_warnings",
                     "zero_allgather_sequential", "fp16_master_weights_and_gradients",
                     "bf16_master_weights_and_gradients", "bf16_optimizer_states", "torch_autocast_enabled",
                     "torch_autocast_dtype", "torch_autocast_lower_precision_safe_modules", "fp16_auto_cast",
                     "managed_gradient_accumulation", "log_level", "communication_data_type", "postscale_gradients",
                     "gradient_predivide_factor", "is_sanity_checks_enabled", "dynamic_loss_scale_args",
                     "swap_tensor_config", "get_data_types", "get_optimizer_configuration", "collect_python_gc",
                     "is_first_weights_partition_group", "get_type", "dataloader_drop_last",
                     "is_map_style_dataset", "is_iterable_style_dataset", "optimizer_legacy_fusion"),
                    "a getter of a DeepSpeed setting that infinity does not read (its key is accepted without effect "
                    "or refused by name: the README's key table says which); engine.raw_config holds the config "
                    "as given and engine.config as parsed"),
    **dict.fromkeys(("scale", "clip_fp32_gradients"),
                    "loss scaling and clipping happen inside engine.backward / engine.step (engine.loss_scale, "
                    "gradient_clipping in the config)"),
    "load_module_state_dict": "use load_checkpoint(dir, load_module_only=True), or GatheredParameters(..., "
                              "modifier_rank=0) around model.load_state_dict at stage 3",
    "no_sync": "ZeRO stages 1-3 reduce gradients as they arrive (as DeepSpeed, which refuses no_sync at stages 2-3); "
               "use gradient_accumulation_steps, or set_gradient_accumulation_boundary(False)",
    "deepspeed_io": "pass training_data= to initialize() for the engine's loader, or build a DataLoader with a "
                    "DistributedSampler",
    "load_universal_checkpoint": "every infinity checkpoint is universal: load_checkpoint reads it at any world "
                                 "size, stage or offload mode",
    "dump_state": "print(engine.config) shows the parsed configuration",
}  # fmt: skip


class EngineGetters:
    """Mixed into Engine: it provides ``config`` (config.Config), ``comm``, ``raw_config``."""

    # ---- precision ----
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.enabled and self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return 2.0**self.config.fp16.initial_scale_power

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    # ---- the optimizer and scheduler sections ----
    def optimizer_name(self) -> str | None:
        return None if self.config.optimizer is None else self.config.optimizer.type.lower()

    def optimizer_params(self) -> dict | None:
        return None if self.config.optimizer is None else dict(self.config.optimizer.params)

    def scheduler_name(self) -> str | None:
        return None if self.config.scheduler is None else self.config.scheduler.type

    def scheduler_params(self) -> dict | None:
        return None if self.config.scheduler is None else dict(self.config.scheduler.params)

    # ---- ZeRO ----
    def zero_optimization(self) -> bool:
        return self.config.zero.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero.stage >= 3

    def zero_offload_optimizer(self):
        return self.config.zero.offload_optimizer if self.config.zero.offload_optimizer.enabled else None

    def zero_offload_param(self):
        return self.config.zero.offload_param if self.config.zero.offload_param.enabled else None

    def zero_cpu_offload(self) -> bool:
        return self.config.zero.offload_optimizer.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        return self.config.zero.offload_optimizer.device in ("cpu", "nvme")

    def zero_nvme_offload_optimizer(self) -> bool:
        return self.config.zero.offload_optimizer.device == "nvme"

    def zero_overlap_comm(self) -> bool:
        return self.config.zero.overlap_comm

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero.allgather_bucket_size

    def zero_sub_group_size(self) -> int:
        return self.config.zero.sub_group_size

    def zero_max_live_parameters(self) -> int:
        return self.config.zero.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero.stage3_max_reuse_distance

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero.stage3_prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero.stage3_param_persistence_threshold

    def zero_model_persistence_threshold(self) -> int:
        return self.config.zero.stage3_model_persistence_threshold

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero.stage3_gather_16bit_weights_on_model_save

    def aio_config(self) -> dict:
        return dataclasses.asdict(self.config.aio)

    # ---- ranks and batches ----
    def get_data_parallel_rank(self) -> int:
        return self.comm.rank

    def get_batch_info(self) -> tuple[int, int, int]:
        """DeepSpeed's: (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        config = self.config
        return config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch size, the accumulation steps kept (the global batch changes with it).
        Between optimizer steps only."""
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size!r}): a positive integer")
        self._check_between_steps("set_train_micro_batch_size")  # EngineControls'
        batch = micro_batch_size * self.config.gradient_accumulation_steps * self.comm.world_size
        self.config = dataclasses.replace(self.config, train_micro_batch_size_per_gpu=micro_batch_size,
                                          train_batch_size=batch)  # fmt: skip

    # ---- weights ----
    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """DeepSpeed's: the model's state dict; at stage 3 gathered unit by unit into fp32 copies on every rank
        (collective), as a plain PyTorch model's would be."""
        self.check_states_here("module_state_dict", ("lp_params",))
        self.finish_step()
        if self.stage3 is None:
            return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        from infinity.zero import GatheredParameters

        found = {} if destination is None else destination
        names = {id(param): name for name, param in self.module.named_parameters()}
        for unit in self.stage3.table.units:
            with GatheredParameters(unit.params):
                for param in unit.params:
                    found[prefix + names[id(param)]] = param.detach().clone()
        for name, buffer in self.module.named_buffers():
            found[prefix + name] = buffer.detach().clone()
        return found

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

    def __getattr__(self, name: str):
        with contextlib.suppress(AttributeError):
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        why = NOT_HERE.get(name)
        if why is not None:
            raise AttributeError(f"DeepSpeed's engine.{name} is not in infinity: {why}")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
