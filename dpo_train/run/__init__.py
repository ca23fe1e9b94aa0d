"""The run room: one setup for training, precompute and evaluation, the preflight checks, the run directory,
the initial policy, and the run's logs and sinks."""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "alone": ("alone_applies", "check_alone", "precompute_check"),
        "initial_policy": ("load_initial_policy",),
        "log": ("RunLog",),
        "progress": ("Progress", "stage"),
        "setup": ("Run", "precompute_run", "training_run"),
    },
)
