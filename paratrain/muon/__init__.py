"""Muon, exact in every layout: torch's arithmetic (`newton_schulz`), the hybrid optimizer with its AdamW part
(`optimizer`), and the layouts that let ranks holding parts of matrices orthogonalize them whole (`layout`,
`matrices`)."""

from paratrain.muon.layout import MasterLayout, Piece
from paratrain.muon.newton_schulz import muon_shape_problem
from paratrain.muon.optimizer import Muon, whole_parameter_layout

__all__ = ["MasterLayout", "Muon", "Piece", "muon_shape_problem", "whole_parameter_layout"]
