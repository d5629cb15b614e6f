"""Training text: the one reader of input files, the packed token store, resumable batches, contrastive pairs."""
