import time, os
os.environ["DS_ACCELERATOR"]="cpu"
from paratrain.testing import World
def f(): 
    import paratrain; return 1
def g():
    import deepspeed; return 1
for fn in (f, f, g):
    t=time.perf_counter()
    with World(2) as w: w.run(fn)
    print(fn.__name__, time.perf_counter()-t)
t=time.perf_counter()
with World(4) as w: w.run(f)
print("4", time.perf_counter()-t)
