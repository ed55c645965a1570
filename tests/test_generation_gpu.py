"""Resident evaluation on a CUDA device: the layer copies are freed before training resumes, tokens unchanged."""

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, tiny_model

from lightning_lazytrain import LazyTrainStrategy

pytestmark = pytest.mark.gpu
WIDE = dict(hidden_size=512, intermediate_size=1024)  # ~10 MiB of fp32 per layer: its copy shows in the counters
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


class _Evaluate(LMModule):
    def __init__(self, model, prompts):
        super().__init__(model)
        self.prompts, self.generated, self.allocated_in_eval = prompts, [], []

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.generated.append(self.model.generate(self.prompts.cuda(), **GREEDY).cpu())
        self.allocated_in_eval.append(torch.cuda.memory_allocated())


class _Allocated(pl.Callback):
    """Allocated bytes when each evaluation starts and when the training batch after it starts (the strategy
    releases the copies at the evaluation's end, after the callbacks' own end hooks)."""

    def __init__(self):
        self.before_eval, self.next_batch = [], []

    def on_validation_start(self, trainer, module):
        self.before_eval.append(torch.cuda.memory_allocated())

    def on_train_batch_start(self, trainer, *args):
        if len(self.next_batch) < len(self.before_eval):
            self.next_batch.append(torch.cuda.memory_allocated())


def _fit(model, prompts, mode):
    module, probe = _Evaluate(copy.deepcopy(model), prompts), _Allocated()
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=LazyTrainStrategy(generation=mode), max_steps=4,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=1,
                         limit_val_batches=1, check_val_every_n_epoch=None, callbacks=[probe])
    trainer.fit(module, loader(batches(4)), loader(batches(1, seed=7)))
    return module, probe


def test_resident_evaluation_frees_its_copies_and_decodes_the_streamed_tokens():
    model = tiny_model("qwen2", **WIDE)
    prompts = torch.randint(1, 512, (4, 12), generator=torch.Generator().manual_seed(5))
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resident, probe = _fit(model, prompts, "resident")
        streamed, streamed_probe = _fit(model, prompts, "streamed")
    # CUDA prompts with host-side weights: HF's device-mismatch warning does not apply to a streamed model
    assert not [w for w in caught if "being on a device type different" in str(w.message)]
    # the 2nd and 3rd evaluations (no training batch follows the 4th): the metric tensors exist since the 1st
    rows = zip(probe.before_eval, resident.allocated_in_eval, probe.next_batch, streamed_probe.before_eval,
               streamed_probe.next_batch)
    for before, during, after, streamed_before, streamed_after in list(rows)[1:]:
        assert during - before >= layer_bytes, "the layers must be resident while the evaluation decodes"
        # what Lightning holds across an evaluation (its last batch, logged scalars) is the same in both modes; a
        # resident copy left behind would add at least one parameter
        leaked = (after - before) - (streamed_after - streamed_before)
        assert leaked == 0, f"{leaked} bytes more than the streamed mode still allocated after the evaluation"
    assert len(resident.generated) == len(streamed.generated) == 4
    assert all(torch.equal(a, b) for a, b in zip(resident.generated, streamed.generated))
    # the last evaluation ran after the last step: plain HF generate over the final weights gives its tokens
    plain = copy.deepcopy(resident.model).cuda().generate(prompts.cuda(), **GREEDY).cpu()
    assert torch.equal(plain, resident.generated[-1])
    assert not torch.equal(resident.generated[0], resident.generated[-1]), "the evaluations must see training"
