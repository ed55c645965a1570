"""Row formats, chat templates and loss masks: the trained text is exactly each assistant turn plus its closer."""

import json

import pytest
import torch

from lightning_lazytrain.sft.data import IGNORE_INDEX, DataFormatError, Record, read_records, tokenize_records
from lightning_lazytrain.sft.data.preview import describe_sample
from lightning_lazytrain.sft.data.tokenizer import PLAIN_CHAT_TEMPLATE, load_tokenizer

# Meta-Llama-3-8B-Instruct's chat template as published in its tokenizer_config.json
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen3's rule that matters for masks: the last assistant turn after the last user turn gets a think block (empty
# without reasoning), earlier ones do not; enable_thinking=False opens the generation turn with the same block
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role != 'assistant' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif loop.index0 > ns.last_user and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": " 6, so the answer is: 6 "},
]


def _tok(template=None, llama=False):
    tok = load_tokenizer()
    if llama:
        tok.add_special_tokens(
            {
                "bos_token": "<|begin_of_text|>",
                "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            }
        )
    if template:
        tok.chat_template = template
    return tok


def _write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trained_texts(tok, ex):
    runs, cur = [], []
    for t, lab in zip(ex.input_ids.tolist(), ex.labels.tolist()):
        if lab != IGNORE_INDEX:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize(
    ("template", "llama", "closer"),
    [
        (None, False, "<|im_end|>\n"),
        (LLAMA3_TEMPLATE, True, "<|eot_id|>"),
        (QWEN3_LIKE_TEMPLATE, False, "<|im_end|>\n"),
    ],
    ids=["qwen2.5", "llama3", "qwen3-think"],
)
def test_every_assistant_turn_and_only_those_is_trained(tmp_path, template, llama, closer):
    tok = _tok(template, llama)
    (rec,) = read_records(_write(tmp_path, [{"messages": CHAT}]))
    assert rec.messages[-1] == ("assistant", " 6, so the answer is: 6 ") and rec.prompt == "And 3 + 3?"
    (ex,), skipped = tokenize_records(tok, [rec], 512)
    six = "6, so the answer is: 6" if llama else " 6, so the answer is: 6 "  # Llama 3's template trims the turn
    assert skipped == 0 and _trained_texts(tok, ex) == ["4" + closer, six + closer]
    assert tok.decode(ex.input_ids.tolist()) == tok.apply_chat_template(CHAT, tokenize=False)
    (last,), _ = tokenize_records(tok, [rec], 512, assistant_turns="last")
    assert _trained_texts(tok, last) == [six + closer]
    prompt = tok.decode(ex.prompt_ids.tolist())
    assert prompt == tok.apply_chat_template(
        CHAT[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert ex.answer == "6"


def test_sharegpt_alpaca_prompt_completion_and_metamath_rows(tmp_path):
    tok = _tok()
    share = [
        {
            "conversations": [
                {"from": m["role"].replace("user", "human").replace("assistant", "gpt"), "value": m["content"]}
                for m in CHAT
            ]
        }
    ]
    a = tokenize_records(tok, read_records(_write(tmp_path, share, "s.jsonl")), 512)[0][0]
    b = tokenize_records(tok, read_records(_write(tmp_path, [{"messages": CHAT}], "m.jsonl")), 512)[0][0]
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    pairs = {
        "alpaca": {"instruction": "Add", "input": "2 and 3", "output": "5"},
        "prompt_completion": {"prompt": "Add 2 and 3", "completion": "5"},
        "metamath": {"query": "Add 2 and 3", "response": "5"},
    }
    for name, row in pairs.items():
        (rec,) = read_records(_write(tmp_path, [row], f"{name}.jsonl"))
        assert rec.messages == (("user", "Add\n2 and 3" if name == "alpaca" else "Add 2 and 3"), ("assistant", "5"))


def test_plain_text_trains_every_token_and_ends_with_eos(tmp_path):
    tok = _tok()
    (rec,) = read_records(_write(tmp_path, [{"text": "Once upon a time."}]))
    (ex,), _ = tokenize_records(tok, [rec], 64)
    assert ex.input_ids.tolist() == tok("Once upon a time.").input_ids + [tok.eos_token_id]
    assert torch.equal(ex.labels, ex.input_ids) and len(ex.prompt_ids) == 0 and ex.answer is None


def test_data_format_forces_one_and_auto_takes_the_first_row(tmp_path):
    rows = [{"text": "plain words", "query": "q", "response": "r"}]
    assert read_records(_write(tmp_path, rows), fmt="text")[0].is_text
    assert read_records(_write(tmp_path, rows))[0].messages == (("user", "q"), ("assistant", "r"))
    mixed = _write(tmp_path, [{"messages": CHAT}, {"query": "q", "response": "r"}], "mixed.jsonl")
    with pytest.raises(DataFormatError, match=r"mixed.jsonl:2 field 'messages': missing"):
        read_records(mixed)


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", ["unknown role 'robot'", "'user'"]),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages", ["no assistant turn", "data_format: text"]),
        ({"messages": [{"role": "user"}]}, "messages[0]", ["needs 'role' and 'content'"]),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
            "messages[1].content",
            ["empty assistant turn"],
        ),
        ({"messages": "hi"}, "messages", ["not a non-empty list"]),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "conversations[0].from", ["unknown role", "'human'"]),
        ({"text": ""}, "text", ["empty text"]),
    ],
)
def test_bad_chat_rows_name_file_line_field_and_fix(tmp_path, row, field, words):
    path = _write(tmp_path, [{"messages": CHAT}, row] if "messages" in row else [row])
    line = 2 if "messages" in row else 1
    with pytest.raises(DataFormatError) as info:
        read_records(path)
    assert (info.value.line, info.value.field) == (line, field) and str(info.value).startswith(f"{path}:{line}")
    for word in words:
        assert word in str(info.value)


def test_tokenizer_without_a_template_gets_the_plain_one(tmp_path):
    tok = _tok(PLAIN_CHAT_TEMPLATE)
    (ex,), _ = tokenize_records(tok, [Record.pair("Hi?", "Hello.")], 64)
    assert tok.decode(ex.input_ids.tolist()) == "User: Hi?\nAssistant:\nHello.<|im_end|>\n"
    assert _trained_texts(tok, ex) == ["Hello.<|im_end|>\n"]
    assert tok.decode(ex.prompt_ids.tolist()) == "User: Hi?\nAssistant:\n"


def test_preview_brackets_exactly_the_trained_text():
    tok = _tok()
    (ex,), _ = tokenize_records(tok, [Record.pair("What is 1 + 1?", "2")], 64)
    text = describe_sample(tok, ex)
    assert text.endswith("<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n[[2<|im_end|>\n]]")
    assert f"({len(ex.input_ids)} tokens, 3 trained on" in text.splitlines()[0]


def test_the_models_own_tokenizer_and_template_are_the_default(tmp_path):
    from types import SimpleNamespace

    from lightning_lazytrain.sft.data import DataSettingError, SFTDataModule

    _tok(LLAMA3_TEMPLATE, llama=True).save_pretrained(tmp_path / "model")

    def attached(dm, hparams):
        dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(hparams=hparams))
        return dm

    own = attached(SFTDataModule(), {"pretrained": str(tmp_path / "model")}).tokenizer
    assert own.chat_template == LLAMA3_TEMPLATE and own.bos_token == "<|begin_of_text|>"
    named = attached(SFTDataModule(tokenizer="qwen2.5"), {"pretrained": str(tmp_path / "model")}).tokenizer
    assert "<|im_start|>" in named.chat_template  # an explicit data.tokenizer wins
    assert "<|im_start|>" in attached(SFTDataModule(), {"pretrained": None}).tokenizer.chat_template
    (tmp_path / "weights_only").mkdir()
    with pytest.raises(DataSettingError, match="(?s)tokenizer of model.pretrained=.*Set data.tokenizer"):
        _ = attached(SFTDataModule(), {"pretrained": str(tmp_path / "weights_only")}).tokenizer


def test_several_processes_tokenize_to_the_same_examples():
    tok = _tok()
    records = [Record.pair(f"What is {i} + 2?", f"The answer is: {i + 2}") for i in range(40)]
    one, skipped_one = tokenize_records(tok, records, 64, chunk_size=8)
    many, skipped_many = tokenize_records(tok, records, 64, num_proc=2, chunk_size=8)
    assert skipped_one == skipped_many == 0 and len(one) == len(many) == 40
    for a, b in zip(one, many):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels) and a.answer == b.answer


def test_generation_stops_at_the_templates_end_of_turn():
    from lightning_lazytrain.sft.data.tokenizer import end_of_turn_id

    qwen, llama = _tok(), _tok(LLAMA3_TEMPLATE, llama=True)
    assert end_of_turn_id(qwen) == 151645  # <|im_end|>
    assert end_of_turn_id(llama) == llama.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn_id(_tok(PLAIN_CHAT_TEMPLATE)) == qwen.eos_token_id
