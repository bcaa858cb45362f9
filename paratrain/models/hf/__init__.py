"""Any transformers causal LM: `model.py` (the layered view), `spec.py` (its model spec), `plan.py` (its TP plan),
`moe.py` (its MoE blocks), `pretrained.py` (`from_pretrained`)."""
