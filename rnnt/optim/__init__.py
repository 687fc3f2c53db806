"""Optimizer pieces: LAMB, the MLPerf learning-rate policy and the weight EMA."""
