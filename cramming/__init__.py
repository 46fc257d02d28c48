"""cramming: pretrain a BERT-style model on one GPU within a wall-clock budget, then evaluate it on GLUE."""

__version__ = "0.1.0"
