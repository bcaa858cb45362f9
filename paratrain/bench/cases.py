"""The strategies `paratrain bench` compares: one small GPT, one global batch, one layout per strategy.

Every case trains the same model from the same seed on the same global batch (GLOBAL_BATCH sequences per
optimizer step), so the loss columns must agree and only memory, communication and time differ. A case is
data: a name, the strategy it shows, its config sections, and the formulas for what it costs (memory per rank
and communication per step, as in the cost model of docs/planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.errors import InvalidValueError

GLOBAL_BATCH = 16
MODELS = {
    # The benchmark GPT of benchmarks/common.py: 3.31M parameters, 128-token sequences.
    "bench": dict(vocab_size=256, seq_len=128, n_layer=4, n_head=8, d_model=256, bias=False),
    # The tests' tiny GPT (tests/cases.py): seconds per case, for smoke runs.
    "tiny": dict(vocab_size=256, seq_len=16, n_layer=4, n_head=4, d_model=32, bias=False),
}


@dataclass(frozen=True)
class Case:
    name: str
    strategy: str
    sections: dict = field(default_factory=dict)
    accumulation: int = 1
    memory_formula: str = ""
    comm_formula: str = ""
    threads: bool = False  # single-process DataParallel: N threads instead of N processes
    min_ranks: int = 2

    def layout(self, n: int) -> str:
        """The mesh the case runs on, as `paratrain train` prints it (dp4, dp2 x tp2, ...)."""
        if self.threads:
            return f"1 process x {n} threads"
        from paratrain.api import resolve_layout

        return resolve_layout(self.config(), n)[1].describe()

    def config(self, seed: int = 0) -> dict:
        return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": self.accumulation,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
                "gradient_clipping": 1.0, "steps_per_print": 10**9, "seed": seed, **self.sections}


def cases(n: int) -> list[Case]:
    """Every strategy on n ranks (n = 2 or 4; the hybrid needs 4)."""
    half = n // 2
    return [
        Case("dp", "DP (threads, one process)", threads=True, memory_formula="16Ψ (one process)",
             comm_formula="no collective: replicas in threads, gradients summed by autograd"),
        Case("ddp", "DDP", {"zero_optimization": {"stage": 0}}, memory_formula="16Ψ",
             comm_formula="all-reduce Ψ"),
        Case("zero1", "ZeRO-1", {"zero_optimization": {"stage": 1}}, memory_formula="8Ψ + 8Ψ/N",
             comm_formula="reduce-scatter Ψ + all-gather Ψ"),
        Case("zero2", "ZeRO-2", {"zero_optimization": {"stage": 2}}, memory_formula="4Ψ + 12Ψ/N",
             comm_formula="reduce-scatter Ψ + all-gather Ψ"),
        Case("zero3", "ZeRO-3 / FSDP", {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
             memory_formula="16Ψ/N", comm_formula="all-gather 2Ψ (the root unit once) + reduce-scatter Ψ"),
        Case("tp", "TP", {"tensor_parallel": {"size": n}}, memory_formula="≈ 16Ψ/tp (+ replicated norms)",
             comm_formula="per layer: 4 all-reduces of b·s·h; embedding and head 1 each"),
        Case("tp_sp", "TP + SP", {"tensor_parallel": {"size": n, "sequence_parallel": True}},
             memory_formula="≈ 16Ψ/tp (+ replicated norms)",
             comm_formula="per layer: 4 all-gathers + 4 reduce-scatters of b·s·h (TP's wire traffic)"),
        Case("pp_1f1b", "PP, 1F1B", {"pipeline": {"stages": n, "schedule": "1f1b"}}, accumulation=2 * n,
             memory_formula="16 Ψ_stage", comm_formula="per boundary: m·b·s·h each way (sent + received)"),
        Case("pp_zbh1", "PP, ZB-H1", {"pipeline": {"stages": n, "schedule": "zb-h1"}}, accumulation=2 * n,
             memory_formula="16 Ψ_stage", comm_formula="per boundary: m·b·s·h each way (sent + received)"),
        Case("cp", "CP (ring attention)", {"context_parallel": {"size": n}}, memory_formula="16Ψ",
             comm_formula="ring: K,V blocks cp−1 times per layer forward, K,V and their gradients backward; "
                          "all-reduce Ψ"),
        Case("hybrid", f"hybrid: dp{half} x tp2, ZeRO-1",
             {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 1}}, min_ranks=4,
             memory_formula="(8Ψ + 8Ψ/dp) / tp", comm_formula="TP's per layer on tp + ZeRO-1's on dp"),
    ]


def select(n: int, only: str | None) -> list[Case]:
    chosen = [c for c in cases(n) if n >= c.min_ranks]
    if only:
        names = [name.strip() for name in only.split(",") if name.strip()]
        known = {c.name for c in cases(n)}
        unknown = sorted(set(names) - known)
        if unknown:
            raise InvalidValueError(f"unknown case(s) {unknown}; choose from {', '.join(sorted(known))}")
        chosen = [c for c in chosen if c.name in names]
    return chosen
