"""The public surface is pinned: adding or removing a public name is a deliberate change."""

import pytest
import torch
from _compare import assert_trees_equal

import fddp
import fddp.optim
import fddp.typing

PUBLIC = {
    "Invariant",
    "Loss",
    "LowCommState",
    "CaptureError",
    "PrintWhileTracingWarning",
    "RankFailureError",
    "RecoverableStep",
    "Recovery",
    "ReplicaMismatchError",
    "RetraceWarning",
    "SaveArrivalError",
    "ScheduleMismatchError",
    "ShardedParams",
    "accumulate_gradients",
    "all_gather",
    "axis_index",
    "axis_size",
    "block_until_ready",
    "cache_dir",
    "broadcast",
    "data",
    "data_parallel",
    "diloco",
    "full_params",
    "full_state_dict",
    "functional",
    "grad",
    "init",
    "load",
    "load_sharded",
    "local_sgd",
    "nn",
    "optim",
    "plot_timeline",
    "pmean",
    "powersgd",
    "psum",
    "psum_scatter",
    "rank",
    "recoverable",
    "remat",
    "remat_name",
    "remat_policies",
    "replicate",
    "save",
    "save_sharded",
    "set_cache_dir",
    "shard",
    "shard_params",
    "state",
    "value_and_grad",
    "vmap",
    "world_size",
}

OPTIM = {
    "ApplyIfFiniteState",
    "EmptyState",
    "GradientTransformation",
    "InjectHyperparamsState",
    "MaskedState",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "ShardedState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "linear_schedule",
    "masked",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "shard_state",
    "state_bytes",
    "trace",
    "warmup_cosine_decay_schedule",
}

TYPING = {
    "Batch",
    "CollectivePlan",
    "DataParallelStep",
    "GradientTransformation",
    "Grads",
    "LowCommStep",
    "OptState",
    "Params",
    "ParamsT",
    "Phase",
    "Plan",
    "PowerSGD",
    "PowerSGDState",
    "RegionPlan",
    "RematPlan",
    "SavedValue",
    "ScalarOrSchedule",
    "TensorTree",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
}


def test_fddp_all_is_exactly_the_public_surface():
    assert set(fddp.__all__) == PUBLIC
    # submodules an import of their own adds: fddp.typing, and the fddp.run command
    public_attributes = {n for n in vars(fddp) if not n.startswith("_")} - {"typing", "run"}
    assert public_attributes == PUBLIC


def test_every_public_name_resolves_and_is_documented():
    for name in fddp.__all__:
        obj = getattr(fddp, name)
        assert obj.__doc__, f"fddp.{name} has no docstring"


NN = {
    "SyncBatchNorm",
    "cast_floating",
    "convert_sync_batchnorm",
    "mixed_precision",
    "sync_batch_norm",
    "sync_buffers",
}

DATA = {"lockstep", "pad_rows", "shard_batches", "weighted_pmean"}

REMAT_POLICIES = {
    "Policy",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "memory_budget",
    "nothing_saveable",
    "save_any_names_but_these",
    "save_only_these_names",
}


def test_namespaces_for_model_helpers_and_uneven_data():
    for module, names in (
        (fddp.nn, NN),
        (fddp.data, DATA),
        (fddp.remat_policies, REMAT_POLICIES),
    ):
        assert set(module.__all__) == names
        assert {n for n in vars(module) if not n.startswith("_")} == names
        for name in names:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name} has no docstring"


def test_optim_surface():
    assert set(fddp.optim.__all__) == OPTIM
    for name in fddp.optim.__all__:
        assert getattr(fddp.optim, name).__doc__, f"fddp.optim.{name} has no docstring"


def test_typing_surface_and_the_optimizer_protocol_is_one_class():
    assert set(fddp.typing.__all__) == TYPING
    assert all(hasattr(fddp.typing, name) for name in TYPING)
    assert fddp.optim.GradientTransformation is fddp.typing.GradientTransformation
    assert not {"InitFn", "UpdateFn"} & set(vars(fddp.optim))  # one copy: fddp.typing's


def test_optim_init_and_update_fn_are_deprecated_names_of_the_typing_protocol():
    with pytest.warns(FutureWarning, match=r"fddp\.typing\.TransformInitFn"):
        assert fddp.optim.InitFn is fddp.typing.TransformInitFn
    with pytest.warns(FutureWarning, match=r"fddp\.typing\.TransformUpdateFn"):
        assert fddp.optim.UpdateFn is fddp.typing.TransformUpdateFn
    with pytest.raises(AttributeError, match="Misspelt"):
        fddp.optim.Misspelt  # noqa: B018


def test_renamed_arguments_keep_working_for_a_release_and_name_the_new_one():
    with pytest.warns(FutureWarning, match=r"approximation_rank"):
        old = fddp.powersgd(rank=2)
    new = fddp.powersgd(approximation_rank=2)
    grads = {"w": torch.outer(torch.arange(8.0), torch.ones(4))}
    assert_trees_equal(old.init(grads), new.init(grads))


def test_data_parallel_returns_the_exported_step_type_and_plan():
    step = fddp.data_parallel(
        lambda w, x: w - 0.1 * fddp.pmean(fddp.grad(lambda w: (x @ w).sum())(w))
    )
    assert isinstance(step, fddp.typing.DataParallelStep)
    plan = step.schedule(torch.ones(2), torch.ones(3, 2))
    assert isinstance(plan, fddp.typing.Plan)
    assert all(isinstance(c, fddp.typing.CollectivePlan) for c in plan.collectives)
    decorated = fddp.data_parallel(bucket_cap_mb=1.0)(lambda w: w)
    assert isinstance(decorated, fddp.typing.DataParallelStep)
