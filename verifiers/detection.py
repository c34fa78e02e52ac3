"""Detection / grounding verifier (to be written)."""
