"""Building models bigger than one rank: allocation-free construction (`empty.py`: `init_empty`, meta tensors),
the recorded initialization replayed on each rank's shard (`replay.py`), and the sharded draw that never
materializes a full tensor (`sharded.py`)."""
