"""Calibration: capture activations on calibration windows, hand them to the method, write the artifact."""
