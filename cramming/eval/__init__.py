"""GLUE fine-tuning and evaluation: tasks, data, metrics and scores."""
