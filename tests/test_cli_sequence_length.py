"""``data.max_seq_length`` past the model's positions is refused at setup by ``fit`` and by ``plan``, naming both
numbers and the fix (before, neither said a word: a RoPE model ran positions it never learned), from the model's
config alone: before the data is tokenized or the model built (``fit`` once did both first)."""

import pytest
from cli_in_process import lazytrain_in_process
from transformers import Qwen2Config

from lightning_lazytrain.sft.data.errors import DataSettingError
from lightning_lazytrain.sft.model_loading import check_positions_before_build, position_limit


@pytest.mark.parametrize(("command", "source"), [("fit", "model.model_config"), ("plan", "model_config (inline)")])
def test_a_sequence_past_the_models_positions_exits_2_naming_both(tmp_path, command, source):
    proc = lazytrain_in_process(
        [
            command,
            "--config",
            "demo",
            "--data.max_seq_length",
            "300",
            "--trainer.max_steps",
            "1",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "runs"),
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "training sample" not in proc.stderr, "refused after the data was tokenized: " + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "data.max_seq_length: 300 is longer than the 256 positions of the model" in last, last
    assert f"({source}: max_position_embeddings=256)" in last, last
    assert "Lower data.max_seq_length to 256 or less" in last and "max_position_embeddings" in last, last


def test_a_sequence_within_the_positions_plans(tmp_path):
    proc = lazytrain_in_process(
        ["plan", "--config", "demo", "--data.max_seq_length", "256", "--gpu", "h200", "--max_batch", "false"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("rope", "limit"),
    [
        (None, 32768),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}, 131072),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, 65536),
        ({"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 8192, "rope_theta": 1e6}, 32768),
    ],
)
def test_position_limit_counts_rope_scaling(rope, limit):
    config = Qwen2Config(max_position_embeddings=32768)
    if rope is not None:
        config.rope_parameters = rope
    assert position_limit(config) == limit


def test_the_early_check_reads_a_local_config_and_leaves_an_uncached_one_to_the_build(tmp_path):
    Qwen2Config(max_position_embeddings=128).save_pretrained(tmp_path)
    with pytest.raises(DataSettingError, match=f"model.pretrained {tmp_path}: max_position_embeddings=128"):
        check_positions_before_build({"pretrained": str(tmp_path)}, 300)
    check_positions_before_build({"pretrained": str(tmp_path)}, 128)
    # not in the hub cache: nothing is fetched here, the model's build reads it and checks the positions
    check_positions_before_build({"pretrained": "no-such-org/no-such-model"}, 10**9)
