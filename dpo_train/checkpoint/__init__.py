"""The checkpoint room: save and resume a run: model and optimizer through DCP, JSON and safetensors state,
a commit record last (`parts`: what is saved; `save`; `restore`: resume and `train.weights_from`; `identity`).

A checkpoint is OUTPUT/checkpoints/step-NNNNNN/ holding `dcp/` (torch.distributed.checkpoint: the model and
optimizer tensors, and the reference's when TR-DPO moves it), `state.json`
(global), `rank-RRRRR.json` (the loader state) and `rank-RRRRR.rng.safetensors` (RNG states) per rank,
and `commit.json`, written last by rename. Only a committed checkpoint whose files match the record
is ever read. DCP holds tensors only; every non-tensor value of the model and optimizer state is JSON
(`state_tree.json`), and DCP's pickled `.metadata` is read through a restricted unpickler
(`dpo_state.dcp_io`), so no general unpickler ever runs on a checkpoint file (docs/security.md).

The checkpointer never sees the trainer: it receives `Checkpointable`, a typed set of `Stateful`
objects (as torchtitan's CheckpointManager does), the run (`RunView`: where the rank sits, its output
directory and config) and the identity a checkpoint of the run records (`identity`). `Checkpoints`
(`manager`) owns them for a run.
"""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "identity": ("run_identity",),
        "manager": ("Checkpoints",),
        "parts": ("Checkpointable", "ModelAndOptimizer", "ReferenceWeights", "RNGState", "TrainState"),
    },
)
