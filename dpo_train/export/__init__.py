"""The export room: `final/` (the policy, adapter or merged model), its model card, and the push to the Hub."""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "final": ("export",),
        "model_card": ("run_facts",),
    },
)
