"""Data-parallel strategies: DP (threads, one process), DDP and the ZeRO stages on the dp axis."""
