"""The logps room: what a forward of a packed row returns and costs, apart from how the row is attended.

- `scoring`: `Scoring`, what every forward of a run is passed (unpacked rows, logits budget, compiled head, tiles);
- `pairs`: per-pair log-probs from a packed micro-batch (`pair_logps`, `PairLogps`);
- `head`: the vocabulary head in chunks of scored positions (long pairs in bounded memory);
- `head_check`: the start-up check that the chunked head equals the model's own, and the note where it does not;
- `tiled_mlp`: each decoder layer's MLP over tiles of the sequence (long pairs in bounded memory, too);
- `compiled`: a function torch.compile builds where it pays, checked against its eager self on first use;
- `recompute`: the forward's autocast, for a backward that recomputes part of it;
- `probe`: packed vs unpacked log-probs on a synthetic row before step 1.
"""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "pairs": ("PairLogps", "pair_logps"),
        "scoring": ("Scoring",),
    },
)
