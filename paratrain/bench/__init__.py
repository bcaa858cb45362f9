"""`paratrain bench`: DP, DDP, ZeRO-1/2/3, TP, TP+SP, PP (1F1B, ZB-H1), CP and a hybrid on the same GPT and
global batch, with model state per rank and communication per step counted exactly and time measured.

cases.py (the strategies as data), run.py (one fresh world per case), table.py (markdown, written between
markers into docs/strategies.md), cli.py (the subcommand).
"""
