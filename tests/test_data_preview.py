"""The sample logged at start: a long one shows its first and last tokens around a marker (a 3,287-token sample
was printed whole), its trained runs still bracketed; a short one is shown whole."""

from lightning_lazytrain.sft.data import Record, tokenize_records
from lightning_lazytrain.sft.data.preview import TRAINED_CLOSE, TRAINED_OPEN, describe_sample
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer

EDGE_TOKENS = 128  # preview.EDGE_TOKENS: tokens shown at each end


def test_a_long_sample_shows_its_edges_around_a_marker():
    tok = load_tokenizer()
    prompt = " ".join(f"p{i}" for i in range(1500))
    response = " ".join(f"r{i}" for i in range(1500))
    (ex,), _ = tokenize_records(tok, [Record.pair(prompt, response)], 8192)
    n = len(ex.input_ids)
    assert n > 4 * EDGE_TOKENS
    head, body = describe_sample(tok, ex).split("\n", 1)
    assert head.startswith(f"training sample ({n} tokens, ")
    first, last = body.split(f" [... {n - 2 * EDGE_TOKENS:,} tokens not shown ...] ")
    assert first == tok.decode(ex.input_ids[:EDGE_TOKENS])  # the prompt's start: nothing trained there
    assert last.startswith(TRAINED_OPEN) and last.endswith(TRAINED_CLOSE)  # inside the response, bracketed
    assert last == f"{TRAINED_OPEN}{tok.decode(ex.input_ids[-EDGE_TOKENS:])}{TRAINED_CLOSE}"
    assert len(body) < len(tok.decode(ex.input_ids)) / 4


def test_a_short_sample_is_shown_whole():
    tok = load_tokenizer()
    (ex,), _ = tokenize_records(tok, [Record.pair("What is 1 + 1?", "2")], 64)
    body = describe_sample(tok, ex).split("\n", 1)[1]
    assert body == tok.decode(ex.input_ids[:-3]) + f"{TRAINED_OPEN}{tok.decode(ex.input_ids[-3:])}{TRAINED_CLOSE}"
