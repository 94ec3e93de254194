"""Per-step additive terms on the log-probs (fairseq's penalties; LMBR later)."""
