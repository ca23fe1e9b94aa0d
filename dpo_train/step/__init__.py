"""The step room: one step's arithmetic: the loss family, the step objective, metrics, the non-finite vote,
the gradient norm's check, AOT's sorts, early stopping, and the optimizer and schedule that apply it."""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "early_stopping": ("EarlyStopping", "early_stopping_watch"),
        "grad_norm": ("CLIP", "gradient_norm", "norm_mismatch"),
        "loss": ("LossConfig", "pair_losses"),
        "metrics": ("add_pairs", "new_sums", "step_record"),
        "nonfinite": ("agree", "local_nonfinite", "step_sources"),
        "objective": ("microbatch_loss", "router_aux_coef"),
        "optim": ("SCHEDULES", "build_optimizer", "build_schedule"),
        "sort": ("SortScores", "set_partners", "sorted_types", "step_partners", "unmoved_rng"),
    },
)
