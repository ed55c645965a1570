"""The checkpoint sizes the fit-start disk check and ``lazytrain plan`` use, against the file a save writes: a
tiny model's weights-only checkpoint (fp32 masters) and full-state one (masters + AdamW's two moments)."""

import json
import os

import lightning.pytorch as pl
import pytest
import yaml
from helpers import _COMMON, LMModule, batches, loader, tiny_model

from lightning_lazytrain.sft.checkpointing import ResumableModelCheckpoint
from lightning_lazytrain.sft.cli import main


class SizeAtFitStart(ResumableModelCheckpoint):
    """Records the size the disk check multiplies, at fit start (before the optimizer has made its states)."""

    def check_disk(self, trainer, pl_module):
        self.estimate = self.checkpoint_size(trainer, pl_module)
        super().check_disk(trainer, pl_module)


def _plan_one_checkpoint(tmp_path, capsys, weights_only):
    config = tmp_path / "plan.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"model_config": {"model_type": "qwen2", **_COMMON}},
        "trainer": {"precision": "32-true", "callbacks": [{
            "class_path": "lightning_lazytrain.sft.checkpointing.ResumableModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 2, "save_last": "link",
                          "save_weights_only": weights_only}}]},
    }))
    args = ["--config", "demo", "--config", str(config), "--gpu", "h200", "--max_batch", "false", "--json", "true"]
    assert main(["plan", *args]) == 0
    answer = json.loads(capsys.readouterr().out)
    ((piece, need),) = answer["asked"]["tiers"]["checkpoint"]["pieces"].items()
    kind = "weights-only" if weights_only else "full-state"
    assert piece == f"2 {kind} checkpoints (1 kept, 1 being saved)"  # save_top_k 1, last.ckpt a link
    return answer["model"]["params"], need / 2


@pytest.mark.parametrize("weights_only", [True, False])
def test_fit_check_and_plan_size_a_checkpoint_within_10_percent_of_the_saved_file(
        tmp_path, capsys, monkeypatch, weights_only):
    monkeypatch.setattr("sys.argv", ["lazytrain"])  # LightningCLI warns when pytest's argv is there too
    saver = SizeAtFitStart(dirpath=tmp_path / "real", every_n_train_steps=2, save_last="link",
                           save_weights_only=weights_only)
    module = LMModule(tiny_model("qwen2", seed=1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="32-true", max_steps=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[saver],
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, loader(batches(2)))
    real = os.path.getsize(saver.best_model_path)
    num_params = sum(p.numel() for p in module.parameters())
    assert real > num_params * (4 if weights_only else 12), "the file holds at least the tensors' bytes"
    assert abs(saver.estimate - real) <= 0.1 * real, (saver.estimate, real)
    params, planned = _plan_one_checkpoint(tmp_path, capsys, weights_only)
    assert params == num_params
    assert abs(planned - real) <= 0.1 * real, (planned, real)
