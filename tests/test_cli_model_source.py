"""A model named on the command line replaces the recipe's other source: ``--model.pretrained DIR`` on the demo
(a random-init shape) trains DIR's model, ``--model.model_config NAME`` on a recipe of weights a random-init run.
Before, both stayed set and the module refused the pair with exit status 2."""

import yaml
from helpers import tiny_model
from test_cli_exit_status import lazytrain

from lightning_lazytrain.sft.cli import with_one_model_source
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer


def test_pretrained_on_the_demo_trains_that_model(tmp_path):
    weights = tmp_path / "weights"
    tokenizer = load_tokenizer()
    tiny_model("qwen2-tied", vocab_size=len(tokenizer), hidden_size=32).save_pretrained(weights)
    tokenizer.save_pretrained(weights)  # the module reads the tokenizer (and its chat template) of the weights
    proc = lazytrain(
        [
            "fit",
            "--config",
            "demo",
            "--model.pretrained",
            str(weights),
            "--trainer.max_steps",
            "1",
            "--trainer.limit_val_batches",
            "0",
            "--data.max_samples",
            "32",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "runs"),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the model summary gives the loaded model's size (the demo's own shape has 9.8 M parameters)
    assert "Total params: 4.9 M" in proc.stdout, proc.stdout[-2000:]


def test_model_config_on_a_recipe_of_weights_drops_its_pretrained(tmp_path):
    proc = lazytrain(
        ["fit", "--config", "qwen2.5-3b", "--model.model_config", "qwen2.5-3b", "--print_config"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = yaml.safe_load(proc.stdout)["model"]
    assert model["pretrained"] is None and model["model_config"] == "qwen2.5-3b"


def test_only_one_source_named_by_the_user_is_completed():
    demo = ["fit", "--config", "demo"]
    assert with_one_model_source([*demo, "--model.pretrained=d", "-x"]) == [
        *demo,
        "--model.pretrained=d",
        "--model.model_config",
        "null",
        "-x",
    ]
    both = [*demo, "--model.pretrained", "d", "--model.model_config", "tiny"]
    assert with_one_model_source(both) == both  # the user's own contradiction: the module's error names it
    unset = [*demo, "--model.pretrained", "null", "--model.model_config", "qwen2.5-3b"]
    assert with_one_model_source(unset) == unset
    assert with_one_model_source([*demo, "--model.pretrained", "null"]) == [*demo, "--model.pretrained", "null"]
