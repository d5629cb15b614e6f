"""The decoder as a model: per-family facts, bidirectional attention and its probe, loading, tuning (full, LoRA, QLoRA), quantization, the LM head, pooling, embeddings while training, SPLADE math."""
