"""Bad recipes and command lines: exit code 2 and a message naming the key or file, before any model is built."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_in_process import lazytrain_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_lazytrain.sft import module as module_mod
from lightning_lazytrain.sft.cli import DEMO_RECIPE, main
from lightning_lazytrain.sft.recipes import recipes_dir

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(recipes_dir().glob("*.yaml"))
FUZZ = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["lazytrain"])


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the CLI gets as far as building the model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the bad input was reported")

    monkeypatch.setattr(module_mod, "build_model", refuse)


def run_cli(args: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of ``lazytrain ARGS`` run in this process."""
    proc = lazytrain_in_process(args, Path.cwd())
    return proc.returncode, proc.stderr


def _overlay(tmp_path: Path, cfg: object, name: str = "overlay.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def known_keys():
    """Every key the demo recipe's parsed config has, per section (top level under None)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", "--config", str(DEMO_RECIPE), "--print_config"])
    cfg = yaml.safe_load(out.getvalue())
    keys = {section: set(value) for section, value in cfg.items() if isinstance(value, dict)}
    keys[None] = set(cfg) | {"config", "print_config", "subcommand", "fit", "validate", "test", "predict"}
    return keys


_names = st.from_regex(r"[a-z][a-z_]{2,14}", fullmatch=True)


@FUZZ
@given(recipe=st.sampled_from(RECIPES), section=st.sampled_from([None, "model", "data", "trainer"]), key=_names)
def test_unknown_keys_exit_2_naming_the_key(tmp_path, known_keys, recipe, section, key):
    if key in known_keys[section]:
        return
    overlay = {key: 1} if section is None else {section: {key: 1}}
    code, err = run_cli(["fit", "--config", str(recipe), "--config", _overlay(tmp_path, overlay), "--print_config"])
    assert code == 2 and key in err and "Traceback" not in err


_INT_KEYS = [("data", "batch_size"), ("data", "max_seq_length"), ("data", "max_samples"), ("trainer", "max_steps"),
             ("model", "warmup_steps"), ("data", "seed")]
_FLOAT_KEYS = [("model", "lr"), ("data", "val_fraction"), ("model", "weight_decay")]
_BOOL_KEYS = [("data", "packing"), ("model", "trust_remote_code")]


def _not_a_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


_words = st.text(st.characters(categories=["Ll"]), min_size=1, max_size=8).filter(_not_a_number)
_containers = st.one_of(st.lists(st.integers(), min_size=1, max_size=3),
                        st.dictionaries(_names, st.integers(), min_size=1, max_size=2))
_bad_values = st.one_of(
    st.tuples(st.sampled_from(_INT_KEYS), st.one_of(_words, _containers, st.floats(0.1, 0.9).map(lambda f: 3 + f))),
    st.tuples(st.sampled_from(_FLOAT_KEYS), st.one_of(_words, _containers)),
    st.tuples(st.sampled_from(_BOOL_KEYS), st.one_of(st.integers(2, 100), _containers)),
)


@FUZZ
@given(recipe=st.sampled_from(RECIPES), case=_bad_values)
def test_wrong_types_exit_2_naming_the_key(tmp_path, recipe, case):
    (section, key), value = case
    overlay = _overlay(tmp_path, {section: {key: value}})
    code, err = run_cli(["fit", "--config", str(recipe), "--config", overlay, "--print_config"])
    assert code == 2 and f"{section}.{key}" in err and "Traceback" not in err


@FUZZ
@given(section=st.sampled_from(["model", "data", "trainer"]),
       value=st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False), _containers.filter(
           lambda v: isinstance(v, list))))
def test_a_section_that_is_not_a_mapping_exits_2_naming_file_and_section(tmp_path, section, value):
    overlay = _overlay(tmp_path, {section: value})
    code, err = run_cli(["fit", "--config", str(DEMO_RECIPE), "--config", overlay, "--print_config"])
    assert code == 2 and overlay in err and f"'{section}' must be a mapping" in err


@pytest.mark.parametrize(("text", "words"), [("", ["is empty"]), ("- a\n- b\n", ["mapping of sections", "list"]),
                                             ("data:\n  data_path: ${nope}\n", ["nope", "data.data_path"])])
def test_empty_list_and_interpolation_configs_exit_2(tmp_path, text, words):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, err = run_cli(["fit", "--config", str(DEMO_RECIPE), "--config", str(path), "--print_config"])
    assert code == 2 and all(w in err for w in words) and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--data.data_path", "/no/such/MetaMathQA"], ["/no/such/MetaMathQA", "does not exist", "Fix data_path"]),
     (["--data.val_fraction", "1.5"], ["data.val_fraction", "1.5", "[0, 1)"]),
     (["--data.max_seq_length", "1"], ["data.max_seq_length", ">= 2"]),
     (["--data.data_format", "csv"], ["data.data_format", "Literal", "csv"])],
)
def test_bad_data_settings_exit_2_before_the_model_is_built(no_model, args, words):
    code, err = run_cli(["fit", "--config", str(DEMO_RECIPE), *args, "--cpu_heap_cache", "false"])
    assert code == 2 and "Traceback" not in err
    for word in words:
        assert word in err


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.stem != "demo"], ids=lambda p: p.stem)
def test_gpu_recipes_report_a_missing_local_dataset_before_loading_the_model(no_model, recipe, tmp_path):
    # the GPU recipes point at data/MetaMathQA, relative to where lazytrain runs: a fresh directory has none
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code, err = run_cli(["fit", "--config", str(recipe)])
    finally:
        os.chdir(cwd)
    assert code == 2 and "data/MetaMathQA: data path does not exist" in err and "huggingface-cli download" in err


def test_a_malformed_data_file_found_at_setup_exits_2_naming_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"query": "q", "response": "r"}\n{"query": "q", "answer": "r"}\n')
    code, err = run_cli(["fit", "--config", str(DEMO_RECIPE), "--data.data_path", str(data),
                         "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "1",
                         "--trainer.enable_progress_bar", "false", "--cpu_heap_cache", "false"])
    assert code == 2 and "Traceback" not in err
    assert f"{data}:2 field 'response': missing (row has keys ['answer', 'query'])" in err and "response_key" in err


def test_console_script_exits_2_without_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "lightning_lazytrain.sft.cli", "fit", "--config", str(DEMO_RECIPE),
                           "--data.data_path", str(tmp_path / "missing.jsonl")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "warn" not in proc.stderr.lower()
    assert f"lazytrain: error: {tmp_path / 'missing.jsonl'}: data path does not exist" in proc.stderr
