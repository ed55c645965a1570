"""An unknown ``--config`` name: one line naming the closest shipped recipe and all of them, exit status 2 (the
parser printed its 98-line usage and "File does not exist")."""

import pytest
from cli_in_process import lazytrain_in_process

from lightning_lazytrain.sft.recipes import recipe_names


@pytest.mark.parametrize(
    ("command", "name", "closest"),
    [("fit", "qwen-7b", "qwen2.5-7b"), ("plan", "dmeo", "demo"), ("validate", "no_such_thing", None)],
)
def test_an_unknown_config_name_lists_the_recipes_and_exits_2(tmp_path, command, name, closest):
    proc = lazytrain_in_process([command, "--config", name], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    guess = f"did you mean --config {closest}? " if closest else ""
    assert line == (
        f"lazytrain: error: --config {name}: no such file or shipped recipe; {guess}the shipped recipes: "
        + ", ".join(recipe_names())
    )
    assert proc.stdout == ""


def test_a_yaml_string_is_still_a_config(tmp_path):
    proc = lazytrain_in_process(["fit", "--config", "trainer: {max_steps: 7}", "--print_config"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_steps: 7" in proc.stdout
