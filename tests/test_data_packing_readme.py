"""A packed batch of `SFTDataModule` keeps its samples apart however the module passes it on.

The README's module forwards the whole batch, ``self.model(**batch)``, with no `model_inputs` in between; through
plain HF and through the lazytrain strategy alike every packed sample must give the logits (and loss) it gives alone.
"""

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers import loader, tiny_model

from lightning_lazytrain.sft.data import IGNORE_INDEX, SFTDataModule

QWEN_VOCAB = 151669  # the offline Qwen tokenizer the demo set is tokenized with
SEQ = 128  # three demo samples of ~40 tokens to a row


class ReadmeModule(pl.LightningModule):
    """The README's module: the batch goes to the model as it is."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []
        self.logits: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        self.logits.append(self.model(**batch).logits)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def packed() -> tuple[dict, list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """A packed training batch, and for each of its rows the samples it packs (their ids and labels); tokenized
    once for the module (the tests only read it)."""
    kw = dict(
        max_seq_length=SEQ, val_fraction=0.0, max_samples=12, batch_size=2, cache_tokenized=False, show_sample=False
    )
    packed, alone = SFTDataModule("demo", packing=True, **kw), SFTDataModule("demo", **kw)
    packed.setup("fit")
    alone.setup("fit")
    samples = iter(alone.train_set[i] for i in range(len(alone.train_set)))
    groups = []  # pack_examples keeps the sample order, so each row is the next run of samples
    for k in range(len(packed.train_set)):
        group, length = [], 0
        while length < len(packed.train_set[k].input_ids):
            group.append(next(samples))
            length += len(group[-1].input_ids)
        groups.append(group)
    batch = next(iter(packed.train_dataloader()))
    ids, labels = [], []
    for row in batch["input_ids"]:
        (k,) = [
            k
            for k, g in enumerate(groups)
            if torch.equal(row[: sum(len(e.input_ids) for e in g)], torch.cat([e.input_ids for e in g]).long())
        ]
        ids.append([e.input_ids.long() for e in groups[k]])
        labels.append([e.labels.long() for e in groups[k]])
    assert len(ids) == 2 and all(len(g) >= 2 for g in ids), "each row must pack several samples"
    assert len({sum(map(len, g)) for g in ids}) == 2, "rows of two lengths, so one is padded"
    return batch, ids, labels


def _model(family: str, attn: str = "sdpa") -> torch.nn.Module:
    model = tiny_model(family, vocab_size=QWEN_VOCAB, tie_word_embeddings=True)
    model.config._attn_implementation = attn
    return model


def _alone(model: torch.nn.Module, ids: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    with torch.no_grad():
        return [[model(input_ids=s[None]).logits[0] for s in row] for row in ids]


def _assert_each_sample_as_alone(logits: torch.Tensor, alone: list[list[torch.Tensor]]) -> None:
    for row, samples in zip(logits, alone, strict=True):
        start = 0
        for own in samples:
            torch.testing.assert_close(row[start : start + len(own)], own, rtol=1e-5, atol=1e-5)
            start += len(own)


def _loss_alone(alone: list[list[torch.Tensor]], labels: list[list[torch.Tensor]]) -> float:
    """HF's loss of the batch from the samples alone: mean cross entropy over every trained next token."""
    total, count = 0.0, 0
    for logit_row, label_row in zip(alone, labels, strict=True):
        for logits, gold in zip(logit_row, label_row, strict=True):
            gold = gold[1:]  # a packed sample's first label is ignored, as nothing predicts a first token alone
            keep = gold != IGNORE_INDEX
            total += float(torch.nn.functional.cross_entropy(logits[:-1][keep], gold[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_the_readme_forward_of_a_packed_batch_gives_each_sample_its_own_logits(packed, family, attn):
    model = _model(family, attn)
    batch, ids, labels = packed
    module = ReadmeModule(model).train()  # as in a training step: config.use_cache stays at its default
    with torch.no_grad():
        out = module.model(**batch)
    alone = _alone(model, ids)
    _assert_each_sample_as_alone(out.logits, alone)
    assert float(out.loss) == pytest.approx(_loss_alone(alone, labels), rel=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_the_readme_module_keeps_packed_samples_apart_through_lazytrain(packed, family):
    model = _model(family)
    batch, ids, labels = packed
    alone = _alone(model, ids)
    trainer_kw = dict(
        accelerator="cpu",
        devices=1,
        strategy="lazytrain",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    # with labels the strategy returns the loss only: the logits come from a forward without them
    evaluated = ReadmeModule(copy.deepcopy(model))
    pl.Trainer(**trainer_kw).validate(
        evaluated, loader([{k: v for k, v in batch.items() if k != "labels"}]), verbose=False
    )
    _assert_each_sample_as_alone(evaluated.logits[0], alone)
    trained = ReadmeModule(copy.deepcopy(model))
    pl.Trainer(max_steps=1, num_sanity_val_steps=0, **trainer_kw).fit(trained, loader([batch]))
    assert trained.losses[0] == pytest.approx(_loss_alone(alone, labels), rel=1e-5)
