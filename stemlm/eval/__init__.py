"""Evaluation: tasks ask a language model for log-likelihoods and generations through ``api.py``."""
