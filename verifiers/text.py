"""OCR, choice, number and counting verifiers (to be written)."""
