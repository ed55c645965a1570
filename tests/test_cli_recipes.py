import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_in_process import lazytrain_in_process

from lightning_lazytrain.sft.cli import DEMO_RECIPE, _with_default_config, main
from lightning_lazytrain.sft.recipes import recipe_names, recipe_path, recipes_dir, resolve_config_args

ROOT = Path(__file__).resolve().parents[1]

RECIPES = sorted(recipes_dir().glob("*.yaml"))
GPU_RECIPES = ["qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen3-8b", "qwen3.6-27b"]
STRATEGY = "lazytrain"


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    # LightningCLI warns when both `args` and pytest's own sys.argv are present
    monkeypatch.setattr("sys.argv", ["lazytrain"])


def test_all_recipes_present():
    assert {p.stem for p in RECIPES} >= {"demo", *GPU_RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses(recipe, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    strategy = cfg["trainer"]["strategy"]
    if recipe.stem == "demo":
        assert strategy == "lazytrain"
    else:
        assert strategy["class_path"] == "lightning_lazytrain.LazyTrainStrategy"
        assert strategy["init_args"]["schedule"] == "milp"
    assert cfg["seed_everything"] == 42
    if recipe.stem != "demo":
        # the paper's hyper-parameters (a LoRA recipe: LoRA's usual 1e-4)
        assert cfg["model"]["lr"] == (1e-4 if cfg["model"].get("lora") else 1e-5)
        assert cfg["model"]["weight_decay"] == 0.01
        assert cfg["model"]["betas"] == [0.9, 0.999] and cfg["model"]["eps"] == 1e-8
        assert cfg["trainer"]["gradient_clip_val"] == 1.0 and cfg["trainer"]["precision"].startswith("bf16")
        assert cfg["data"]["max_seq_length"] == 1024 and cfg["data"]["val_fraction"] == 0.3
        assert cfg["model"]["pretrained"].startswith("Qwen/")


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipes_save_resumable_checkpoints(name):
    config = yaml.safe_load(recipe_path(name).read_text())
    (saver,) = [c["init_args"] for c in config["trainer"]["callbacks"]
                if c["class_path"] == "lightning_lazytrain.sft.checkpointing.ResumableModelCheckpoint"]
    # a fixed directory (--ckpt_path last looks there), saves every 250 steps, the newest 2 kept, last.ckpt a link
    assert saver["dirpath"] == f"runs/{name}/checkpoints" and saver["every_n_train_steps"] == 250
    assert saver["save_top_k"] == 2 and (saver["monitor"], saver["mode"]) == ("step", "max")
    assert saver["save_last"] == "link" and saver["save_weights_only"] is False
    assert config["trainer"].get("enable_checkpointing", True)


def test_a_recipe_override_reaches_its_checkpoint_callback(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "qwen2.5-7b", "--trainer.callbacks.init_args.save_weights_only", "true",
              "--print_config"])
    callbacks = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    assert callbacks[-1]["init_args"]["save_weights_only"] is True


def test_tensorboard_is_one_override_of_a_recipes_logger(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "qwen2.5-7b", "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
              "--print_config"])
    logger = yaml.safe_load(capsys.readouterr().out)["trainer"]["logger"]
    assert logger["class_path"] == "lightning.pytorch.loggers.TensorBoardLogger"
    assert logger["init_args"]["save_dir"] == "runs/qwen2.5-7b"


def test_missing_config_means_demo():
    assert _with_default_config(["fit"]) == ["fit", "--config", str(DEMO_RECIPE)]
    assert _with_default_config(["fit", "--config", "x.yaml"]) == ["fit", "--config", "x.yaml"]
    assert _with_default_config(["--help"]) == ["--help"]


@pytest.mark.gpu
def test_demo_on_gpu_trains_and_generates(tmp_path):
    """Validation generates through the streamed model on the GPU (HF's ``generate`` sees a host-side model)."""
    main(
        [
            "fit",
            "--config",
            str(DEMO_RECIPE),
            "--trainer.strategy",
            STRATEGY,
            "--trainer.accelerator",
            "gpu",
            "--trainer.max_steps",
            "2",
            "--trainer.val_check_interval",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--data.max_eval_samples",
            "4",
            "--data.eval_batch_size",
            "4",
            "--model.max_generate_samples",
            "4",
            "--model.max_new_tokens",
            "4",
            "--cpu_heap_cache",
            "false",
        ]
    )
    (metrics_file,) = tmp_path.rglob("metrics.csv")
    val = [r for r in csv.DictReader(metrics_file.open()) if r.get("val/exact_match")]
    assert len(val) == 1 and 0.0 <= float(val[0]["val/exact_match"]) <= 1.0


@pytest.mark.parametrize("preset", [None, "expandable_segments:False"])
def test_cli_sets_the_allocator_option_unless_the_user_did(monkeypatch, preset, capsys):
    if preset is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", preset)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(DEMO_RECIPE), "--print_config"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (preset or "expandable_segments:True")


def test_recipes_are_the_top_level_folder_found_by_name(capsys):
    """In a checkout the recipes are its top-level recipes/ (the wheel installs it as lightning_lazytrain/recipes/:
    test_packaging.py), one copy, and `--config NAME` finds them."""
    names = recipe_names()
    assert recipes_dir() == ROOT / "recipes"
    assert set(names) >= {"demo", *GPU_RECIPES} and not list((ROOT / "lightning_lazytrain").rglob("*.yaml"))
    for name in names:
        path = recipe_path(name)
        assert path == recipe_path(name + ".yaml") and path.is_file()
    assert resolve_config_args(["fit", "--config", "qwen2.5-7b", "-c", "demo", "--config=demo.yaml"]) == [
        "fit",
        "--config",
        str(recipe_path("qwen2.5-7b")),
        "-c",
        str(DEMO_RECIPE),
        f"--config={DEMO_RECIPE}",
    ]
    assert resolve_config_args(["fit", "--config", "mine.yaml"]) == ["fit", "--config", "mine.yaml"]
    with pytest.raises(SystemExit):
        main(["fit", "--config", "qwen2.5-7b", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["model"]["pretrained"] == "Qwen/Qwen2.5-7B"


def test_a_file_wins_over_the_recipe_of_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").write_text("model: {}\n")
    assert resolve_config_args(["fit", "--config", "demo"]) == ["fit", "--config", "demo"]


def test_old_recipe_path_names_the_recipe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", "recipes/qwen2.5-7b.yaml"]) == 2
    assert (
        "recipes/qwen2.5-7b.yaml: no such file; the shipped recipe 'qwen2.5-7b' is run by name: --config qwen2.5-7b"
    ) in capsys.readouterr().err


def test_lazytrain_recipes_lists_each_with_one_line(tmp_path):
    lazytrain = Path(sys.executable).with_name("lazytrain")
    proc = subprocess.run([str(lazytrain), "recipes"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[: len(recipe_names())]}
    assert sorted(lines) == recipe_names()
    assert "tiny Qwen2-shaped model on the shipped arithmetic word problems, on the CPU." in lines["demo"]
    assert "Qwen/Qwen2.5-7B: full fine-tuning on MetaMathQA" in lines["qwen2.5-7b"]
    bad = lazytrain_in_process(["recipes", "extra"], tmp_path)
    assert bad.returncode == 2 and "takes no arguments" in bad.stderr
