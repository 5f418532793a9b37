"""The methods as small programs on one training engine (Hugging Face Trainer / Accelerate)."""
