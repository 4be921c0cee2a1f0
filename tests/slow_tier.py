"""The slow tier: tests `make test` leaves out and `make test-all` (RUN_SLOW=1) runs, each with the test
of the fast tier that covers its path. tests/conftest.py marks them `slow`; an entry that names no
collected test stops the run, so the table cannot drift from the tests.

A case lands here when another case of the fast tier runs the same code path on a smaller grid or
model, or when it is an exhaustive sweep over families, grids or schedules. Seconds are one run's,
measured with the machine loaded.
"""

# test id -> the fast-tier test that covers its path
SLOW = {
    # GPT-2's fused c_attn regrouped at 2x4 under 2D (14 s loaded): the same regroup's bytes per column against its
    # plan at 1 x 8, and the regrouped c_attn's parity at 2x2 on every rank
    "tests/test_dry_run.py::test_a_fused_weight_regroups_in_one_all_to_all[grid1-2d]":
        "test_dry_run.py::test_a_fused_weight_regroups_in_one_all_to_all[grid0-1d] and "
        "test_hf.py::test_family_parity[gpt2]",
    # the overlap benchmark end to end (a fresh 4-rank job, ~30 s): the switch's effect on transfers in flight,
    # results, bytes and launches stays, per lowering and product
    "tests/test_bench.py::test_overlap_benchmark_runs_both_settings_alike":
        "test_comm.py::test_next_panel_travels_during_the_current_matmul",
    # the search on every published run (40 s): the search beating the configurations it holds, on a small model
    "tests/test_estimate.py::test_plans_beat_the_published_configurations":
        "test_estimate.py::test_choose_plan_beats_the_configurations_it_searches",
    # the hang diagnosis raised with the CollectiveError (16 s): the same diagnosis, written by the watcher
    # while the ranks wait, stays; so does a timed-out collective's error carrying it (clip)
    "tests/test_api_guards.py::test_a_skipped_collective_is_named_by_every_rank":
        "test_api_guards.py::test_a_hang_is_diagnosed_while_it_waits and "
        "test_api_guards.py::test_a_hang_is_diagnosed_while_it_waits",
    # torchtitan's context-parallel runs estimated (15 s): the estimate against the published runs stays in
    # test_published_runs_within_the_issues_bounds, cp's parity and bytes in test_context.py
    "tests/test_estimate.py::test_context_parallel_runs_against_torchtitans_tables":
        "test_estimate.py::test_published_runs_within_the_issues_bounds and test_context.py::test_cp4_alone_gpt",
    # context parallelism beside a 2x2 grid (8 ranks, 60-100 s loaded): cp beside a 1x2 grid and cp 4 alone stay
    "tests/test_context.py::test_cp2_with_a_2x2_grid":
        "test_context.py::test_cp2_with_a_1x2_grid_llama and test_context.py::test_cp4_alone_gpt",
    "tests/test_context.py::test_cp2_families[mistral]": "test_context.py::test_cp2_families[qwen2]",
    # DCP across cp degrees (19 s): save_pretrained at cp 2 loaded on one process, and DCP across grids
    "tests/test_context.py::test_a_distributed_checkpoint_loads_across_cp_degrees":
        "test_context.py::test_a_cp2_checkpoint_loads_on_one_process and "
        "test_training.py::test_dcp_save_resume_and_reshard",
    # context parallelism compiled (inductor, ~60 s): compile=True's parity stays in test_compile.py, cp's in the
    # eager cases here
    "tests/test_context.py::test_cp4_compiled[auto-alltoall]":
        "test_compile.py::test_a_new_shape_compiles_once and test_context.py::test_cp4_alone_gpt[auto-alltoall]",
    "tests/test_context.py::test_cp4_compiled[ring-ring]":
        "test_compile.py::test_a_new_shape_compiles_once and test_context.py::test_cp4_alone_gpt[ring-ring]",
    "tests/test_context.py::test_cp2_families[neox]": "test_context.py::test_cp2_families[qwen2]",
    # replicas beside the cp ranks, sharded (~5 s): the same grid replicated, and FSDP over the cp ranks alone
    "tests/test_context.py::test_cp2_beside_data_parallel_replicas[shard]":
        "test_context.py::test_cp2_beside_data_parallel_replicas[replicate] and "
        "test_context.py::test_cp2_with_sharded_blocks_llama",
    # moved for the 12-minute budget (Dec 2026; seconds as measured in the full fast tier on this machine):
    # compiled generation (26 s): compile=True's parity and one graph per program stay in test_compile.py, the
    # generation programs' tokens in test_greedy_token_identical
    "tests/test_generate.py::test_generate_compiled":
        "test_compile.py::test_a_new_shape_compiles_once and test_generate.py::test_greedy_token_identical",
    # the cache in unequal blocks (14 s): the uneven activations' blocks stay in test_uneven.py, the cache's
    # bytes per rank in test_cache_bytes_per_rank
    "tests/test_generate.py::test_cache_split_in_unequal_blocks":
        "test_generate.py::test_cache_bytes_per_rank and test_uneven.py::test_three_heads_parity[grid0]",
    "tests/test_generate.py::test_a_strategy_per_phase[2d-2d-1d]":
        "test_generate.py::test_projection_searches_each_phase and test_greedy_with_other_strategies[1d]",
    # max_batch's fit at every scheme (19 s): the command line's max_batch runs the same search
    "tests/test_capacity.py::test_fixed_schemes_fit_at_their_batch_and_not_one_step_above":
        "test_capacity.py::test_cli_max_batch_json_and_refusals",
    # the cube picked at 512 devices (12 s): the arrangement search picking and building the cube at 8 ranks
    "tests/test_arrange.py::test_the_cube_is_picked_with_3d_units_where_it_is_estimated_fastest":
        "test_cube.py::test_the_search_arranges_the_ranks_and_matches_one_process",
    # an MoE from a checkpoint traced on meta (11 s): the checkpoint round trip of Mixtral at 2x2 and the meta
    # capture of an MoE plan
    "tests/test_moe.py::test_moe_from_pretrained_on_cpu":
        "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[mixtral] and "
        "test_moe.py::test_meta_built_moe_plan_measures_activations",
    # the Trainer (11 + 10 s): ParallelTrainer's train, save and resume at 2x2 stays; sharded replicas' parity
    # against one process in test_sharded_replicas_match_one_process
    "tests/test_sharded.py::test_parallel_trainer_trains_sharded_replicas":
        "test_trainer.py::test_llama_2x2_train_save_resume and "
        "test_sharded.py::test_sharded_replicas_match_one_process",
    "tests/test_trainer.py::test_bf16_evaluate_predict_and_eval_during_training":
        "test_trainer.py::test_llama_2x2_train_save_resume and test_numerics.py (bf16)",
    # inspect --grid auto (8 s, a subprocess): the arrangement search's table in test_arrange.py, inspect's JSON
    "tests/test_plan.py::test_cli_grid_auto_and_strategy": "test_plan.py::test_cli_json and test_arrange.py",
    # the recompute search's plan run at parity (7 s): recompute='blocks' at parity and the search's choice
    "tests/test_recompute.py::test_search_plan_with_recomputed_blocks_runs_at_parity":
        "test_recompute.py::test_hf_parity[llama-grid0-blocks] and "
        "test_recompute.py::test_search_recomputes_the_fewest_blocks_that_fit",
    # transformers checkpoints of more vision and encoder families (12 s): Llama, GPT-2, T5, Mixtral, DINOv2 at
    # 1x4 keep the loader's paths (tied, untied, encoder-decoder, experts, SwiGLU vision)
    **{f"tests/test_reload.py::test_transformers_checkpoint_roundtrip_2x2[{f}]":
       "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[llama_tied] and "
       "test_transformers_checkpoint_roundtrip_1x4[dinov2_swiglu]" for f in ("segformer", "vit", "bert_legacy",
                                                                             "dinov2_swiglu")},
    # the device audit over replicas, generation and a mixture of experts (about 25 s): the pipeline's case
    # keeps the audit's path (stage sends, the loss broadcast, clipping, save_pretrained)
    "tests/test_device.py::test_autopar_hands_collectives_no_host_tensor[paths1]":
        "test_device.py::test_autopar_hands_collectives_no_host_tensor[paths0]",
    # 1D's program at 64 ranks, every position dry-run (30-40 s): the 2D 8x8 case keeps the dry run's path,
    # test_estimate's 1D dry run checks 1D's bytes against the estimate on every simulated rank, and
    # test_ranks_simulated_in_one_process_keep_their_own_meshes the ranks that hold no row of a table
    "tests/test_dry_run.py::test_every_position_builds_and_its_bytes_are_the_plan[1d-1x64]":
        "test_dry_run.py::test_every_position_builds_and_its_bytes_are_the_plan[2d-8x8] and "
        "test_estimate.py::test_the_dry_run_moves_and_holds_what_the_estimate_says[1d]",
    # the estimate against a dry run of 2D, and of 1D over sharded replicas (2.5 s each): 1D and the
    # pipeline over sharded replicas keep the comparison, test_dry_run.py 2D's bytes against its plan
    "tests/test_estimate.py::test_the_dry_run_moves_and_holds_what_the_estimate_says[2d]":
        "test_estimate.py::test_the_dry_run_moves_and_holds_what_the_estimate_says[1d] and "
        "test_dry_run.py::test_every_position_builds_and_its_bytes_are_the_plan[2d-8x8]",
    "tests/test_estimate.py::test_the_dry_run_moves_and_holds_what_the_estimate_says[1d-fsdp2]":
        "test_estimate.py::test_the_dry_run_moves_and_holds_what_the_estimate_says[1d] and "
        "test_estimate.py::test_cli_estimate_json (its --dry-run of TP x FSDP x PP)",
    # the estimate against a pipeline over sharded replicas (3.4 s): the command line's --dry-run runs the same
    # comparison on TP 2 x FSDP 2 x PP 2, test_dry_run.py that FSDP2 gathers once per step in a pipeline
    "tests/test_estimate.py::test_the_dry_run_moves_and_holds_what_the_estimate_says[pp2-fsdp2]":
        "test_estimate.py::test_cli_estimate_json and "
        "test_dry_run.py::test_a_pipelines_fsdp_units_gather_once_per_step",
    # every plan the search can choose, against the oracle: 2x2 splits both axes (25 s each grid); the
    # 1x2 and 2x1 grids repeat its rules with one axis whole
    "tests/test_rules_oracle.py::test_every_plan_the_search_can_choose[q1]":
        "test_rules_oracle.py::test_every_plan_the_search_can_choose[q0]",
    "tests/test_rules_oracle.py::test_every_plan_the_search_can_choose[q2]":
        "test_rules_oracle.py::test_every_plan_the_search_can_choose[q0]",
    # uneven sizes: the 2x2 cases keep every path (torch.chunk blocks over rows and columns, SUMMA over
    # unequal pieces, reblocking); 6- and 9-rank grids repeat it on more ranks (94, 65, 15 s)
    "tests/test_uneven.py::test_prime_vocabulary_tied_parity[grid2-broadcast]":
        "test_uneven.py::test_prime_vocabulary_tied_parity[grid0-broadcast]",
    "tests/test_uneven.py::test_prime_vocabulary_tied_parity[grid3-broadcast]":
        "test_uneven.py::test_prime_vocabulary_tied_parity[grid0-broadcast]",
    "tests/test_uneven.py::test_prime_vocabulary_tied_parity[grid4-allgather]":
        "test_uneven.py::test_prime_vocabulary_tied_parity[grid1-allgather]",
    "tests/test_uneven.py::test_three_heads_parity[grid1]": "test_uneven.py::test_three_heads_parity[grid0]",
    "tests/test_uneven.py::test_batch_the_rows_do_not_divide[grid1-4-5]":
        "test_uneven.py::test_batch_the_rows_do_not_divide[grid0-3-7]",
    "tests/test_uneven.py::test_hidden_size_the_grid_does_not_divide[grid0-layernorm-gelu]":
        "test_uneven.py::test_hidden_size_the_grid_does_not_divide[grid1-layernorm-gelu]",
    "tests/test_uneven.py::test_hidden_size_the_grid_does_not_divide[grid2-rmsnorm-swiglu]":
        "test_uneven.py::test_hidden_size_the_grid_does_not_divide[grid1-layernorm-gelu] and "
        "test_1d_strategy_with_sizes_the_columns_do_not_divide[rmsnorm-swiglu]",
    "tests/test_uneven.py::test_transformers_models_with_odd_sizes[gpt2-over2-grid2]":
        "test_uneven.py::test_transformers_models_with_odd_sizes[gpt2-over0-grid0]",
    "tests/test_uneven.py::test_kv_heads_the_columns_do_not_divide[over1-grid1]":
        "test_rules_gqa_index.py::test_fewer_kv_heads_parity[llama-True-grid0]",
    # compiled training: one case per way of asking for compile stays (torch.compile(pmodel) on
    # TinyGPT 2x2, compile=True on Llama with grouped all-gather products and on an MLP at 1x4 with
    # new shapes); GPT-2 both ways and the graph checks of larger models (94, 37, 48, 38, 55, 98 s)
    "tests/test_compile.py::test_compiled_training_parity[gpt2-grid3-torch.compile-adamw-broadcast]":
        "test_compile.py::test_a_new_shape_compiles_once",
    "tests/test_compile.py::test_compiled_training_parity[tinygpt-grid1-option-sgd-broadcast]":
        "test_compile.py::test_compiled_training_parity[llama-grid2-option-adamw-allgather]",
    "tests/test_compile.py::test_compiled_program_has_no_graph_breaks[gpt2-grid1]":
        "test_compile.py::test_compiled_program_has_no_graph_breaks[gpt2 uneven-grid2]",
    "tests/test_compile.py::test_compiled_program_has_no_graph_breaks[tinygpt-grid0]":
        "test_compile.py::test_a_new_shape_compiles_once",
    "tests/test_training.py::test_replica_gradients_in_buckets[True]":
        "test_training.py::test_replica_gradients_in_buckets[False] and test_compile.py",
    # generation: every family at one grid; the 1x4 and the other families repeat the cache paths
    "tests/test_generate.py::test_greedy_token_identical[gemma-1x4]":
        "test_generate.py::test_greedy_with_other_strategies[1d]",
    "tests/test_generate.py::test_greedy_token_identical[gemma-2x2]":
        "test_generate.py::test_greedy_token_identical[llama-2x2]",
    "tests/test_generate.py::test_greedy_token_identical[mistral-1x4]":
        "test_generate.py::test_greedy_with_other_strategies[1d]",
    "tests/test_generate.py::test_greedy_token_identical[phi3-1x4]":
        "test_generate.py::test_greedy_with_other_strategies[1d]",
    "tests/test_generate.py::test_greedy_token_identical[qwen2-1x4]":
        "test_generate.py::test_greedy_with_other_strategies[1d]",
    "tests/test_generate.py::test_greedy_token_identical[qwen2-2x2]":
        "test_generate.py::test_greedy_token_identical[llama_gqa-2x2]",
    "tests/test_generate.py::test_greedy_token_identical[llama-1x4]":
        "test_generate.py::test_greedy_with_other_strategies[1d]",
    # ragged batches: one HF family and the repo model at 2x2 and with replicas
    "tests/test_ragged.py::test_hf_ragged_batches[llama-grid0]":
        "test_ragged.py::test_repo_model_ragged_batches[2x1-dp2]",
    "tests/test_ragged.py::test_hf_ragged_batches[llama-grid2]":
        "test_ragged.py::test_repo_model_ragged_batches[2x1-dp2]",
    "tests/test_ragged.py::test_repo_model_ragged_batches[1x4]": "test_ragged.py::test_repo_model_ragged_batches[2x2]",
    "tests/test_ragged.py::test_repo_model_ragged_batches_options[1d]":
        "test_ragged.py::test_repo_model_ragged_batches[2x2]",
    # guards and checkpoints: the same timeout path and a second way to interrupt a save
    "tests/test_api_guards.py::test_timeout_bounds_every_collective[torch clip]":
        "test_api_guards.py::test_a_hang_is_diagnosed_while_it_waits",
    "tests/test_checkpoint_safety.py::test_interrupted_save_distributed_keeps_previous[kill]":
        "test_checkpoint_safety.py::test_interrupted_save_distributed_keeps_previous[raise] and "
        "test_robustness.py::test_dying_rank_raises_on_the_others",
    # grids: 3x3 parity runs in test_engine_parity and test_comm; the sweep's 3x3 repeats it (28 s)
    "tests/test_sweep.py::test_sweep_3x3": "test_engine_parity.py::test_gpt_parity_3x3[layernorm-gelu-broadcast]",
    "tests/test_engine_parity.py::test_gpt_parity_3x3[rmsnorm-swiglu-broadcast]":
        "test_engine_parity.py::test_gpt_parity_3x3[layernorm-gelu-broadcast] and test_gpt_parity_rectangular",
    # the ring lowering: products on every grid in test_comm, the repo model at 2x2 and uneven GPT-2 stay
    "tests/test_engine_parity.py::test_gpt_parity_3x3[rmsnorm-swiglu-ring]":
        "test_engine_parity.py::test_gpt_parity_2x2[rmsnorm-swiglu-ring] and test_comm.py::"
        "test_rectangular_groups_products_redistributions[2x1]",
    "tests/test_engine_parity.py::test_gpt_parity_rectangular[2x3-ring]":
        "test_engine_parity.py::test_gpt_parity_2x2[rmsnorm-swiglu-ring] and test_comm.py::"
        "test_rectangular_groups_products_redistributions",
    "tests/test_uneven.py::test_prime_vocabulary_tied_parity[grid6-ring]":
        "test_uneven.py::test_prime_vocabulary_tied_parity[grid5-ring]",
    "tests/test_uneven.py::test_prime_vocabulary_tied_parity[grid7-ring]":
        "test_uneven.py::test_prime_vocabulary_tied_parity[grid5-ring]",
    "tests/test_compile.py::test_compiled_training_parity[tinygpt-grid4-option-adamw-ring]":
        "test_compile.py::test_a_new_shape_compiles_once and "
        "test_engine_parity.py::test_gpt_parity_2x2[rmsnorm-swiglu-ring]",
    # strategy='3d': the searched mix on the cube (Llama, 3D linears beside 1D, replicated and 2D ones), the
    # repo's GPT under strategy='3d' (one step, its linear's bytes) and the cube's checkpoints stay; every
    # linear 3D on Llama, the repo's GPT over 3 steps (tied head run 2D), GPT-2's Conv1D and uneven sizes
    # repeat their path (12 s each)
    **{f"tests/test_cube.py::test_model_matches_one_process_on_a_cube[{case}]":
       "test_cube.py::test_the_search_arranges_the_ranks_and_matches_one_process and "
       "test_cube.py::test_cube_linear_bytes_are_the_formula_in_a_model"
       for case in ("llama", "tinygpt", "gpt2", "gpt2-uneven")},
    # 3D with routed experts, recomputed blocks and compile=True: the MoE, recompute and compile paths of the
    # 2D grid (the fast tier's test_moe.py, test_recompute.py, test_compile.py) around 3D linears (12-80 s)
    **{f"tests/test_cube.py::test_the_cube_composes[{case}]":
       "test_cube.py::test_the_search_arranges_the_ranks_and_matches_one_process, test_moe.py, test_recompute.py and "
       "test_compile.py" for case in ("mixtral", "recompute=blocks", "compile=True")},
    "tests/test_hf.py::test_strategies_parity[llama-2d-ring]":
        "test_engine_parity.py::test_gpt_parity_2x2[rmsnorm-swiglu-ring]",
    # the Trainer at another grid and family; losses on the second grid
    "tests/test_trainer.py::test_other_grid_and_family[llama-grid0]":
        "test_trainer.py::test_llama_2x2_train_save_resume",
    "tests/test_trainer.py::test_other_grid_and_family[gpt2-grid1]":
        "test_trainer.py::test_llama_2x2_train_save_resume",
    "tests/test_user_loss.py::test_cross_entropy_on_hf_logits[grid1]":
        "test_user_loss.py::test_cross_entropy_on_hf_logits[grid0]",
    "tests/test_user_loss.py::test_autocast_dtypes_match_one_process[grid1]":
        "test_user_loss.py::test_autocast_dtypes_match_one_process[grid0]",
    "tests/test_user_loss.py::test_elementwise_losses_on_repo_model[grid1]":
        "test_user_loss.py::test_elementwise_losses_on_repo_model[grid0]",
    # MoE: each family at 2x2 stays; at 1x4 mixtral and llama4_text keep the one-row paths
    **{f"tests/test_moe.py::test_experts_split_parity_and_memory[{f}-grid{i}]":
       "test_moe.py::test_experts_split_parity_and_memory[mixtral-grid0]"
       for f, i in (("qwen2_moe", 8), ("qwen3_moe", 9), ("olmoe", 10), ("granitemoe", 11), ("phimoe", 12),
                    ("deepseek_v3", 13))},
    # more of the same path at another size, family or strategy
    "tests/test_compile.py::test_compiled_program_has_no_graph_breaks[gpt2 uneven-grid2]":
        "test_compile.py::test_a_new_shape_compiles_once and test_compiled_collectives_keep_the_program_order",
    "tests/test_strategy.py::test_auto_never_slower_than_any_fixed_scheme":
        "test_strategy.py::test_choose_grid_covers_every_shape_and_picks_the_fastest",
    "tests/test_api_guards.py::test_timeout_bounds_every_collective[check_inputs]":
        "test_api_guards.py::test_a_hang_is_diagnosed_while_it_waits",
    "tests/test_ragged.py::test_repo_model_ragged_batches_options[allgather]":
        "test_ragged.py::test_repo_model_ragged_batches[2x2]",
    "tests/test_hf.py::test_strategies_parity[gpt2-auto-slow-links]": "test_hf.py::test_strategies_parity[gpt2-auto]",
    "tests/test_hf.py::test_strategies_parity[llama-auto]": "test_hf.py::test_strategies_parity[gpt2-auto]",
    "tests/test_rules_gqa_index.py::test_fewer_kv_heads_parity[mistral-True-grid0]":
        "test_rules_gqa_index.py::test_fewer_kv_heads_parity[llama-True-grid0]",
    "tests/test_rules_gqa_index.py::test_fewer_kv_heads_parity[mistral-True-grid1]":
        "test_rules_gqa_index.py::test_fewer_kv_heads_parity[llama-True-grid0]",
    "tests/test_generate.py::test_cache_bytes_per_rank[gpt2-grid3-block3]":
        "test_generate.py::test_cache_bytes_per_rank[llama_gqa-grid0-block0]",
    "tests/test_generate.py::test_cache_bytes_per_rank[llama_gqa-grid2-block2]":
        "test_generate.py::test_cache_bytes_per_rank[llama_gqa-grid0-block0]",
    "tests/test_recompute.py::test_dropout_masks_redrawn_identically[grid2-blocks]":
        "test_recompute.py::test_dropout_masks_redrawn_identically[grid0-blocks]",
    "tests/test_reload.py::test_transformers_checkpoint_roundtrip_2x2[qwen2_moe]":
        "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[mixtral]",
    "tests/test_reload.py::test_transformers_checkpoint_roundtrip_1x4[mixtral]":
        "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[mixtral]",

    # ---- issue 27: the fast tier in its budget. Each entry repeats, on another grid, family or option
    # value, a path a fast-tier test runs; seconds are the baseline run's (this machine, quiet).
    # grids of 2, 6, 8 and 9 ranks: the 4-rank pool covers 2x2, 1x4 and 4x1 (55, 25, 21, 11, 6, 43 s, plus a
    # pool start per world size); since Dec 2026 a 3-wide mesh axis runs on real ranks only in the slow tier,
    # in the fast tier through the single-process oracle (tests/test_rules_oracle.py's q=3 and (2, 3) grids)
    # and odd block sizes through test_uneven.py (vocabulary 97, 3 heads on 2 columns)
    "tests/test_engine_parity.py::test_gpt_parity_3x3[layernorm-gelu-broadcast]":
        "test_comm.py::test_rectangular_groups_products_redistributions[2x1], [1x4] and [4x1] (unequal R and C) "
        "and test_engine_parity.py::test_gpt_parity_rectangular[1x4-allgather] and [4x1-broadcast]",
    "tests/test_comm.py::test_group_mapping_and_products_3x3":
        "test_comm.py::test_rectangular_groups_products_redistributions[2x1], [1x4] and [4x1]",
    # the pool's diagnostics of a hang: a fresh spawn's join names the hung rank with the same stack dump as
    # the shared pool's (7 s)
    "tests/test_pools.py::test_a_hung_fresh_process_says_where_it_was":
        "test_pools.py::test_a_hang_says_where_every_rank_was",
    # a model on 2x3 and 3x2 (16 s each): the six-rank SUMMA products and redistributions against torch, and
    # a model on the non-square 1x4 and 4x1, stay in the fast tier
    "tests/test_engine_parity.py::test_gpt_parity_rectangular[3x2-broadcast]":
        "test_comm.py::test_rectangular_groups_products_redistributions[2x1], [1x4] and [4x1] (unequal R and C) "
        "and test_engine_parity.py::test_gpt_parity_rectangular[1x4-allgather] and [4x1-broadcast]",
    "tests/test_engine_parity.py::test_gpt_parity_rectangular[2x3-broadcast]":
        "test_comm.py::test_rectangular_groups_products_redistributions[2x1], [1x4] and [4x1] (unequal R and C) "
        "and test_engine_parity.py::test_gpt_parity_rectangular[1x4-allgather] and [4x1-broadcast]",
    "tests/test_engine_parity.py::test_gpt_parity_rectangular[1x2-broadcast]":
        "test_engine_parity.py::test_gpt_parity_rectangular[1x4-allgather]",
    "tests/test_engine_parity.py::test_gpt_parity_rectangular[2x1-broadcast]":
        "test_engine_parity.py::test_gpt_parity_rectangular[4x1-broadcast]",
    "tests/test_engine_parity.py::test_gpt_parity_rectangular[2x3-allgather]":
        "test_comm.py::test_rectangular_groups_products_redistributions[2x1], [1x4] and [4x1] (unequal R and C) "
        "and test_engine_parity.py::test_gpt_parity_rectangular[1x4-allgather] and [4x1-broadcast]",
    "tests/test_comm.py::test_rectangular_groups_products_redistributions[1x2]":
        "test_comm.py::test_rectangular_groups_products_redistributions[2x1]",
    "tests/test_training.py::test_data_parallel_2x2x2":
        "test_ragged.py::test_repo_model_ragged_batches[2x1-dp2] and "
        "test_training.py::test_replica_gradients_in_buckets[False]",
    "tests/test_sweep.py::test_sweep_1x1": "test_sweep.py::test_sweep_2x2",
    # compiled training: torch.compile(pmodel) on TinyGPT's one block stays; compile=True keeps the MLP's
    # parity, graph and shape checks (test_a_new_shape_compiles_once); Llama compiled (95 s) repeats them
    "tests/test_compile.py::test_compiled_training_parity[llama-grid2-option-adamw-allgather]":
        "test_compile.py::test_a_new_shape_compiles_once and "
        "test_a_new_shape_compiles_once",
    # generation: one family per cache path (Mistral: fewer KV heads than columns and a window; GPT-2:
    # fused c_attn; GQA at 1x4)
    "tests/test_generate.py::test_greedy_token_identical[llama-2x2]":
        "test_generate.py::test_greedy_token_identical[mistral-2x2]",
    "tests/test_generate.py::test_greedy_token_identical[llama_gqa-2x2]":
        "test_generate.py::test_greedy_token_identical[mistral-2x2]",
    "tests/test_generate.py::test_greedy_token_identical[phi3-2x2]":
        "test_generate.py::test_greedy_token_identical[mistral-2x2]",
    "tests/test_generate.py::test_greedy_token_identical[gpt2-1x4]":
        "test_generate.py::test_greedy_with_other_strategies[1d] and test_greedy_token_identical[mistral-2x2]",
    "tests/test_generate.py::test_greedy_with_other_strategies[auto]":
        "test_generate.py::test_greedy_with_other_strategies[1d] and test_projection_searches_each_phase",
    # recomputation: each mode once per model kind and grid shape
    "tests/test_recompute.py::test_tinygpt_parity[selective-2x2]": "test_recompute.py::test_tinygpt_parity[blocks-2x2]",
    "tests/test_recompute.py::test_tinygpt_parity[blocks-1x4]": "test_recompute.py::test_tinygpt_parity[selective-1x4]",
    "tests/test_recompute.py::test_hf_parity[llama-grid1-selective]":
        "test_recompute.py::test_hf_parity[gpt2-grid2-selective]",
    "tests/test_recompute.py::test_hf_parity[gpt2-grid3-blocks]":
        "test_recompute.py::test_hf_parity[llama-grid0-blocks]",
    "tests/test_recompute.py::test_uneven_splits_parity[selective]":
        "test_recompute.py::test_uneven_splits_parity[blocks]",
    "tests/test_recompute.py::test_dropout_masks_redrawn_identically[grid1-selective]":
        "test_recompute.py::test_dropout_masks_redrawn_identically[grid0-blocks]",
    "tests/test_recompute.py::test_planned_equals_counted[grid1-blocks]":
        "test_recompute.py::test_planned_equals_counted[grid0-blocks]",
    # checkpoints and timeouts: a fresh group whose timeout must expire costs 20-30 s; one per path stays
    "tests/test_checkpoint_safety.py::test_skipped_save_raises_after_timeout":
        "test_api_guards.py::test_a_hang_is_diagnosed_while_it_waits and "
        "test_checkpoint_safety.py::test_grid_inherits_the_process_group_timeout",
    "tests/test_checkpoint_safety.py::test_interrupted_save_distributed_keeps_previous[raise]":
        "test_robustness.py::test_interrupted_save_keeps_previous_checkpoint and "
        "test_checkpoint_safety.py::test_save_distributed_roundtrip",
    # transformers families: one per architecture kind (decoder, encoder, vision, encoder-decoder)
    "tests/test_hf.py::test_family_parity[mistral]": "test_hf.py::test_family_parity[llama]",
    "tests/test_hf.py::test_family_parity[qwen2]": "test_hf.py::test_family_parity[llama]",
    "tests/test_hf.py::test_family_parity[opt]": "test_hf.py::test_family_parity[gpt2]",
    "tests/test_hf.py::test_gpt2_indivisible_sizes_stay_correct[over1-4]":
        "test_hf.py::test_gpt2_indivisible_sizes_stay_correct[over0-4]",
    "tests/test_hf.py::test_gpt2_indivisible_sizes_stay_correct[over2-3]":
        "test_uneven.py::test_transformers_models_with_odd_sizes[gpt2-over0-grid0]",
    "tests/test_hf.py::test_strategies_parity[llama-2d-4x1]":
        "test_engine_parity.py::test_gpt_parity_rectangular[4x1-broadcast]",
    "tests/test_hf.py::test_strategies_parity[gpt2-1d]": "test_hf.py::test_strategies_parity[llama-1d-1x4]",
    "tests/test_capture_regions.py::test_hf_family_parity_2x2[megatron_bert]":
        "test_capture_regions.py::test_hf_family_parity_2x2[deberta_v2]",
    "tests/test_capture_regions.py::test_hf_family_parity_2x2[ctrl]":
        "test_capture_regions.py::test_hf_family_parity_2x2[phimoe]",
    **{f"tests/test_hf_sweep.py::test_sweep_family_parity[{f}]": "test_hf_sweep.py::test_sweep_family_parity[bart] "
       "and [albert], test_hf.py::test_family_parity"
       for f in ("bloom", "gpt_neox", "falcon", "mixtral", "xlm_roberta_xl", "convnext")},
    "tests/test_reload.py::test_transformers_checkpoint_roundtrip_2x2[granitemoe]":
        "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[mixtral]",
    "tests/test_reload.py::test_transformers_checkpoint_roundtrip_2x2[gpt_neox]":
        "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[vit] (a class-specific renaming)",
    "tests/test_reload.py::test_transformers_checkpoint_roundtrip_1x4[gpt_neox]":
        "test_reload.py::test_transformers_checkpoint_roundtrip_1x4[dinov2_swiglu]",
    "tests/test_reload.py::test_transformers_checkpoint_roundtrip_2x2[llama_lm_into_base]":
        "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[llama_base_into_lm]",
    # MoE families: mixtral at 2x2 and 1x4, deepseek_v3 (shared experts), llama4_text stay
    **{f"tests/test_moe.py::test_experts_split_parity_and_memory[{f}-grid{i}]":
       "test_moe.py::test_experts_split_parity_and_memory[mixtral-grid0]"
       for f, i in (("qwen2_moe", 2), ("qwen3_moe", 3), ("olmoe", 4), ("granitemoe", 5), ("phimoe", 6),
                    ("llama4_text", 15))},
    # uneven sizes, strategies, plans: the same path under another option value or model
    "tests/test_uneven.py::test_1d_strategy_with_sizes_the_columns_do_not_divide[rmsnorm-swiglu]":
        "test_uneven.py::test_1d_strategy_with_sizes_the_columns_do_not_divide[layernorm-gelu]",
    "tests/test_uneven.py::test_planned_bytes_are_each_ranks_own[allgather]":
        "test_uneven.py::test_planned_bytes_are_each_ranks_own[broadcast]",
    "tests/test_strategy.py::test_estimated_bytes_equal_the_engines_plan[grid1]":
        "test_strategy.py::test_estimated_bytes_equal_the_engines_plan[grid0]",
    "tests/test_strategy.py::test_estimated_bytes_equal_the_engines_plan[grid2]":
        "test_strategy.py::test_estimated_bytes_equal_the_engines_plan[grid0]",
    "tests/test_strategy.py::test_forward_only_prices_a_forward_and_training_figures_stay[_llama]":
        "test_strategy.py::test_forward_only_prices_a_forward_and_training_figures_stay[_gpt2]",
    "tests/test_strategy_budget.py::test_encoder_decoder_search_is_bounded[t5]":
        "test_strategy_budget.py::test_encoder_decoder_search_is_bounded[bart]",
    "tests/test_plan.py::test_plan_equals_a_real_2x2_run[mixtral]":
        "test_moe.py::test_routed_bytes_are_the_routing_s_exact_figure",
    "tests/test_rules_gqa_index.py::test_falcon_multi_query_parity_and_bytes[grid1]":
        "test_rules_gqa_index.py::test_multi_query_module_parity",
    "tests/test_rules_gqa_index.py::test_fewer_kv_heads_parity[gpt_bigcode-False-grid1]":
        "test_rules_gqa_index.py::test_fewer_kv_heads_parity[llama-True-grid0]",
    "tests/test_numerics.py::test_norm_extreme_magnitudes[1x4]": "test_numerics.py::test_norm_extreme_magnitudes[2x2]",
    "tests/test_checkpoint_safety.py::test_a_rank_retrying_after_a_failure_raises_everywhere":
        "test_checkpoint_safety.py::test_grid_inherits_the_process_group_timeout (the grid's groups take the "
        "process group's 5 s timeout: the mechanism both rely on)",
    "tests/test_ragged.py::test_repo_model_ragged_batches[2x2]":
        "test_ragged.py::test_repo_model_ragged_batches[2x1-dp2]",
    "tests/test_sweep.py::test_sweep_2x2":
        "test_engine_parity.py::test_gpt_parity_rectangular and test_engine_parity.py::test_gpt_parity_2x2",
    "tests/test_hf.py::test_family_parity[t5]":
        "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[llama_tied] and "
        "test_strategy_budget.py::test_encoder_decoder_search_is_bounded[bart] (encoder-decoder parity)",
    "tests/test_training.py::test_hf_checkpoint_roundtrip[gpt2]":
        "test_training.py::test_hf_checkpoint_roundtrip[llama]",
    "tests/test_numerics.py::test_poisoned_unused_embedding_rows[gpt2]":
        "test_numerics.py::test_poisoned_unused_embedding_rows[tinygpt] (tied) and [llama]",
    # sharded replicas: the fast tier keeps a 2D grid under replicas (2x1x2, TinyGPT) and FSDP alone
    # (4x1x1, Llama); 8 ranks and the other families repeat FSDP2 over the same grid blocks
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[2x2x2-tinygpt]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[2x2x2-llama]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt] and [4x1x1-llama]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[2x2x2-gpt2]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-llama]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-gpt2]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[4x1x1-tinygpt]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[4x1x1-gpt2]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[2x2x2-tinygpt-uneven]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt] and "
        "test_uneven.py::test_prime_vocabulary_tied_parity[grid0-broadcast]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[2x2x2-mixtral]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt] and test_moe.py",
    # the other options under sharded replicas: FSDP2 only sees parameter blocks and .grad, which every
    # option leaves as it is; each option's own path is tested without replicas (33, 4, 4, 5 s)
    "tests/test_sharded.py::test_each_block_is_an_fsdp2_unit_and_other_programs_gather_all[fsdp_prefetch=1]":
        "test_sharded.py::test_each_block_is_an_fsdp2_unit_and_other_programs_gather_all[defaults] (the same "
        "units; FSDP2's explicit prefetching only starts gathers earlier)",
    "tests/test_sharded.py::test_each_block_is_an_fsdp2_unit_and_other_programs_gather_all[reshard_after_forward=False]":
        "test_sharded.py::test_each_block_is_an_fsdp2_unit_and_other_programs_gather_all[defaults] and "
        "test_planned_replica_axis_on_the_command_line (its calls, planned)",
    # pipeline stages: the fast tier runs 2 stages x 1x2 with 1f1b and the model's labels, gpipe with a
    # loss_fn, and looped_bfs with 2 stages per rank (4 stages, values relayed past a stage); the other
    # schedules run the same stage code under torch's other orders (4-14 s each), 2x2 on 8 ranks (10-24 s)
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-gpipe-labels-v1]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1] and [1x2-gpipe-loss_fn-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-loss_fn-v1]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1] and [1x2-gpipe-loss_fn-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-interleaved_1f1b-labels-v2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v2]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-interleaved_1f1b-loss_fn-v2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v2]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-loss_fn-v2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v2]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v1]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v2]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-interleaved_zero_bubble-labels-v2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v2]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-zbv_zero_bubble-labels-v2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v2]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-dualpipev-labels-v2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v2]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x2-1f1b-labels-v1]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1] and [1x2-gpipe-loss_fn-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x2-gpipe-labels-v1]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1] and [1x2-gpipe-loss_fn-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x2-looped_bfs-labels-v2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-looped_bfs-labels-v2]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x1x2-1f1b-labels-v1]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1], test_sharded.py",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x1x2-interleaved_1f1b-loss_fn-v2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1], test_sharded.py",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x1x2-1f1b-labels-v1-shard]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1], test_sharded.py",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x1x2-looped_bfs-labels-v2-shard]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1], test_sharded.py",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-gpipe-loss_fn-v1-tinygpt]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x2-1f1b-labels-v1-gpt2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x2-interleaved_1f1b-loss_fn-v2-tinygpt]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-zbv_zero_bubble-labels-v2-gpt2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x2-1f1b-labels-v1-llama-uneven]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1] and test_uneven.py",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[2x2-1f1b-labels-v1-mixtral]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1] and test_moe.py",
    "tests/test_pipeline.py::test_pipeline_stages_compose[compile]":
        "test_pipeline.py::test_pipeline_stages_compose[recompute] and test_compile.py",
    "tests/test_pipeline_plan.py::test_choose_pipeline_picks_the_fastest_layout_that_fits[recompute]":
        "test_pipeline_plan.py::test_choose_pipeline_returns_only_what_parallelize_runs and test_recompute.py",
    "tests/test_pipeline.py::test_pipeline_stages_compose[auto-2x2]":
        "test_pipeline.py::test_pipeline_stages_compose[recompute] and test_strategy.py",
    "tests/test_sharded.py::test_sharded_replicas_compose[compile=True]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt] and test_compile.py",
    "tests/test_sharded.py::test_sharded_replicas_compose[recompute=blocks]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt] and test_recompute.py",
    "tests/test_sharded.py::test_sharded_replicas_compose[strategy=1d]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt] and test_engine_parity.py",
    "tests/test_sharded.py::test_sharded_replicas_compose[strategy=auto]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt] and test_strategy.py",
    # any head's loss in a pipeline: the sequence classifier (labels [B]) and the own model (loss second)
    # stay; the token classifier and the regression read the same loss the same way (5 s each)
    "tests/test_pipeline.py::test_pipeline_loss_of_any_head_matches_one_process[token]":
        "test_pipeline.py::test_pipeline_loss_of_any_head_matches_one_process[sequence]",
    "tests/test_pipeline.py::test_pipeline_loss_of_any_head_matches_one_process[regression]":
        "test_pipeline.py::test_pipeline_loss_of_any_head_matches_one_process[own]",
    "tests/test_pipeline.py::test_pipelined_load_state_dict_takes_a_one_process_state_dict[gpt2]":
        "test_pipeline.py::test_pipelined_load_state_dict_takes_a_one_process_state_dict[llama] and "
        "test_pipeline_checkpoints_reshard (the tied copy under its first name)",
    # a fresh 2-rank spawn that waits out a 5 s timeout (15 s): FSDP2's collectives guarded as the grid's are
    "tests/test_robustness.py::test_stalled_sharded_replica_raises_a_collective_error":
        "test_robustness.py::test_dying_rank_raises_on_the_others",
    # the dry run of a transformers Llama real, fake and built on meta (8 s): the fast tier's GPT cases compare
    # real and fake tensors at every grid already
    "tests/test_dry_run.py::test_fake_tensors_issue_what_real_ones_do":
        "test_dry_run.py::test_every_position_builds_and_its_bytes_are_the_plan",
    # the dry run of a 4x4x4 cube, real and fake (12 s): 3D's library ops and bytes, as the 8x8 case runs 2D's
    "tests/test_dry_run.py::test_every_position_builds_and_its_bytes_are_the_plan[3d-4x4x4]":
        "test_dry_run.py::test_every_position_builds_and_its_bytes_are_the_plan[2d-8x8] and test_cube.py",
    # choose_pipeline from the command line (7 s): the search itself is the fast tier's
    "tests/test_cli.py::test_inspect_chooses_a_pipeline":
        "test_pipeline_plan.py::test_choose_pipeline_returns_only_what_parallelize_runs",
    # the 64-rank pipeline dry run (17 s): the 8-rank one runs the same relay, stages and replicas
    "tests/test_dry_run.py::test_pipeline_stages_over_sharded_replicas[pp4-shard4-2x2]":
        "test_dry_run.py::test_pipeline_stages_over_sharded_replicas[pp2-shard2-1x2]",
    # verify's sweep of clean programs (2 s each; compiled 58 s): the fast tier keeps the 2D grid and the
    # pipeline (the two ways nodes are matched with the model's), the injected wrong rule and wrong backward
    **{f"tests/test_verify.py::test_a_correct_program_matches_at_every_node[{case}]":
       "test_verify.py::test_a_correct_program_matches_at_every_node[grid=(2, 2)] and "
       "test_verify.py::test_a_wrong_rule_is_named_with_its_source_line"
       for case in ("grid=(2, 2)-strategy=1d", "grid=(2, 2)-lowering=allgather", "grid=(2, 2)-lowering=ring",
                    "grid=(2, 2)-recompute=blocks", "grid=(2, 1, 2)-data_parallel=shard", "grid=(2, 1, 2)",
                    "grid=(2, 2)-compile=True", "grid=(2, 2)-bf16=True",
                    "family=gpt2-grid=(2, 1, 2)-data_parallel=shard", "family=gpt2-grid=(1, 4)-strategy=1d")},
    # the command line (14 s: its own 2 processes and a Llama): the same verify as the fast tier's
    "tests/test_verify.py::test_command_line_exit_status":
        "test_verify.py::test_a_correct_program_matches_at_every_node[grid=(2, 2)]",
    # Dec 2026, the fast tier back toward its 12 minutes (seconds from a full fast-tier run on this machine):
    # the one compiled TinyGPT case (52 s): compile=True at 2x2 with one process's loss and gradients, one
    # graph and the eager step's collectives in order is test_a_new_shape_compiles_once (an MLP, 2 shapes)
    "tests/test_compile.py::test_compiled_training_parity[tinygpt-grid0-torch.compile-adamw-broadcast]":
        "test_compile.py::test_a_new_shape_compiles_once (compile=True at 2x2) and "
        "test_compile.py::test_compiled_collectives_keep_the_program_order",
    # data_parallel='auto' priced both ways under limits (34 s, 13 plans with strategy='auto'): the fast tier
    # keeps 'auto' choosing to shard under a limit replicating exceeds, at parity with one process
    "tests/test_sharded.py::test_auto_shards_only_where_it_is_faster_within_the_limit":
        "test_sharded.py::test_sharded_replicas_compose[data_parallel=auto]",
    # the shared block on 2 ranks (15 s, a 2-rank pool of its own): the same units on the 4-rank pool
    "tests/test_sharded.py::test_a_block_shared_under_two_names_shards[2x1x1]":
        "test_sharded.py::test_a_block_shared_under_two_names_shards[2x1x2]",
    # 8 ranks on 2 cores (14 + 12 s): the cube's search at parity and its products stay; DCP across placements
    "tests/test_cube.py::test_a_searched_mix_on_the_cube_matches_one_process":
        "test_cube.py::test_the_search_arranges_the_ranks_and_matches_one_process",
    "tests/test_cube.py::test_cube_checkpoints_round_trip":
        "test_training.py::test_dcp_save_resume_and_reshard and "
        "test_sharded.py::test_sharded_checkpoints_reshard_both_ways",
    # clip bounded by the timeout (14 s, a fresh 4-rank spawn): the grid's groups take the process group's
    # timeout and the hang diagnosis is written while the ranks wait
    "tests/test_api_guards.py::test_timeout_bounds_every_collective[clip]":
        "test_checkpoint_safety.py::test_grid_inherits_the_process_group_timeout and "
        "test_api_guards.py::test_a_hang_is_diagnosed_while_it_waits",
    # pipelines (9 + 8 + 7 s each): 1F1B with labels, the looped schedule and recompute in stages stay
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-gpipe-loss_fn-v1]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1] and test_user_loss.py (loss_fn)",
    "tests/test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1-gpt2]":
        "test_pipeline.py::test_pipeline_stages_match_one_process[1x2-1f1b-labels-v1]",
    "tests/test_pipeline.py::test_pipeline_stages_compose[auto]":
        "test_pipeline.py::test_pipeline_stages_compose[recompute] and test_hf.py::test_strategies_parity[gpt2-auto]",
    # the plan against a real step for two more models (6 + 3 s): MLP, attention and GPT-2 stay
    **{f"tests/test_plan.py::test_plan_equals_a_real_2x2_run[{m}]":
       "test_plan.py::test_plan_equals_a_real_2x2_run[gpt2] and [attention]" for m in ("bench llama", "peft llama")},
    # more families and grids of the same rules (2-8 s each): one case of each stays
    **{f"tests/test_moe.py::test_experts_split_parity_and_memory[{c}]":
       "test_moe.py::test_experts_split_parity_and_memory[mixtral-grid0]"
       for c in ("mixtral-grid1", "deepseek_v3-grid7", "llama4_text-grid14")},
    **{f"tests/test_generate.py::test_greedy_token_identical[{c}]":
       "test_generate.py::test_greedy_token_identical[mistral-2x2] and test_greedy_with_other_strategies[1d]"
       for c in ("llama_gqa-1x4", "gpt2-2x2")},
    **{f"tests/test_rules_gqa_index.py::test_fewer_kv_heads_parity[{c}]":
       "test_rules_gqa_index.py::test_fewer_kv_heads_parity[llama-True-grid0]"
       for c in ("llama-True-grid1", "gpt_bigcode-False-grid0")},
    "tests/test_rules_gqa_index.py::test_falcon_multi_query_parity_and_bytes[grid0]":
        "test_rules_gqa_index.py::test_multi_query_module_parity and test_fewer_kv_heads_parity[llama-True-grid0]",
    "tests/test_reload.py::test_transformers_checkpoint_roundtrip_2x2[t5]":
        "test_reload.py::test_transformers_checkpoint_roundtrip_2x2[llama_tied] and [gpt2], "
        "test_hf_sweep.py::test_sweep_family_parity[bart] (encoder-decoder)",
    "tests/test_sweep.py::test_sweep_rectangular_grids_and_strategies":
        "test_engine_parity.py::test_gpt_parity_rectangular and test_gpt_parity_strategies",
    "tests/test_strategy_budget.py::test_auto_planned_bart_matches_one_process":
        "test_hf.py::test_strategies_parity[gpt2-auto] and "
        "test_strategy_budget.py::test_encoder_decoder_search_is_bounded[bart]",
    "tests/test_generate.py::test_cache_bytes_per_rank[llama-grid1-block1]":
        "test_generate.py::test_cache_bytes_per_rank[llama_gqa-grid0-block0]",
    "tests/test_sharded.py::test_sharded_replicas_match_one_process[4x1x1-llama]":
        "test_sharded.py::test_sharded_replicas_match_one_process[2x1x2-tinygpt]",
    # a 6-rank pool of their own (13 + 1 s): rectangular grids stay at 2x1, 1x4 and 4x1, unequal blocks in
    # test_uneven.py
    **{f"tests/test_comm.py::test_rectangular_groups_products_redistributions[{g}]":
       "test_comm.py::test_rectangular_groups_products_redistributions[2x1], [1x4] and [4x1]" for g in ("2x3", "3x2")},
    # max_batch's orderings over every scheme (16 s): the command line runs the same search
    "tests/test_capacity.py::test_orderings_that_must_hold":
        "test_capacity.py::test_cli_max_batch_json_and_refusals and "
        "test_strategy.py::test_memory_limit_is_respected_and_an_impossible_one_is_refused",
    "tests/test_ragged.py::test_hf_ragged_batches[gpt2-grid1]":
        "test_ragged.py::test_repo_model_ragged_batches[2x1-dp2]",
    # the pipeline layout search at 16 devices (12 s, single process): the search's plans are built and run
    # by test_choose_pipeline_returns_only_what_parallelize_runs
    "tests/test_pipeline_plan.py::test_choose_pipeline_picks_the_fastest_layout_that_fits[plain]":
        "test_pipeline_plan.py::test_choose_pipeline_returns_only_what_parallelize_runs",
    # the ring on 2x3 with uneven blocks (8 s with its own 6-rank pool): the ring's bytes stay at 2x2 and
    # 1x4 with uneven blocks
    "tests/test_comm.py::test_ring_lowering_moves_the_broadcast_bytes[2x3-uneven]":
        "test_comm.py::test_ring_lowering_moves_the_broadcast_bytes[2x2] and [1x4-uneven]",
    # strategy='auto' per generation phase (8 s): the per-phase search and the generated tokens stay
    "tests/test_generate.py::test_a_strategy_per_phase[auto-None-None]":
        "test_generate.py::test_projection_searches_each_phase and test_greedy_token_identical[mistral-2x2]",
}
