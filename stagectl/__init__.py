"""stagectl: post-training for detection vision-language models."""

__version__ = "0.1.0"
