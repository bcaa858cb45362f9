"""The Llama with mixture-of-experts layers: `model.py` (the model and presets), `spec.py` (its model spec)."""
