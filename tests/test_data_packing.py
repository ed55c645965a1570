"""Packed rows: every sample sees only itself (positions restart, attention stays inside the sample)."""

import pytest
import torch
from helpers import VOCAB, rel_diff, tiny_model, train

from lightning_lazytrain.sft.data import IGNORE_INDEX, Example, SFTCollator, model_inputs, pack_examples

LENGTHS = (5, 9, 3, 7)


def _samples(seed: int = 0) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.int32)
        labels = ids.clone()
        labels[: n // 3] = IGNORE_INDEX  # a prompt
        out.append(Example(ids, labels, ids[: n // 3], None))
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_each_packed_sample_gives_the_logits_it_gives_alone(family, attn):
    model = tiny_model(family)
    model.config._attn_implementation = attn
    model.eval()
    samples = _samples()
    (row,) = pack_examples(samples, sum(LENGTHS))
    batch = SFTCollator(pad_id=0, pad_to_multiple_of=32)([row])  # padding after the row too
    assert batch["position_ids"][0, : sum(LENGTHS)].tolist() == [p for n in LENGTHS for p in range(n)]
    assert "attention_mask" not in batch and batch["use_cache"] is False  # either one would join the samples
    with torch.no_grad():
        packed = model(**batch).logits[0]
        leaky = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=torch.ones_like(batch["input_ids"]),
        ).logits[0]
        start, worst_leak = 0, 0.0
        for s in samples:
            alone = model(input_ids=s.input_ids.long()[None]).logits[0]
            got = packed[start : start + len(s.input_ids)]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
            worst_leak = max(worst_leak, float((leaky[start : start + len(s.input_ids)] - alone).abs().max()))
            start += len(s.input_ids)
    assert worst_leak > 1e-2, "plain causal concatenation must differ (else this test could not fail)"


def test_packed_loss_is_the_loss_of_the_samples_alone():
    model = tiny_model("qwen2")
    samples = _samples(1)
    packed = SFTCollator(pad_id=0)(pack_examples(samples, 16))  # two rows
    assert packed["input_ids"].shape[0] == 2
    with torch.no_grad():
        got = model(**packed).loss
        total, count = 0.0, 0
        for s in samples:
            logits = model(input_ids=s.input_ids.long()[None]).logits[0, :-1]
            gold = s.labels.long()[1:]
            keep = gold != IGNORE_INDEX
            total += float(torch.nn.functional.cross_entropy(logits[keep], gold[keep], reduction="sum"))
            count += int(keep.sum())
    assert float(got) == pytest.approx(total / count, rel=1e-5)


def test_a_sample_start_is_never_a_label_of_the_previous_sample():
    # plain text trains every token; in a packed row the first token of a sample must not be predicted from the last
    # token of the sample before it
    a = Example(torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.int32), [], None)
    b = Example(torch.tensor([4, 5], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32), [], None)
    (row,) = pack_examples([a, b], 8)
    assert row.labels.tolist() == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1]


def test_packed_batches_train_through_lazytrain_as_plain_lightning():
    model = tiny_model("qwen2")
    data = []
    for seed in range(3):
        data.append(SFTCollator(pad_id=0)(pack_examples(_samples(seed), 16)))
    ref, _ = train(model, data)
    lt, _ = train(model, data, strategy="lazytrain")
    assert rel_diff(ref.model, model) > 1e-3
    assert lt.losses == pytest.approx(ref.losses, rel=1e-6)
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_model_inputs_leave_out_only_the_generation_fields():
    samples = _samples()
    padded = SFTCollator(pad_id=0, generation=True)(samples)
    assert set(model_inputs(padded)) == {"input_ids", "attention_mask", "labels"}
    assert padded["attention_mask"].sum(1).tolist() == list(LENGTHS)  # a batch that is not packed keeps its mask
    packed = SFTCollator(pad_id=0)(pack_examples(samples, 16))
    assert model_inputs(packed).keys() == packed.keys() == {"input_ids", "labels", "position_ids", "use_cache"}
