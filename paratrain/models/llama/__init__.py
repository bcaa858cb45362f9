"""The Llama family: `model.py` (the model and presets), `spec.py` (its model spec)."""
