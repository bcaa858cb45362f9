"""Where things live: the device mesh and its named axes (`mesh.py`), each parameter's placement over them
(`placement.py`), and the record of how each local tensor was cut from the original model (`origin.py`)."""
