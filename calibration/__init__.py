"""Calibration data, a leaf: the two decoding modes, step-cost models and calibrated profiles.

The simulator, the latency model, the config and the command line all read it; it imports
nothing else of specgate.
"""
