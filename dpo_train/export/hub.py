"""`dpo-state push`: a verified export (final/, final-merged/) uploaded to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

from dpo_state.export_record import EXPORT_FILE, export_problems, read_export_record
from dpo_train.errors import HubError


def push_export(directory: str | Path, repo_id: str, token: str | None = None, private: bool = False) -> str:
    """Upload the export `directory` to model repository `repo_id` (created when missing) and return the
    commit's URL. Refused, before anything is sent, when the directory does not verify against its
    export.json or no token is found (`token`, else HF_TOKEN or the one `hf auth login` saved)."""
    from huggingface_hub import get_token

    directory = Path(directory)
    if not (directory / EXPORT_FILE).is_file():
        raise HubError(
            f"{directory} has no {EXPORT_FILE}: it is not an export of dpo-train (or one from before exports were "
            "hashed); push OUTPUT/final or OUTPUT/final-merged of a run, re-exported by this version"
        )
    problems = export_problems(directory)
    if problems:
        raise HubError(
            f"{directory} does not verify against its {EXPORT_FILE}, so it is not what the run exported:\n  - "
            + "\n  - ".join(problems)
            + "\nFix: export again (rerun the run: it resumes and re-exports), or push an intact copy"
        )
    token = token or get_token()
    if not token:
        raise HubError(
            f"no Hugging Face token to push {directory} to {repo_id}: pass --token, set HF_TOKEN, or run "
            "`hf auth login` (a token with write access)"
        )
    step = read_export_record(directory)["step"]
    return send(repo_id, directory, token, private, f"dpo-toolkit export at step {step}")


def send(repo_id: str, folder: Path, token: str, private: bool, message: str) -> str:
    """The one call that reaches the network: the repository created if missing, then the folder uploaded
    in one commit. Its failures (no network, a bad token, a name the Hub refuses) are a named HubError."""
    from huggingface_hub import create_repo, upload_folder
    from huggingface_hub.errors import HFValidationError, HTTPError  # HTTPError: its HTTP client's base error

    try:
        create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
        info = upload_folder(repo_id=repo_id, folder_path=folder, token=token, commit_message=message)
    except (HTTPError, HFValidationError, OSError) as e:  # HfHubHTTPError is both of the first
        raise HubError(
            f"pushing {folder} to the Hub as {repo_id} failed: {type(e).__name__}: {e}. Fix: check the network "
            "(HF_ENDPOINT), that the token may write to that namespace, and that the repo id is namespace/name"
        ) from None
    return str(info)
