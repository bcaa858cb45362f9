"""The parallel strategies, one package per mesh dimension — `dp/` (DDP, ZeRO-1/2/3), `tp/` (tensor and
sequence parallel), `cp/` (ring, Ulysses, USP), `pp/` (pipeline schedules and runtime), `ep/` (experts) — plus
activation recomputation (`recompute.py`) and `parallelize.py`, which applies them to a model in order."""
