"""attnstash where training starts: the transformers Trainer callback (trainer.py)."""
