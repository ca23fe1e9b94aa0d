"""The attention room: how a packed row is attended: the path a model runs, its per-layer features and masks.

- `features`: what each layer's attention applies (window, chunk, softcap, sinks) and what a call passed;
- `kernel`: one attention computation that honours every feature (sdpa when it can, eager math when not);
- `masks`: which keys a position of a packed row may see, per layer kind;
- `segments`, `sequence_parallel`: the two attention implementations of our own;
- `flex`, `varlen`: FlexAttention and variable-length FlashAttention over the row's segments;
- `inputs`: the model's keyword inputs for a packed row, per path;
- `unpacked`: a packed row run as a padded batch, one sequence a row, for a model packing cannot serve;
- `rope`: a length-dependent rope made per sequence; `temperature`: Llama 4's query temperature per segment;
- `choice`: the path a run takes, and the refusals of paths that cannot express a model (`model.load` loads it).

What a forward returns and costs (per-pair log-probs, the chunked head, tiled MLPs, the start-up probe) is the
logps room's (`dpo_train.logps`).
"""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "inputs": ("row_inputs",),
        "sequence_parallel": ("check_same_row",),
    },
)
