"""`ResumableTrainer` with ``push_to_hub``: what reaches the Hub is what the plain Trainer
would push, never the checkpoint root.

The Hub is a local stand-in: ``HfApi.create_repo`` and ``HfApi.upload_folder`` (the calls
the Trainer makes) are replaced by functions that list the folder as ``upload_folder``
does (its ``filter_repo_objects`` with the caller's ignore patterns plus
``DEFAULT_IGNORE_PATTERNS``) and copy each file into ``<hub>/<path_in_repo>``. Nothing is
sent anywhere (``HF_HUB_OFFLINE`` stays 1).
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

from resumable.errors import CheckpointError
from resumable.integrations.transformers import HUB_STAGING

from .hf_job import digest, make_trainer


@dataclass
class Commit:
    message: str
    files: list[str]  # paths in the repository


@dataclass
class LocalHub:
    """The uploads, in order, and the repository's files under ``root``."""

    root: Path
    commits: list[Commit] = field(default_factory=list)

    def create_repo(self, api: HfApi, repo_id: str, **kwargs: Any) -> Any:
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(
        self,
        api: HfApi,
        *,
        repo_id: str,
        folder_path: str,
        path_in_repo: str | None = None,
        commit_message: str | None = None,
        ignore_patterns: list[str] | str | None = None,
        allow_patterns: list[str] | str | None = None,
        run_as_future: bool = False,
        **kwargs: Any,
    ) -> Any:
        ignore = [ignore_patterns] if isinstance(ignore_patterns, str) else ignore_patterns
        folder = Path(folder_path)
        local = sorted(p.relative_to(folder).as_posix() for p in folder.glob("**/*") if p.is_file())
        chosen = filter_repo_objects(
            local,
            allow_patterns=allow_patterns,
            ignore_patterns=[*(ignore or []), *DEFAULT_IGNORE_PATTERNS],
        )
        prefix = f"{path_in_repo.strip('/')}/" if path_in_repo else ""
        files = []
        for rel in chosen:
            target = self.root / f"{prefix}{rel}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / rel, target)
            files.append(f"{prefix}{rel}")
        self.commits.append(Commit(commit_message or "", files))
        if not run_as_future:
            return SimpleNamespace(commit_url="local")
        done: Future[Any] = Future()
        done.set_result(None)
        return done

    def pushed(self) -> list[str]:
        return [f for c in self.commits for f in c.files]


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalHub:
    stand_in = LocalHub(tmp_path / "hub")

    def create_repo(api: HfApi, repo_id: str, **kwargs: Any) -> Any:
        return stand_in.create_repo(api, repo_id, **kwargs)

    def upload_folder(api: HfApi, **kwargs: Any) -> Any:
        return stand_in.upload_folder(api, **kwargs)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return stand_in


def hub_args(strategy: str) -> dict[str, Any]:
    return {"push_to_hub": True, "hub_model_id": "me/tiny", "hub_strategy": strategy}


def assert_no_checkpoint_files(pushed: list[str]) -> None:
    leaked = [
        f
        for f in pushed
        if f.startswith(("resumable/", f"{HUB_STAGING}/"))
        or f.rsplit("/", 1)[-1] in ("audit.jsonl", ".resumable-lock", "manifest.json")
        or "/step-" in f
    ]
    assert not leaked, leaked


def test_every_save_pushes_the_model_during_training_and_never_the_checkpoints(
    tmp_path: Path, hub: LocalHub
) -> None:
    out = tmp_path / "out"
    trainer = make_trainer(out, steps=6, persist="sync", **hub_args("every_save"))
    trainer.train()
    assert sorted(p.name for p in (out / "resumable").glob("step-*")) == [
        "step-000000000003",
        "step-000000000006",
    ]
    during = [c for c in hub.commits if c.message.startswith("Training in progress")]
    assert [c.message for c in during] == [
        "Training in progress, step 3",
        "Training in progress, step 6",
    ]
    for commit in during:  # the plain Trainer's every_save: model files and arguments
        assert {"model.safetensors", "config.json", "training_args.bin"} <= set(commit.files)
        assert not any(f.startswith("last-checkpoint/") for f in commit.files)
    assert not (out / HUB_STAGING).exists()  # emptied once the pushes were done

    trainer.push_to_hub()  # as run_clm.py does at the end
    assert hub.commits[-1].message == "End of training"
    assert "model.safetensors" in hub.commits[-1].files
    assert_no_checkpoint_files(hub.pushed())


def test_all_checkpoints_pushes_plain_checkpoints_a_plain_trainer_resumes_from(
    tmp_path: Path, hub: LocalHub
) -> None:
    trainer = make_trainer(tmp_path / "out", steps=6, persist="sync", **hub_args("all_checkpoints"))
    trainer.train()
    assert_no_checkpoint_files(hub.pushed())
    pushed = hub.root / "checkpoint-3"
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert (pushed / name).is_file(), name
    assert '"global_step": 3' in (pushed / "trainer_state.json").read_text()
    plain = make_trainer(tmp_path / "plain", steps=6, plain=True)
    plain.train(resume_from_checkpoint=str(pushed))
    assert digest(plain) == digest(trainer)


def test_a_user_checkpoint_dir_inside_output_dir_is_left_out_too(
    tmp_path: Path, hub: LocalHub
) -> None:
    out = tmp_path / "out"
    trainer = make_trainer(
        out, steps=3, persist="sync", checkpoint_dir=out / "ckpts", **hub_args("every_save")
    )
    trainer.train()
    trainer.push_to_hub()
    assert (out / "ckpts" / "audit.jsonl").is_file()
    assert hub.commits and not [f for f in hub.pushed() if f.startswith("ckpts/")]


def test_checkpoint_dir_equal_to_output_dir_is_refused_with_push_to_hub(
    tmp_path: Path, hub: LocalHub
) -> None:
    with pytest.raises(CheckpointError, match="push_to_hub uploads"):
        make_trainer(tmp_path, steps=3, checkpoint_dir=tmp_path, **hub_args("every_save"))
