"""The public surface is pinned: adding or removing a public name is a deliberate change."""

import fddp
import fddp.optim

PUBLIC = {
    "CaptureError",
    "PowerSGDState",
    "RankFailureError",
    "ReplicaMismatchError",
    "ScheduleMismatchError",
    "SyncBatchNorm",
    "accumulate_gradients",
    "all_gather",
    "axis_index",
    "axis_size",
    "broadcast",
    "cast_floating",
    "convert_sync_batchnorm",
    "data_parallel",
    "functional",
    "grad",
    "init",
    "load",
    "lockstep",
    "mixed_precision",
    "optim",
    "pad_rows",
    "plot_timeline",
    "pmean",
    "powersgd",
    "powersgd_init",
    "psum",
    "rank",
    "replicate",
    "save",
    "shard",
    "shard_batches",
    "state",
    "sync_batch_norm",
    "sync_buffers",
    "value_and_grad",
    "vmap",
    "weighted_pmean",
    "world_size",
}

OPTIM = {
    "ApplyIfFiniteState",
    "EmptyState",
    "GradientTransformation",
    "InitFn",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TraceState",
    "UpdateFn",
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
    "linear_schedule",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "trace",
    "warmup_cosine_decay_schedule",
}


def test_fddp_all_is_exactly_the_public_surface():
    assert set(fddp.__all__) == PUBLIC
    public_attributes = {n for n in vars(fddp) if not n.startswith("_")} - {"typing"}
    assert public_attributes == PUBLIC


def test_every_public_name_resolves_and_is_documented():
    for name in fddp.__all__:
        obj = getattr(fddp, name)
        assert obj.__doc__, f"fddp.{name} has no docstring"


def test_optim_surface():
    assert set(fddp.optim.__all__) == OPTIM
    for name in fddp.optim.__all__:
        assert getattr(fddp.optim, name).__doc__, f"fddp.optim.{name} has no docstring"
