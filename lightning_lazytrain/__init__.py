"""lightning-lazytrain: fine-tune LLMs too big for one GPU by streaming decoder layers from host memory."""

__version__ = "0.1.0"
