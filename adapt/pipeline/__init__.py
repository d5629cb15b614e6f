"""What a command runs: one stage, a chain of stages, convert, re-export from a folder or a checkpoint, classification fine-tuning."""
