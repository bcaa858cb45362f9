"""The GPT family: `model.py` (the model and presets), `spec.py` (its model spec), `hf_names.py` (its Hugging
Face GPT-2 names)."""
