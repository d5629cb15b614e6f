"""The one training loop on Accelerate (checkpoints, exact resume, evaluation, logs)."""
