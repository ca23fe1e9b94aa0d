"""The attention room: which attention path a model runs, its per-layer features, masks, and the start-up probe.

- `features`: what each layer's attention applies (window, chunk, softcap, sinks) and what a call passed;
- `kernel`: one attention computation that honours every feature (sdpa when it can, eager math when not);
- `masks`: which keys a position of a packed row may see, per layer kind;
- `segments`, `sequence_parallel`: the two attention implementations of our own;
- `inputs`: the model's keyword inputs for a packed row, per path;
- `logps`: per-pair log-probs from a packed micro-batch;
- `choice`: the path a run takes, and the refusals of paths that cannot express a model (`model.load` loads it);
- `probe`: packed vs unpacked log-probs on a synthetic row before step 1;
- `head`: the vocabulary head in chunks of scored positions (long pairs in bounded memory);
- `tiled_mlp`: each decoder layer's MLP over tiles of the sequence (long pairs in bounded memory, too);
- `compiled`: a function torch.compile builds where it pays, checked against its eager self on first use.
"""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "inputs": ("row_inputs",),
        "logps": ("pair_logps",),
        "sequence_parallel": ("check_same_row",),
        "tiled_mlp": ("tile_of",),
    },
)
